"""Fine-tuning a pretrained transformers model, ``model_init=lambda: from_pretrained(path)``, plain and with
PEFT's LoRA, under FSDP and DeepSpeed ZeRO-3 on 2 Ray workers: the most common way anyone uses a sharded
strategy. Each run starts from exactly the saved weights on every rank, no rank other than 0 (FSDP) holds
the whole model, and training moves the weights it should (all of them; with LoRA the adapters only).

Run under each supported transformers version by ``scripts/test_transformers_range.sh``."""

from __future__ import annotations

import re

import pytest
import torch
from hosted_fixtures import numbers_saved
from models import FromPretrained, ReportStartingWeights, counting_data, pretrained_key, save_tiny_llama
from test_deepspeed import _config

from raytrainer import Trainer, TrainingArguments


def _args(out, strategy: str, learning_rate: float, **kw) -> TrainingArguments:
    sharding = ({"fsdp": "full_shard auto_wrap"} if strategy == "fsdp"
                else {"deepspeed": _config(3)})
    base = dict(output_dir=str(out), num_workers=2, per_device_train_batch_size=4, max_steps=8,
                learning_rate=learning_rate, optim="adamw_torch", logging_steps=2, save_strategy="no",
                disable_tqdm=True, report_to="none")
    return TrainingArguments(**{**base, **sharding, **kw})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lora", [False, True],
                         ids=["plain", "lora"])
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_model_init_from_pretrained_fine_tunes_on_two_workers(tmp_path, capfd, strategy, lora):
    from safetensors.torch import load_file

    path = save_tiny_llama(tmp_path / "pretrained")
    args = _args(tmp_path / "out", strategy, 5e-2 if lora else 1e-2,  # LoRA: a few adapters move slower
                 log_level="info", log_level_replica="info")
    trainer = Trainer(model_init=FromPretrained(path, lora=lora), args=args,
                      train_dataset=counting_data(64), callbacks=[ReportStartingWeights(path)])
    assert trainer.train().global_step == 8
    console = "".join(capfd.readouterr())
    report = {int(r): (b, float(d), int(c), float(lb), int(h), int(f)) for r, b, d, c, lb, h, f in re.findall(
        r"rank (\d): built_on=(\w+) start_diff=(\S+) compared=(\d+) lora_b_max=(\S+) held=(\d+) full=(\d+) "
        r"tied=1", console)}  # the head still the embedding (the tiny Llama ties them)
    assert sorted(report) == [0, 1], console[-3000:]
    saved = load_file(f"{path}/model.safetensors")
    for rank, (built_on, diff, compared, lora_b, held, full) in report.items():
        # every rank starts from exactly the pretrained weights (and LoRA from the pretrained model)
        assert diff == 0.0 and compared == len(saved) and lora_b == 0.0, (rank, report[rank])
        assert held < 0.6 * full, (rank, held, full)  # sharded: about half each
        if strategy == "fsdp":  # every rank builds a skeleton and reads its own shards from the files
            assert built_on == "meta", report  # (LoRA's adapters initialised by PEFT on each rank's shard)
        else:  # transformers loads partition-wise under zero.Init
            assert built_on == "partitioned", report

    read = {int(r): (int(b), int(t)) for r, b, t in re.findall(
        r"\[rank(\d)\].*read (\d+) bytes of this rank's shards of the pretrained weights from the files "
        r"\(the whole weights: (\d+) bytes\)", console)}
    if strategy == "fsdp":  # each rank read about half of the weights, nothing else
        assert sorted(read) == [0, 1], console[-3000:]
        assert all(b < 0.6 * t for b, t in read.values()), read
        assert sum(b for b, _ in read.values()) >= read[0][1], read  # together: every weight, once
    else:
        assert read == {}, read

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and losses[-1] < losses[0] - (0.04 if lora else 0.3), losses
    trained = {pretrained_key(n): p.detach() for n, p in trainer.model.named_parameters()}
    base = {k: v for k, v in trained.items() if ".lora_" not in k}
    assert base.keys() >= saved.keys()
    moved = [k for k in saved if not torch.equal(base[k], saved[k])]
    if lora:
        assert moved == []  # frozen
        adapters = [v for k, v in trained.items() if ".lora_B." in k]
        assert len(adapters) == 4 and all(v.abs().max() > 0 for v in adapters)
    else:
        assert sorted(moved) == sorted(saved)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_lora_under_a_sharded_strategy_checkpoints_the_adapter_only_and_resumes_bitwise(tmp_path, strategy):
    """PEFT's LoRA on a frozen base sharded by FSDP or partitioned by ZeRO-3, 2 workers: each checkpoint's
    model is the adapter (PEFT's files, loadable with PeftModel.from_pretrained), and a run resumed from the
    step-4 checkpoint ends with the same weights as the uninterrupted run, bit for bit."""
    path = save_tiny_llama(tmp_path / "pretrained")

    def run(out, resume=None):
        args = _args(out, strategy, 5e-2, save_strategy="steps", save_steps=4, seed=5)
        trainer = Trainer(model_init=FromPretrained(path, lora=True), args=args,
                          train_dataset=counting_data(64))
        trainer.train(resume_from_checkpoint=resume)
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.close()
        return weights

    full = run(tmp_path / "full")
    checkpoint = tmp_path / "full" / "checkpoint-4"
    files = {p.name for p in checkpoint.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files, files
    assert "model.safetensors" not in files and not any(f.startswith("pytorch_model") for f in files), files
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    adapter = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert adapter and all(".lora_" in k for k in adapter)  # the adapter only: no base weight in it
    # nor in the strategy's own files (ZeRO's engine state, FSDP's optimizer shards): the adapter's numbers,
    # Adam's 2 moments of them, ZeRO's fp32 master copy, a step counter per tensor; the base has 21x more
    adapter_numel = sum(t.numel() for t in adapter.values())
    assert numbers_saved(checkpoint) <= 4 * adapter_numel + len(adapter), numbers_saved(checkpoint)
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), str(checkpoint))

    resumed = run(tmp_path / "resumed", resume=str(checkpoint))
    assert resumed.keys() == full.keys()
    for name, tensor in full.items():
        assert torch.equal(resumed[name], tensor), name


@pytest.mark.timeout(300)
def test_a_relative_model_path_in_model_init_means_the_drivers_folder_on_the_workers(tmp_path, monkeypatch):
    """``from_pretrained("model")`` in model_init: with 2 workers it loads the folder of the driver's working
    directory (the workers run there), as with num_workers=0 -- not a Hub id it cannot reach."""
    monkeypatch.chdir(tmp_path)
    save_tiny_llama(tmp_path / "model")
    args = TrainingArguments(output_dir="out", num_workers=2, per_device_train_batch_size=4, max_steps=2,
                             save_strategy="no", disable_tqdm=True, report_to="none")
    trainer = Trainer(model_init=FromPretrained("model"), args=args, train_dataset=counting_data(16))
    trainer.train()
    assert trainer.state.global_step == 2
    trainer.close()
