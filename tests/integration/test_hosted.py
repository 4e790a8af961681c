"""transformers.Trainer subclasses on Ray workers, transformers' own loop on each rank (raytrainer/hosted.py):
TRL's own scripts, from the installed TRL with only their imports changed, and a user's subclass.

How "within noise" is measured: the same script runs in one process (TRL's own trainer, ``num_workers=0``)
with two seeds (two data orders); the two-worker run's final train loss must be within twice their spread
(and never needs to be closer than 0.01) of their mean. The global batch is the same (4 x 1 and 2 x 2).
"""

from __future__ import annotations

import json
import os
import re
import runpy
import statistics
import sys
import threading
import time

import psutil
import pytest
from hosted_fixtures import (
    REWARD_MODULE,
    ZERO3,
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
@pytest.mark.parametrize("name", ["sft", "sft-peft", "dpo", "reward"])
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

    # The LoRA run also pushes, from the driver: each committed checkpoint, then the script's push_to_hub
    # (a file:// repository: the live Hub is out of reach here).
    push = ["--push_to_hub", "--hub_model_id", f"file://{workdir}/hub", "--hub_strategy", "every_save"]
    run_script(script, *flags, "--output_dir", "two", "--seed", "1", "--per_device_train_batch_size", "2",
               "--num_workers", "2", *(push if kind == "peft" else []), monkeypatch=monkeypatch)
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
        pushed = workdir / "hub" / "main"
        assert (pushed / "adapter_model.safetensors").exists() and (pushed / "adapter_config.json").exists()
        assert not (pushed / "model.safetensors").exists()  # the adapter only
        assert "sft" in (pushed / "README.md").read_text().lower()  # TRL's own model card, made on rank 0
        with open(workdir / "hub" / "commits.json") as f:
            messages = [c["message"] for c in json.load(f)]
        # step 12's push is skipped if step 6's were still under way (transformers' rule for every_save)
        assert messages[0] == "Training in progress, step 6" and messages[-1] == "End of training", messages
        assert set(messages[1:-1]) <= {"Training in progress, step 12"}, messages

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


def kill_a_rank_once(folder: str, committed: str, timeout_s: float = 300) -> threading.Thread:
    """A thread that, once ``committed`` (a checkpoint's manifest) exists, SIGKILLs a Ray Train worker of
    the run working in ``folder`` (a rank runs a command in the driver's working directory) and records its
    PID in ``folder/killed-pid``: a worker lost mid-run, from outside the script."""

    def watch():
        deadline = time.time() + timeout_s
        while time.time() < deadline and not os.path.exists(committed):
            time.sleep(0.02)
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if "RayTrainWorker" in " ".join(proc.info["cmdline"] or ()) and proc.cwd() == folder:
                    proc.kill()
                    with open(os.path.join(folder, "killed-pid"), "w") as f:
                        f.write(str(proc.pid))
                    return
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(600)
def test_trl_sft_script_with_a_worker_killed_mid_run_ends_with_the_uninterrupted_weights(workdir, monkeypatch,
                                                                                        capfd):
    """TRL's sft.py (imports changed only) on 2 workers, twice: uninterrupted, and with a worker's process
    SIGKILLed once step 10's checkpoint is committed (``--max_failures 1``). Ray Train starts the group
    again, which resumes from a committed checkpoint: every logged loss and every saved weight equal the
    uninterrupted run's, bit for bit (CPU, the tiny GPT-2 has no dropout)."""
    import safetensors.torch
    import torch

    script = trl_script_on_ray("sft", str(workdir))
    flags = ["--model_name_or_path", "tiny-model", "--dataset_name", "data", "--max_length", "32",
             "--max_steps", "40", "--save_steps", "10", "--logging_steps", "1", "--learning_rate", "5e-3",
             "--report_to", "none", "--use_cpu", "--disable_tqdm", "True", "--seed", "1",
             "--per_device_train_batch_size", "2", "--num_workers", "2", "--max_failures", "1"]
    run_script(script, *flags, "--output_dir", "plain", monkeypatch=monkeypatch)
    os.makedirs("killed")
    watcher = kill_a_rank_once(str(workdir), os.path.join("killed", "checkpoint-10", "manifest.json"))
    run_script(script, *flags, "--output_dir", "killed", monkeypatch=monkeypatch)
    watcher.join(timeout=5)
    console = "".join(capfd.readouterr())
    pid = int((workdir / "killed-pid").read_text())
    assert not psutil.pid_exists(pid)
    assert re.search(r"restart 1: Ray Train started the worker group again .*resuming from \S*checkpoint-\d+",
                     console), console[-3000:]
    plain, killed = losses("plain/checkpoint-40"), losses("killed/checkpoint-40")
    assert sorted(killed) == list(range(1, 41)) and killed == plain
    ours = safetensors.torch.load_file("killed/model.safetensors")
    theirs = safetensors.torch.load_file("plain/model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


SHARDED_RUNS = {  # run: the script, its own flags (the data sets and lengths of the runs above)
    "sft": ("sft", ["--dataset_name", "data", "--max_length", "32"]),
    "sft-peft": ("sft", ["--dataset_name", "data", "--max_length", "32", "--use_peft", "--lora_r", "8",
                         "--lora_alpha", "16", "--lora_target_modules", "c_attn", "c_proj"]),
    "dpo": ("dpo", ["--dataset_name", "preferences", "--max_length", "32"]),
    "reward": ("reward", ["--dataset_name", "preferences", "--max_length", "32"]),
    "grpo": ("grpo", ["--dataset_name", "preferences", "--num_generations", "2", "--max_completion_length",
                      "8", "--reward_funcs", "rewards.counts_on"]),
}
#: a strategy's flags, and the files its checkpoints hold beside transformers' own (accelerate's FSDP
#: files; DeepSpeed's partitions; for transformers' loop accelerate alone wrapped a CPU group in DDP,
#: writing neither)
STRATEGIES = {
    "fsdp": (["--fsdp", "full_shard auto_wrap"], {"pytorch_model_fsdp.bin", "optimizer.bin"}),
    "zero3": (["--deepspeed", "zero3.json"], {"latest", "zero_to_fp32.py"}),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("name", "strategy"), [
    ("sft-peft", "fsdp"),
    *((n, "fsdp") for n in ("sft", "dpo", "reward", "grpo")),
    *((n, "zero3") for n in ("sft", "sft-peft", "dpo", "grpo"))])
def test_a_trl_script_sharded_on_two_cpu_workers_trains_and_saves(name, strategy, workdir, monkeypatch,
                                                                  capfd):
    """TRL's script with ``--fsdp "full_shard auto_wrap"`` or a ZeRO-3 ``--deepspeed`` config on 2 CPU
    workers: the model is prepared by the strategy (its checkpoint files), it learns, and under FSDP the
    output folder is a model folder (under ZeRO-3 transformers' ``save_model`` writes DeepSpeed's
    partitions, as under accelerate launch). Under FSDP each rank reads only its shards of the model the
    script names (raytrainer/worker/hosted_loading.py), except the reward model, whose new head the files
    lack (loaded whole, sharded by ``prepare``). What each rank holds:
    tests/integration/test_guarantees.py::test_a_sharded_strategy_shards_on_cpu_workers_trains_as_ddp_and_resumes."""
    (workdir / "zero3.json").write_text(json.dumps(ZERO3))
    (workdir / "rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(workdir))
    script_name, own = SHARDED_RUNS[name]
    script = trl_script_on_ray(script_name, str(workdir))
    flags, files = STRATEGIES[strategy]
    run_script(script, "--model_name_or_path", "tiny-model", *own, "--output_dir", "out",
               "--max_steps", "6", "--per_device_train_batch_size", "2", "--logging_steps", "1",
               "--save_steps", "3", "--learning_rate", "5e-3", "--report_to", "none", "--use_cpu",
               "--disable_tqdm", "True", *flags, "--num_workers", "2", "--log_level", "info",
               "--log_level_replica", "info", monkeypatch=monkeypatch)
    console = "".join(capfd.readouterr())
    if strategy == "fsdp":
        whole = os.path.getsize("tiny-model/model.safetensors")
        read = dict(re.findall(r"\[rank(\d)\].*read (\d+) bytes of this rank's shards", console))
        again = re.findall(r"\[rank(\d)\].*every rank builds the trainer again", console)
        if name == "reward":
            assert sorted(again) == ["0", "1"] and not read, console[-3000:]
        else:
            assert sorted(read) == ["0", "1"] and not again, console[-3000:]
            assert all(int(n) < 0.6 * whole for n in read.values()), (read, whole)
    if name == "sft-peft" and strategy == "fsdp":  # the adapter once: PEFT's files, no FSDP model file
        files = {"optimizer.bin", "adapter_model.safetensors"}  # (worker/hosted_adapter.py)
    for step in (3, 6):
        saved = set(os.listdir(f"out/checkpoint-{step}"))
        assert files | {"trainer_state.json", "manifest.json"} <= saved, saved
        assert not (name == "sft-peft" and any(f.startswith("pytorch_model_fsdp") for f in saved)), saved
    curve = losses("out/checkpoint-6")
    assert sorted(curve) == list(range(1, 7))
    if name != "grpo":  # GRPO's loss is not a loss to fall (it is zero-mean per group)
        assert statistics.fmean(curve[s] for s in (5, 6)) < statistics.fmean(curve[s] for s in (1, 2)), curve
    kind = {"reward": "sequence-classification", "sft-peft": "peft"}.get(name, "causal-lm")
    if kind == "peft":  # adapter-only checkpoints and output, as in one process
        assert os.path.exists("out/adapter_model.safetensors") and not os.path.exists("out/model.safetensors")
        base = os.path.getsize("tiny-model/model.safetensors")
        for path in (workdir / "out" / "checkpoint-6").rglob("*"):  # no file holds the base model's weights
            assert path.is_dir() or path.stat().st_size < base / 2, (path, path.stat().st_size, base)
        trained = load_saved(kind, "out")
        assert any(p.abs().sum() > 0 for n, p in trained.named_parameters() if "lora_B" in n)  # B starts at 0
    elif strategy == "fsdp":
        load_saved(kind, "out")


def test_grpo_with_a_vllm_server_is_refused_on_the_driver(tmp_path):
    from raytrainer.trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="server", num_workers=2,
                      use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=r"vllm_mode='server'.*use_vllm=False"):
        GRPOTrainer(model="tiny-model", reward_funcs=[len], args=args, train_dataset=[])


class WeightedLossTrainer:
    """transformers' documented example of a custom ``compute_loss`` (class weights), made a subclass of
    ``transformers.Trainer`` below (kept importable by reference for the workers)."""


def _weighted_loss_trainer():
    import torch
    import transformers

    class CustomTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            logits = outputs.get("logits")
            loss_fct = torch.nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0], device=model.device))
            loss = loss_fct(logits.view(-1, self.model.config.num_labels), labels.view(-1))
            return (loss, outputs) if return_outputs else loss

    return CustomTrainer


def _classifier():
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=63, n_positions=64,
                                     num_labels=3, pad_token_id=0)
    return transformers.GPT2ForSequenceClassification(config)


def _labelled(n: int):
    import torch

    rows = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(3, 63, (8,), generator=g)
        rows.append({"input_ids": ids, "labels": int(ids[0]) % 3})
    return rows


@pytest.mark.timeout(300)
def test_a_users_compute_loss_subclass_on_two_workers_matches_one_process(tmp_path, caplog):
    import logging

    import transformers

    import raytrainer
    from raytrainer.hosted import HostedTrainer

    caplog.set_level(logging.DEBUG, logger="raytrainer.driver.group")
    Trainer = raytrainer.on_ray(_weighted_loss_trainer())
    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    runs = {}
    for name, workers, batch, seed in (("one-3", 0, 4, 3), ("one-4", 0, 4, 4), ("two", 2, 2, 3)):
        args = Args(output_dir=str(tmp_path / name), num_workers=workers, per_device_train_batch_size=batch,
                    max_steps=8, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none",
                    use_cpu=True, seed=seed, disable_tqdm=True)
        trainer = Trainer(model=_classifier(), args=args, train_dataset=_labelled(64))
        assert isinstance(trainer, Trainer) and isinstance(trainer, transformers.Trainer)
        assert isinstance(trainer, HostedTrainer) == (workers > 0)  # 0: transformers' own object, here
        runs[name] = (trainer.train(), trainer)
    output, trainer = runs["two"]
    # The same global batch (4 x 1, 2 x 2), within the noise of two data orders in one process.
    assert output.global_step == 8
    one = [runs[name][0].training_loss for name in ("one-3", "one-4")]
    noise = max(one) - min(one)
    print(f"compute_loss subclass: train loss, 2 workers {output.training_loss:.4f}; one process {one}")
    assert abs(output.training_loss - statistics.fmean(one)) <= max(2 * noise, 0.01)
    assert len([h for h in trainer.state.log_history if "loss" in h]) == 8

    # The group stays warm: evaluate and predict run on the trainer each rank holds.
    group = vars(trainer)["_group"]
    metrics = trainer.evaluate(_labelled(16))
    assert metrics["epoch"] == trainer.state.epoch and metrics["eval_loss"] > 0
    predictions = trainer.predict(_labelled(16))
    assert predictions.predictions.shape == (16, 3)
    assert vars(trainer)["_group"] is group
    # What a script reads on the driver after train(): the model, saved files, an attribute of rank 0's.
    import torch

    fetched = trainer.model  # the trained weights: not the initial ones
    initial = _classifier()
    assert type(fetched) is type(initial)
    assert not torch.allclose(fetched.score.weight, initial.score.weight)
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "model.safetensors").exists()
    assert trainer.is_in_train is False
    # Each command (train, evaluate, predict, save_model, is_in_train; trainer.model is read from the final
    # weights train() wrote) carried the recipe without its payload (the model and the 64 rows): that went
    # into the object store once, at the first command.
    sizes = [int(r.getMessage().split()[2]) for r in caplog.records if r.getMessage().startswith("run spec:")]
    payload = len(trainer._recipe.payload)
    assert len(sizes) >= 5 and max(sizes) < 4096 < payload, (sizes, payload)
    trainer.end()
    assert "_group" not in vars(trainer)


@pytest.mark.timeout(300)
def test_a_subclass_of_a_twin_runs_its_constructor_and_overrides_on_the_workers(tmp_path):
    """``class Mine(raytrainer.on_ray(transformers.Trainer))`` (or of ``raytrainer.trl.SFTTrainer``): each
    worker builds ``Mine``, so its constructor and ``compute_loss`` run there. A loss scaled by 0 trains
    nothing: the weights come back exactly as given."""
    import torch
    import transformers

    import raytrainer

    class Scaled(raytrainer.on_ray(transformers.Trainer)):
        def __init__(self, *args, loss_scale: float = 1.0, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_scale = loss_scale

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return loss * self.loss_scale

    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    args = Args(output_dir=str(tmp_path), num_workers=2, per_device_train_batch_size=2, max_steps=3,
                learning_rate=0.1, optim="sgd", logging_steps=1, save_strategy="no", report_to="none",
                use_cpu=True, disable_tqdm=True)
    trainer = Scaled(model=_classifier(), args=args, train_dataset=_labelled(32), loss_scale=0.0)
    assert isinstance(trainer, Scaled) and isinstance(trainer, transformers.Trainer)
    output = trainer.train()
    assert output.global_step == 3 and output.training_loss == 0.0
    assert [h["loss"] for h in trainer.state.log_history if "loss" in h] == [0.0, 0.0, 0.0]
    assert trainer.loss_scale == 0.0  # set by the subclass's constructor on rank 0
    initial = _classifier()
    trained = trainer.model.state_dict()
    assert all(torch.equal(trained[k], v) for k, v in initial.state_dict().items())
    trainer.end()


@pytest.mark.timeout(300)
def test_a_slow_worker_of_a_hosted_trainer_is_named_by_the_straggler_warning(tmp_path, capfd):
    """transformers' loop on the workers: rank 1 reads each batch 0.15 s slower; the driver names rank 1 and
    its node once, as for raytrainer's own loop (test_ddp.py)."""
    import ray
    import transformers
    from models import Regressor, SlowOnRank, make_data

    import raytrainer

    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    args = Args(output_dir=str(tmp_path), num_workers=2, max_steps=8, logging_steps=2,
                per_device_train_batch_size=4, save_strategy="no", report_to="none", disable_tqdm=True)
    Trainer = raytrainer.on_ray(transformers.Trainer)
    trainer = Trainer(model=Regressor(), args=args, train_dataset=make_data(64),
                      data_collator=SlowOnRank(rank=1, seconds=0.15))
    assert trainer.train().global_step == 8
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "is a straggler" in line]
    assert len(warnings) == 1, err
    assert f"rank 1 on node {ray.util.get_node_ip_address()} is a straggler: its own work" in warnings[0]
    seconds = float(warnings[0].split(" takes ")[1].split(" s per step")[0])
    assert 0.15 <= seconds < 1.0
    trainer.end()


@pytest.mark.timeout(300)
def test_sentence_transformers_trainer_on_two_workers_matches_one_process(tmp_path):
    datasets = pytest.importorskip("datasets")
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.losses import CosineSimilarityLoss
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    import raytrainer

    model_dir = write_tiny_lm(str(tmp_path / "tiny-model"))
    Trainer = raytrainer.on_ray(st.SentenceTransformerTrainer)
    Args = raytrainer.config_on_ray(st.SentenceTransformerTrainingArguments)
    # A per-pair loss: sharding the global batch over ranks leaves the objective as it is.
    pairs = datasets.Dataset.from_dict({
        "sentence1": [f"w{i % 50} w{i % 50 + 1} w{i % 50 + 2}" for i in range(96)],
        "sentence2": [f"w{i % 50 + 1} w{i % 50 + 2}" if i % 2 else f"w{(7 * i) % 60}" for i in range(96)],
        "score": [1.0 if i % 2 else 0.0 for i in range(96)],
    })
    runs = {}
    for name, workers, batch, seed in (("one-0", 0, 8, 0), ("one-1", 0, 8, 1), ("two", 2, 4, 0)):
        model = st.SentenceTransformer(modules=[Transformer(model_dir), Pooling(32, pooling_mode="mean")],
                                       device="cpu")
        args = Args(output_dir=str(tmp_path / name), num_workers=workers, per_device_train_batch_size=batch,
                    max_steps=10, learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to="none",
                    use_cpu=True, seed=seed, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=pairs, loss=CosineSimilarityLoss(model))
        runs[name] = trainer.train().training_loss
        curve = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if workers:
            trainer.end()
    one, two = [runs["one-0"], runs["one-1"]], runs["two"]
    print(f"sentence-transformers: train loss, 2 workers {two:.4f}; one process {one}; last run {curve}")
    assert len(curve) == 10 and statistics.fmean(curve[-3:]) < statistics.fmean(curve[:3])  # it learns
    assert abs(two - statistics.fmean(one)) <= max(2 * (max(one) - min(one)), 0.01)


@pytest.mark.timeout(600)
def test_a_lost_worker_is_replaced_and_the_hosted_run_resumes_from_its_last_committed_checkpoint(tmp_path,
                                                                                                s3_bucket):
    """max_failures=1: rank 1's process dies at step 5; Ray Train starts new workers, each builds the trainer
    again and resumes from the latest checkpoint committed to storage_path (S3); the loss curve and the final
    weights are bitwise those of an uninterrupted run (CPU). The driver wrote each manifest and rotated the
    bucket's checkpoints; a later trainer resumes from the bucket with resume_from_checkpoint=True."""
    import torch
    import transformers
    from models import DieOnceOnRank

    import raytrainer

    Trainer = raytrainer.on_ray(_weighted_loss_trainer())
    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    storage = f"{s3_bucket.uri}/run"

    def run(name, callbacks, max_steps=8, resume=None, **fields):
        args = Args(output_dir=str(tmp_path / name), num_workers=2, max_failures=1, max_steps=max_steps,
                    per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1, save_steps=2,
                    report_to="none", use_cpu=True, seed=3, disable_tqdm=True, lr_scheduler_type="constant",
                    **fields)
        trainer = Trainer(model=_classifier(), args=args, train_dataset=_labelled(64), callbacks=callbacks)
        trainer.train(resume_from_checkpoint=resume)
        curve = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.end()
        return curve, weights

    curve, weights = run("uninterrupted", [], max_steps=10)
    resumed_curve, resumed_weights = run("interrupted", [DieOnceOnRank(step=5, rank=1)], storage_path=storage,
                                         save_total_limit=2)
    assert (tmp_path / "interrupted" / "died").exists()  # the worker did die
    # ... and the new workers read the last checkpoint committed before it died (checkpoint-4, or checkpoint-2
    # while checkpoint-4 was still uploading) from the bucket, not from the folder transformers wrote
    copies = sorted(p.name for p in (tmp_path / "interrupted" / ".raytrainer" / "resume").iterdir())
    assert copies in (["checkpoint-2"], ["checkpoint-4"]), copies
    assert (tmp_path / "interrupted" / ".raytrainer" / "resume" / copies[0] / "trainer_state.json").exists()
    assert sorted(resumed_curve) == list(range(1, 9))
    assert [resumed_curve[s] for s in range(5, 9)] == [curve[s] for s in range(5, 9)]  # bitwise, on CPU
    uninterrupted_8 = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "uninterrupted" / "checkpoint-8")
    for name, tensor in uninterrupted_8.state_dict().items():
        assert torch.equal(resumed_weights[name], tensor), name

    # In the bucket: the two newest checkpoints (save_total_limit=2, the driver rotated), each committed with
    # every rank's files (manifest checked against the objects and their sha256).
    committed = s3_bucket.committed("run")
    assert sorted(committed) == ["checkpoint-6", "checkpoint-8"]
    files = committed["checkpoint-8"]["files"]
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state_0.pth",
            "rng_state_1.pth"} <= set(files)
    assert committed["checkpoint-8"]["global_step"] == 8

    # A new trainer, another output_dir: resume_from_checkpoint=True finds checkpoint-8 in the bucket.
    later_curve, later_weights = run("later", [], max_steps=10, resume=True, storage_path=storage)
    assert sorted(later_curve) == list(range(1, 11))
    assert [later_curve[s] for s in (9, 10)] == [curve[s] for s in (9, 10)]
    for name, tensor in weights.items():
        assert torch.equal(later_weights[name], tensor), name


@pytest.mark.timeout(600)
def test_a_search_over_hosted_model_init_trials_runs_on_pooled_workers_and_prunes_from_the_driver(tmp_path):
    """Optuna over a transformers.Trainer subclass on 2 workers: each trial's ranks build the model with
    model_init(trial) (its n_embd), train with the trial's learning rate and commit checkpoints in the
    trial's folder; the driver's pruner stops trial 1 at its first evaluation, on every rank."""
    optuna = pytest.importorskip("optuna")
    import transformers

    import raytrainer

    def model_init(trial):
        import torch

        torch.manual_seed(0)
        width = trial.params["n_embd"] if trial is not None else 32
        config = transformers.GPT2Config(n_layer=1, n_embd=width, n_head=2, vocab_size=63, n_positions=64,
                                         num_labels=3, pad_token_id=0)
        return transformers.GPT2ForSequenceClassification(config)

    class PruneTrialOne(optuna.pruners.BasePruner):
        def prune(self, study, trial):
            return trial.number == 1

    def hp_space(trial):
        return {"learning_rate": trial.suggest_categorical("learning_rate", [1e-2, 3e-3]),
                "n_embd": trial.suggest_categorical("n_embd", [16, 32])}

    Trainer = raytrainer.on_ray(_weighted_loss_trainer())
    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    args = Args(output_dir=str(tmp_path), num_workers=2, per_device_train_batch_size=2, max_steps=6,
                eval_strategy="steps", eval_steps=2, save_steps=6, logging_steps=1, report_to="none",
                use_cpu=True, disable_tqdm=True, lr_scheduler_type="constant")
    trainer = Trainer(model_init=model_init, args=args, train_dataset=_labelled(64),
                      eval_dataset=_labelled(16))
    best = trainer.hyperparameter_search(hp_space=hp_space, n_trials=2, direction="minimize",
                                         backend="optuna", pruner=PruneTrialOne(),
                                         sampler=optuna.samplers.RandomSampler(seed=0))
    assert best.run_id == "0" and set(best.hyperparameters) == {"learning_rate", "n_embd"}
    done = raytrainer.search.TrialSummary.load(str(tmp_path / "run-0"))
    assert done.global_step == 6 and not done.pruned and [e["step"] for e in done.evaluations] == [2, 4, 6]
    assert best.objective == pytest.approx(done.evaluations[-1]["metrics"]["eval_loss"])
    pruned = raytrainer.search.TrialSummary.load(str(tmp_path / "run-1"))
    assert pruned.pruned and pruned.global_step == 2 and len(pruned.evaluations) == 1  # stopped on every rank
    # trial 0's ranks built its model (its width) and committed its checkpoint where the trial writes
    checkpoint = tmp_path / "run-0" / "checkpoint-6"
    with open(checkpoint / "config.json") as f:
        assert json.load(f)["n_embd"] == best.hyperparameters["n_embd"]
    assert (checkpoint / "manifest.json").exists() and done.checkpoints == [str(checkpoint)]
    with open(checkpoint / "trainer_state.json") as f:
        logged = json.load(f)["log_history"]
    rates = {h["learning_rate"] for h in logged if "learning_rate" in h}
    assert rates == {best.hyperparameters["learning_rate"]}  # the trial's (a constant schedule)


@pytest.mark.timeout(420)
def test_a_ray_tune_search_over_hosted_trials_trains_each_trial_with_its_hyperparameters(tmp_path):
    """backend="ray": each Tune trial actor gets a copy of the hosted trainer (no group, no pusher, no
    object-store reference of the driver's), and its trial trains on 2 workers with the trial's learning rate,
    evaluates, and commits its checkpoint in its own run-<id> folder."""
    tune = pytest.importorskip("ray.tune")
    import transformers

    import raytrainer

    Trainer = raytrainer.on_ray(_weighted_loss_trainer())
    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    args = Args(output_dir=str(tmp_path), num_workers=2, per_device_train_batch_size=2, max_steps=4,
                eval_strategy="steps", eval_steps=2, save_steps=4, logging_steps=1, report_to="none",
                use_cpu=True, disable_tqdm=True, lr_scheduler_type="constant")

    def model_init():  # by value: the Tune trial actors and the workers need not import this module
        import torch

        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=63, n_positions=64,
                                         num_labels=3, pad_token_id=0)
        return transformers.GPT2ForSequenceClassification(config)

    trainer = Trainer(model_init=model_init, args=args, train_dataset=_labelled(64),
                      eval_dataset=_labelled(16))
    rates = [1e-2, 3e-3]
    best = trainer.hyperparameter_search(hp_space=lambda _: {"learning_rate": tune.grid_search(rates)},
                                         n_trials=1, backend="ray", max_concurrent_trials=1)
    assert best.hyperparameters["learning_rate"] in rates
    seen = []
    for folder in sorted(tmp_path.glob("run-*")):
        summary = raytrainer.search.TrialSummary.load(str(folder))
        assert summary.global_step == 4 and [e["step"] for e in summary.evaluations] == [2, 4], folder
        assert (folder / "checkpoint-4" / "manifest.json").exists()
        with open(folder / "checkpoint-4" / "trainer_state.json") as f:
            rates_logged = {h["learning_rate"] for h in json.load(f)["log_history"] if "learning_rate" in h}
        assert rates_logged == {summary.hyperparameters["learning_rate"]}
        seen.append(summary.hyperparameters["learning_rate"])
    assert sorted(seen) == sorted(rates)
    assert best.objective == pytest.approx(min(
        raytrainer.search.TrialSummary.load(str(f)).objective for f in tmp_path.glob("run-*")))
