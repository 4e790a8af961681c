"""``nonfinite_loss`` for transformers' own loop, as each rank of a hosted trainer runs it
(worker/nonfinite.NonFiniteCallback, added by worker/hosted.py): here in one process, on transformers' own
Trainer, with the context of a one-rank group."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from test_precision import Net, Weights, data  # the model, rows and recording raytrainer's loop is tested on

from raytrainer.rank_context import RankContext
from raytrainer.worker.nonfinite import NonFiniteCallback, NonFiniteLossError


class Planted(transformers.Trainer):
    """transformers' Trainer whose loss is made inf in the update after global step ``plant_at``."""

    plant_at: int | None = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training and self.state.global_step == self.plant_at:
            loss = loss * float("inf")
        return loss


def _trainer(tmp_path, mode: str, **kw):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, learning_rate=0.05, optim="adamw_torch",
        lr_scheduler_type="linear", disable_tqdm=True, logging_steps=4, report_to="none", use_cpu=True,
        **{"save_strategy": "no", **kw})
    weights = Weights()
    trainer = Planted(model=Net(), args=args, train_dataset=data(), callbacks=[weights])
    trainer.add_callback(NonFiniteCallback(trainer, mode, RankContext()))  # as worker/hosted.py adds it
    return trainer, weights


def test_a_nonfinite_loss_stops_transformers_loop_before_its_update(tmp_path):
    trainer, weights = _trainer(tmp_path, "error", max_steps=6, save_strategy="steps", save_steps=2)
    trainer.plant_at = 3  # the update to step 4
    with pytest.raises(NonFiniteLossError, match=r"rank 0 computed a training loss of inf in the update to "
                                                 r"step 4 .*nonfinite_loss='skip_step'"):
        trainer.train()
    assert trainer.state.global_step == 3
    for name, tensor in trainer.model.state_dict().items():  # the weights before the bad update
        assert torch.equal(tensor, weights.by_step[3][name]) and torch.isfinite(tensor).all(), name
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]


def test_skip_step_skips_transformers_update_and_its_scheduler_step_and_trains_on(tmp_path, caplog):
    trainer, weights = _trainer(tmp_path, "skip_step", max_steps=5)
    trainer.plant_at = 2  # the update to step 3
    with caplog.at_level(logging.WARNING, logger="raytrainer.worker.nonfinite"):
        trainer.train()
    assert trainer.state.global_step == 5
    assert all(torch.equal(weights.by_step[3][k], weights.by_step[2][k]) for k in weights.by_step[2])
    assert any(not torch.equal(weights.by_step[4][k], weights.by_step[3][k]) for k in weights.by_step[3])
    assert all(torch.isfinite(t).all() for t in trainer.model.state_dict().values())
    assert trainer.lr_scheduler.last_epoch == 4  # 5 updates, one skipped: the schedule moved 4 times
    assert trainer.optimizer.optimizer.state_dict()["state"][0]["step"] == 4  # Adam stepped 4 times
    assert "not finite in the update to step 3; that update is skipped (1 so far)" in caplog.text


def test_without_the_callback_transformers_trains_on_through_an_inf_loss(tmp_path):
    """What ``nonfinite_loss='ignore'`` leaves as it is (the worker adds no callback then)."""
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8,
                                          max_steps=4, learning_rate=0.05, report_to="none", use_cpu=True,
                                          save_strategy="no", disable_tqdm=True)
    trainer = Planted(model=Net(), args=args, train_dataset=data())
    trainer.plant_at = 1
    trainer.train()
    assert trainer.state.global_step == 4
    assert not all(torch.isfinite(t).all() for t in trainer.model.state_dict().values())
