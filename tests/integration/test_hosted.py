"""transformers.Trainer subclasses on Ray workers with transformers' own loop on each rank (raytrainer/hosted.py):
TRL's own scripts with only their imports changed, and a user's subclass with its own ``compute_loss``."""

from __future__ import annotations

import json
import os
import runpy
import statistics
import sys

import pytest
from hosted_fixtures import trl_script_on_ray, write_text_data, write_tiny_lm

pytest.importorskip("trl")

SFT_FLAGS = ["--model_name_or_path", "tiny-model", "--dataset_name", "data", "--max_steps", "10",
             "--logging_steps", "1", "--save_steps", "5", "--learning_rate", "1e-3", "--max_length", "32",
             "--report_to", "none", "--use_cpu", "--disable_tqdm", "True"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A script's working directory with the model folder and data set it names by relative path."""
    monkeypatch.chdir(tmp_path)
    write_tiny_lm("tiny-model")
    write_text_data("data")
    return tmp_path


def run_script(path: str, *argv: str, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [path, *argv])
    runpy.run_path(path, run_name="__main__")


def losses(checkpoint: str) -> dict[int, float]:
    """The per-step training loss logged up to ``checkpoint`` (its trainer_state.json)."""
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        history = json.load(f)["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def final_train_loss(output_dir: str) -> float:
    return statistics.fmean(losses(os.path.join(output_dir, "checkpoint-10")).values())


@pytest.mark.timeout(600)
def test_trl_sft_script_on_two_workers_trains_as_in_one_process_and_resumes(workdir, monkeypatch):
    from transformers import AutoModelForCausalLM

    script = trl_script_on_ray("sft", str(workdir))
    # The noise: the same script in one process (TRL's own trainer, num_workers=0), three data orders.
    one = []
    for seed in (1, 2, 3):
        run_script(script, *SFT_FLAGS, "--output_dir", f"one-{seed}", "--seed", str(seed),
                   "--per_device_train_batch_size", "4", "--num_workers", "0", monkeypatch=monkeypatch)
        one.append(final_train_loss(f"one-{seed}"))
    noise = max(one) - min(one)

    # Two Ray workers, the same global batch (2 x 2).
    run_script(script, *SFT_FLAGS, "--output_dir", "two", "--seed", "1", "--per_device_train_batch_size", "2",
               "--num_workers", "2", monkeypatch=monkeypatch)
    curve = losses("two/checkpoint-10")
    assert sorted(curve) == list(range(1, 11))
    assert statistics.fmean([curve[9], curve[10]]) < statistics.fmean([curve[1], curve[2]]) - 0.05  # it learns
    two = final_train_loss("two")
    assert abs(two - statistics.fmean(one)) <= max(2 * noise, 0.01), (two, one)
    # The output folder is a model folder, as under accelerate launch.
    model = AutoModelForCausalLM.from_pretrained("two")
    assert type(model).__name__ == "GPT2LMHeadModel"

    # Resumed from the step-5 checkpoint on two workers: the same loss curve on.
    run_script(script, *SFT_FLAGS, "--output_dir", "resumed", "--seed", "1", "--per_device_train_batch_size",
               "2", "--num_workers", "2", "--resume_from_checkpoint", "two/checkpoint-5", monkeypatch=monkeypatch)
    again = losses("resumed/checkpoint-10")
    assert [again[s] for s in range(6, 11)] == pytest.approx([curve[s] for s in range(6, 11)], abs=1e-4)
