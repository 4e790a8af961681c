"""Checkpoints on 2 Ray workers: committed by the driver's registry, exact resume mid-epoch."""

from __future__ import annotations

import json
import os

import pytest
import torch
from models import DropoutRegressor, make_data

from raytrainer import Trainer, TrainingArguments


def _args(out, **kw) -> TrainingArguments:
    base = {"output_dir": str(out), "num_workers": 2, "per_device_train_batch_size": 4,
            "num_train_epochs": 3, "learning_rate": 0.02, "optim": "adamw_torch", "save_strategy": "steps",
            "save_steps": 5, "logging_steps": 3, "disable_tqdm": True, "report_to": "none"}
    base.update(kw)
    return TrainingArguments(**base)


@pytest.mark.full  # the full tier: CI resumes bitwise on 2 workers after a lost worker (test_failures.py)
def test_two_worker_resume_mid_epoch_is_bitwise_equal_and_rotation_runs_on_the_driver(tmp_path):
    """storage_path is a file:// URI: the files go through pyarrow (staged, then copied), as for a bucket,
    and Ray Train's run folder is that folder, not a local one named after the URI."""
    data = make_data(48)  # 6 updates per epoch with 2 x 4, 18 steps in all
    store = tmp_path / "store"
    kw = {"save_total_limit": 3, "storage_path": f"file://{store}"}
    full = Trainer(model=DropoutRegressor(), args=_args(tmp_path / "full", **kw), train_dataset=data)
    full.train()
    kept = sorted(n for n in os.listdir(store) if n.startswith("checkpoint-"))
    assert kept == ["checkpoint-10", "checkpoint-15", "checkpoint-18"]  # 5 rotated away by the driver
    assert not os.path.exists("file:")
    assert not any(n.startswith("checkpoint-") for n in os.listdir(tmp_path / "full"))
    folder = store / "checkpoint-10"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert {"rng_state_0.safetensors", "rng_state_1.safetensors", "model.safetensors",
            "optimizer.pt"} <= set(manifest["files"])

    # resumed in the SAME storage, as HF users do: the first fit's checkpoint-5 was rotated away, which
    # Ray Train's own run snapshot still listed (a second fit used to be refused by Ray)
    resumed = Trainer(model=DropoutRegressor(), args=_args(tmp_path / "full", **kw), train_dataset=data)
    out = resumed.train(resume_from_checkpoint=f"file://{folder}")  # step 10 = epoch 2, update 4 of 6
    assert out.global_step == 18
    for name, tensor in full.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
