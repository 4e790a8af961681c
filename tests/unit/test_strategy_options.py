"""Strategy options checked on the driver (the DeepSpeed config's "auto" values known before the model
exists, what a checkpoint can resume on, GaLore, tf32) and, in-process, auto_find_batch_size and
fp16/bf16_full_eval. The values transformers fills on the ranks once the model exists (the run's length, the
ZeRO buckets) are its own (``trainer_config_finalize``): the ZeRO runs of tests/integration/test_deepspeed.py
train with them."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from raytrainer import Trainer, TrainingArguments
from raytrainer.strategies import check_resume
from raytrainer.strategies.deepspeed_config import fill_from_args


def _ds_args(tmp_path, config, **kw):
    base = {
        "output_dir": str(tmp_path),
        "num_workers": 2,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 3,
        "learning_rate": 3e-4,
        "weight_decay": 0.01,
        "bf16": True,
        "deepspeed": config,
    }
    return TrainingArguments(**{**base, **kw})


def test_deepspeed_auto_values_come_from_the_arguments(tmp_path):
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    args = _ds_args(tmp_path, str(path), warmup_steps=0.1)
    filled = fill_from_args(json.loads(path.read_text()), args, 2)
    assert filled["train_micro_batch_size_per_gpu"] == 4
    assert filled["gradient_accumulation_steps"] == 3
    assert filled["train_batch_size"] == 2 * 4 * 3  # the Ray workers' count, which the driver knows
    assert filled["gradient_clipping"] == 1.0
    assert filled["optimizer"]["params"] == {
        "lr": 3e-4,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.01,
    }
    assert filled["scheduler"]["params"]["warmup_min_lr"] == 0
    assert filled["scheduler"]["params"]["warmup_max_lr"] == 3e-4
    assert filled["bf16"] == {"enabled": True}


def test_deepspeed_values_that_disagree_with_the_arguments_are_all_named(tmp_path):
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
    }
    with pytest.raises(ValueError) as err:
        _ds_args(tmp_path, config)
    message = str(err.value)
    assert "ds train_micro_batch_size_per_gpu=8 vs hf per_device_train_batch_size=4" in message
    assert "ds optimizer.params.lr=0.1 vs hf learning_rate=0.0003" in message
    assert "gradient_accumulation_steps=3 vs" not in message  # that one agrees
    assert 'Set them to "auto"' in message


@pytest.mark.parametrize(
    ("config", "kw", "match"),
    [
        ("missing.json", {}, "no such file"),
        ("{not json", {}, "not valid JSON"),
        ({"zero_optimization": {"stage": 4}}, {}, "stage=4 must be 0, 1, 2 or 3"),
        ({"zero_optimization": {"stage": 2}}, {"num_workers": 0}, "runs on Ray workers, but num_workers=0"),
        ({"zero_optimization": {"stage": 2}}, {"fsdp": "full_shard"}, "cannot be combined with fsdp"),
        ({"zero_optimization": {"stage": 2}}, {"bf16": False, "fp16": True}, "DeepSpeed's fp16 runs on GPUs"),
    ],
)
def test_bad_deepspeed_settings_fail_when_the_arguments_are_made(tmp_path, config, kw, match):
    if config == "missing.json":
        config = str(tmp_path / "missing.json")
    with pytest.raises(ValueError, match=match):
        _ds_args(tmp_path, config, **kw)


def test_a_zero_checkpoint_on_another_world_size_announces_the_conversion(tmp_path, caplog):
    """Resuming a ZeRO checkpoint on another number of workers is allowed (rank 0 converts it to DeepSpeed's
    universal format); the driver says so before any worker starts, and says nothing on the same size."""
    args = _ds_args(tmp_path, {"zero_optimization": {"stage": 2}}, bf16=False)
    files = [
        "model.safetensors",
        "global_step10/mp_rank_00_model_states.pt",
        "global_step10/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "global_step10/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    with caplog.at_level(logging.WARNING, logger="raytrainer.strategies"):
        check_resume(args, files, 10, 2)  # same world size: nothing to convert
        assert caplog.records == []
        check_resume(args, files, 10, 4)
    (record,) = caplog.records
    assert "saved by 2 workers and this run has 4" in record.getMessage()
    assert "universal format" in record.getMessage()


def test_a_checkpoint_whose_model_is_only_zero3_partitions_resumes_only_on_zero3(tmp_path):
    """A ZeRO-3 checkpoint holds the model only as the engine's partitions (no model.safetensors): a ZeRO-3
    run resumes it; another strategy, or another ZeRO stage, is refused on the driver naming the fix."""
    files = ["trainer_state.json", "rng_state_0.safetensors", "rng_state_1.safetensors",
             "global_step10/zero_pp_rank_0_mp_rank_00_model_states.pt",
             "global_step10/zero_pp_rank_1_mp_rank_00_model_states.pt",
             "global_step10/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "global_step10/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    check_resume(_ds_args(tmp_path, {"zero_optimization": {"stage": 3}}), files, 10, 2)
    for stage in (1, 2):
        with pytest.raises(ValueError, match=r"only as DeepSpeed ZeRO-3 partitions \(global_step10/\).*"
                                             r"raytrainer consolidate CHECKPOINT OUT"):
            check_resume(_ds_args(tmp_path, {"zero_optimization": {"stage": stage}}), files, 10, 2)
    plain = TrainingArguments(output_dir=str(tmp_path), num_workers=2, report_to="none")
    with pytest.raises(ValueError, match="only a ZeRO-3 DeepSpeed engine reads"):
        check_resume(plain, files, 10, 2)
    check_resume(plain, [*files, "model.safetensors"], 10, 2)  # consolidated weights beside: fine


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"optim": "galore_adamw"}, "needs optim_target_modules"),
        (
            {"optim": "galore_adamw_layerwise", "optim_target_modules": ["net"], "num_workers": 2},
            "DDP's gradient all-reduce does not support",
        ),
        (
            {
                "optim": "galore_adamw",
                "optim_target_modules": ["net"],
                "num_workers": 2,
                "fsdp": "full_shard",
            },
            "sharded strategies split them",
        ),
        ({"tf32": True}, "tf32=True: is a GPU"),
        ({"fp16_full_eval": True, "bf16_full_eval": True}, "only one of"),
    ],
)
def test_optimizer_and_precision_options_are_checked(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        TrainingArguments(output_dir=str(tmp_path), **kw)


class OutOfMemoryAbove(nn.Module):
    """Raises the CPU allocator's out-of-memory error for training batches larger than ``limit``."""

    def __init__(self, limit: int):
        super().__init__()
        torch.manual_seed(0)
        self.limit = limit
        self.linear = nn.Linear(6, 3)
        self.seen: list[int] = []

    def forward(self, x, labels=None):
        if self.training:
            self.seen.append(x.shape[0])
        if self.training and x.shape[0] > self.limit:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 TB")
        logits = self.linear(x)
        return nn.functional.cross_entropy(logits, labels), logits


def _data(n):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    return [{"x": x[i], "labels": int(x[i, 0] > 0)} for i in range(n)]


def test_auto_find_batch_size_steps_down_by_a_tenth_until_a_step_fits(tmp_path, caplog):
    model = OutOfMemoryAbove(limit=5)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_train_epochs=1,
        auto_find_batch_size=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    out = Trainer(model=model, args=args, train_dataset=_data(30)).train()
    assert model.seen[:4] == [8, 7, 6, 5]  # the probes: 8 -> int(7.2) -> int(6.3) -> int(5.4)
    assert set(model.seen[4:]) == {5}
    assert out.global_step == 6  # 30 examples in batches of 5
    assert "training with per_device_train_batch_size=5" in caplog.text


def test_auto_find_batch_size_gives_up_with_advice(tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=2,
        auto_find_batch_size=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    with pytest.raises(RuntimeError, match=r"not even a batch of 1 example fits.*--fsdp, --deepspeed"):
        Trainer(model=OutOfMemoryAbove(limit=0), args=args, train_dataset=_data(8)).train()


class DtypeSeen(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 3)
        self.input_dtypes: set = set()

    def forward(self, x, labels=None):
        self.input_dtypes.add(x.dtype)
        logits = self.linear(x)
        return nn.functional.cross_entropy(logits.float(), labels), logits


@pytest.mark.parametrize(
    ("flag", "dtype"), [("bf16_full_eval", torch.bfloat16), ("fp16_full_eval", torch.float16)]
)
def test_full_eval_runs_the_model_itself_in_half_precision(tmp_path, flag, dtype):
    data = _data(24)
    reference = Trainer(
        model=DtypeSeen(), args=TrainingArguments(output_dir=str(tmp_path / "ref")), eval_dataset=data
    ).evaluate()
    model = DtypeSeen()
    args = TrainingArguments(output_dir=str(tmp_path / "half"), **{flag: True})
    metrics = Trainer(model=model, args=args, eval_dataset=data).evaluate()
    assert model.linear.weight.dtype == dtype  # as HF: the model is cast for evaluation outside train()
    assert model.input_dtypes == {dtype}  # floating inputs follow the model
    assert metrics["eval_loss"] != reference["eval_loss"]  # really computed in half precision ...
    assert metrics["eval_loss"] == pytest.approx(reference["eval_loss"], abs=2e-2)  # ... and close


def test_fsdp_options_from_the_command_line_are_split():
    from raytrainer import ArgumentParser

    (args,) = ArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "out", "--num_workers", "2", "--fsdp", "full_shard auto_wrap"]
    )
    assert args.fsdp == ["full_shard", "auto_wrap"]


def test_bf16_turns_on_a_missing_deepspeed_bf16_section(tmp_path):
    args = _ds_args(tmp_path, {"zero_optimization": {"stage": 3}})  # bf16=True
    assert fill_from_args(args.deepspeed, args, 2)["bf16"] == {"enabled": True}
    plain = _ds_args(tmp_path, {"zero_optimization": {"stage": 3}}, bf16=False)
    assert "bf16" not in fill_from_args(plain.deepspeed, plain, 2)


def test_deepspeed_filling_is_transformers_and_leaves_its_global_config_alone(tmp_path):
    """The "auto" filling is transformers' HfTrainerDeepSpeedConfig (save_on_each_node reaches DeepSpeed's
    checkpoint section as there); checking a config on the driver does not replace the config registered
    for from_pretrained's ZeRO-3 path in the same process."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    registered = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_zero3_enabled()
    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                                    "stage3_prefetch_bucket_size": "auto"},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
    args = _ds_args(tmp_path, config, bf16=False, save_on_each_node=True)
    assert is_deepspeed_zero3_enabled()  # still the registered one
    del registered
    filled = fill_from_args(config, args, 2)
    assert filled["checkpoint"] == {"use_node_local_storage": True}
