"""Checkpoints on 2 Ray workers: committed by the driver's registry, exact resume mid-epoch."""

from __future__ import annotations

import json
import os

import torch
from models import DropoutRegressor, make_data, rng_files

from raytrainer import Trainer, TrainingArguments


def _args(out, **kw) -> TrainingArguments:
    base = {"output_dir": str(out), "num_workers": 2, "per_device_train_batch_size": 4,
            "num_train_epochs": 3, "learning_rate": 0.02, "optim": "adamw_torch", "save_strategy": "steps",
            "save_steps": 5, "logging_steps": 3, "disable_tqdm": True, "report_to": "none"}
    base.update(kw)
    return TrainingArguments(**base)


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
    assert {*rng_files(0, 1), "model.safetensors", "optimizer.pt"} <= set(manifest["files"])

    # resumed in the SAME storage, as HF users do: the first fit's checkpoint-5 was rotated away, which
    # Ray Train's own run snapshot still listed (a second fit used to be refused by Ray)
    resumed = Trainer(model=DropoutRegressor(), args=_args(tmp_path / "full", **kw), train_dataset=data)
    out = resumed.train(resume_from_checkpoint=f"file://{folder}")  # step 10 = epoch 2, update 4 of 6
    assert out.global_step == 18
    for name, tensor in full.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name


def test_output_dir_holds_checkpoints_and_raytrainer_s_state_in_one_hidden_folder(tmp_path):
    """As with transformers: output_dir lists checkpoint-<step> folders (and the ranks' logs); Ray Train's
    run record and storage marker and the final weights are under .raytrainer/, which neither
    get_last_checkpoint nor a checkpoint-* glob takes for a checkpoint. Rotation, best-model tracking and
    the driver's lazy load of the best weights work from there."""
    from safetensors.torch import load_file
    from transformers.trainer_utils import get_last_checkpoint

    out = tmp_path / "out"
    args = _args(out, max_steps=6, save_steps=2, eval_strategy="steps", eval_steps=2, save_total_limit=1,
                 load_best_model_at_end=True)
    trainer = Trainer(model=DropoutRegressor(), args=args, train_dataset=make_data(32),
                      eval_dataset=make_data(8, seed=2))
    trainer.train()
    best = trainer.state.best_model_checkpoint
    names = sorted(os.listdir(out))
    checkpoints = sorted({"checkpoint-6", os.path.basename(best)})
    assert names == [".raytrainer", *checkpoints, "logs"], names
    assert sorted(os.listdir(out / ".raytrainer")) == ["final-model", "ray", "trainer_state.json"]
    final = json.loads((out / ".raytrainer" / "trainer_state.json").read_text())  # `raytrainer plot` reads it
    assert final["global_step"] == 6 and final["log_history"] == trainer.state.log_history
    ray_files = set(os.listdir(out / ".raytrainer" / "ray"))  # Ray Train's run folder
    assert ".validate_storage_marker" in ray_files
    assert ray_files <= {".validate_storage_marker", "checkpoint_manager_snapshot.json"}
    assert os.listdir(out / ".raytrainer" / "final-model") == ["model.safetensors"]
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-6")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == checkpoints
    assert all((out / name / "manifest.json").exists() for name in checkpoints)
    saved = load_file(os.path.join(best, "model.safetensors"))  # load_best_model_at_end, lazily
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in saved.items())
