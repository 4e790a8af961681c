"""transformers.Trainer subclasses on Ray workers, transformers' own loop on each rank (raytrainer/hosted.py):
TRL's own scripts, from the installed TRL with only their imports changed, and a user's subclass.

How "within noise" is measured: the same script runs in one process (TRL's own trainer, ``num_workers=0``)
with two seeds (two data orders); the two-worker run's final train loss must be within twice their spread
(and never needs to be closer than 0.01) of their mean. The global batch is the same (4 x 1 and 2 x 2).
"""

from __future__ import annotations

import json
import os
import runpy
import statistics
import sys

import pytest
from hosted_fixtures import (
    REWARD_MODULE,
    trl_script_on_ray,
    write_preference_data,
    write_text_data,
    write_tiny_lm,
)

pytest.importorskip("trl")

COMMON = ["--model_name_or_path", "tiny-model", "--max_steps", "12", "--logging_steps", "1", "--save_steps",
          "6", "--learning_rate", "5e-3", "--report_to", "none", "--use_cpu", "--disable_tqdm", "True"]

#: script, its own flags, how to load what it saved
SCRIPTS = {
    "sft": ("sft", ["--dataset_name", "data", "--max_length", "32"], "causal-lm"),
    "sft-peft": ("sft", ["--dataset_name", "data", "--max_length", "32", "--use_peft", "--lora_r", "8",
                         "--lora_alpha", "16"], "peft"),
    "dpo": ("dpo", ["--dataset_name", "preferences", "--max_length", "32"], "causal-lm"),
    "reward": ("reward", ["--dataset_name", "preferences", "--max_length", "32"], "sequence-classification"),
}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A script's working directory with the model folder and data sets it names by relative path."""
    monkeypatch.chdir(tmp_path)
    write_tiny_lm("tiny-model")
    write_text_data("data")
    write_preference_data("preferences")
    return tmp_path


def run_script(path: str, *argv: str, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [path, *argv])
    runpy.run_path(path, run_name="__main__")


def losses(checkpoint: str) -> dict[int, float]:
    """The training loss logged at each step up to ``checkpoint`` (its trainer_state.json)."""
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        history = json.load(f)["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def load_saved(kind: str, folder: str):
    import transformers

    if kind == "peft":
        from peft import PeftModel

        base = transformers.AutoModelForCausalLM.from_pretrained("tiny-model")
        return PeftModel.from_pretrained(base, folder)
    auto = {"causal-lm": transformers.AutoModelForCausalLM,
            "sequence-classification": transformers.AutoModelForSequenceClassification}[kind]
    return auto.from_pretrained(folder)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_a_trl_script_on_two_workers_trains_as_in_one_process_and_resumes(name, workdir, monkeypatch):
    script_name, flags, kind = SCRIPTS[name]
    script = trl_script_on_ray(script_name, str(workdir))
    flags = [*COMMON, *flags]
    one = []
    for seed in (1, 2):
        run_script(script, *flags, "--output_dir", f"one-{seed}", "--seed", str(seed),
                   "--per_device_train_batch_size", "4", "--num_workers", "0", monkeypatch=monkeypatch)
        one.append(statistics.fmean(losses(f"one-{seed}/checkpoint-12").values()))
    noise = max(one) - min(one)

    run_script(script, *flags, "--output_dir", "two", "--seed", "1", "--per_device_train_batch_size", "2",
               "--num_workers", "2", monkeypatch=monkeypatch)
    curve = losses("two/checkpoint-12")
    assert sorted(curve) == list(range(1, 13))
    first = statistics.fmean(curve[s] for s in (1, 2, 3))
    assert statistics.fmean(curve[s] for s in (10, 11, 12)) < first, curve  # it learns
    two = statistics.fmean(curve.values())
    print(f"{name}: final train loss, 2 workers {two:.4f}; one process {one} (noise {noise:.4f})")
    assert abs(two - statistics.fmean(one)) <= max(2 * noise, 0.01), (two, one)
    model = load_saved(kind, "two")  # the output folder is a model folder, as under accelerate launch
    if kind == "peft":
        assert os.path.exists("two/adapter_model.safetensors") and not os.path.exists("two/model.safetensors")
        assert model.peft_config["default"].r == 8

    # Resumed from the step-6 checkpoint, on two workers: the same loss curve on.
    run_script(script, *flags, "--output_dir", "resumed", "--seed", "1", "--per_device_train_batch_size", "2",
               "--num_workers", "2", "--resume_from_checkpoint", "two/checkpoint-6", monkeypatch=monkeypatch)
    again = losses("resumed/checkpoint-12")
    assert [again[s] for s in range(7, 13)] == pytest.approx([curve[s] for s in range(7, 13)], abs=1e-4)


@pytest.mark.timeout(300)
def test_trl_grpo_script_on_two_workers_generates_with_transformers_and_a_rule_based_reward(workdir,
                                                                                          monkeypatch):
    (workdir / "rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(workdir))
    script = trl_script_on_ray("grpo", str(workdir))
    run_script(script, "--model_name_or_path", "tiny-model", "--dataset_name", "preferences", "--output_dir",
               "grpo", "--max_steps", "4", "--per_device_train_batch_size", "2", "--num_generations", "2",
               "--max_completion_length", "8", "--logging_steps", "1", "--save_steps", "2", "--learning_rate",
               "1e-3", "--report_to", "none", "--use_cpu", "--disable_tqdm", "True", "--reward_funcs",
               "rewards.counts_on", "--num_workers", "2", monkeypatch=monkeypatch)
    with open("grpo/checkpoint-4/trainer_state.json") as f:
        history = json.load(f)["log_history"]
    steps = [h for h in history if "reward" in h]
    assert [h["step"] for h in steps] == [1, 2, 3, 4]
    assert all(h["completions/mean_length"] > 0 for h in steps)  # generated by each rank's model.generate
    assert any(h["grad_norm"] > 0 for h in steps)
    import transformers

    transformers.AutoModelForCausalLM.from_pretrained("grpo")


def test_grpo_with_a_vllm_server_is_refused_on_the_driver(tmp_path):
    from raytrainer.trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="server", num_workers=2,
                      use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=r"vllm_mode='server'.*use_vllm=False"):
        GRPOTrainer(model="tiny-model", reward_funcs=[len], args=args, train_dataset=[])
