"""A PBT exploit resumes another trial's checkpoint with this trial's mutated hyperparameters: the
optimizer and schedule state come back, the new learning_rate and weight_decay take effect."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raytrainer import Trainer, TrainingArguments


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 3)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        return nn.functional.cross_entropy(logits, labels), logits


def _data(n=48):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    return [{"x": x[i], "labels": int(x[i, 0] > 0)} for i in range(n)]


def _trainer(out, lr, wd=0.0):
    args = TrainingArguments(output_dir=str(out), learning_rate=lr, weight_decay=wd, max_steps=6,
                             per_device_train_batch_size=8, logging_steps=1, save_strategy="steps",
                             save_steps=3, disable_tqdm=True, optim="adamw_torch", report_to="none")
    return Trainer(model=Net(), args=args, train_dataset=_data())


def _lr_at(trainer, step):
    logged = [h for h in trainer.state.log_history if h.get("step") == step and "loss" in h]
    return logged[0]["learning_rate"]


@pytest.mark.parametrize("mutated", [False, True])
def test_resume_takes_the_mutated_learning_rate_only_for_a_pbt_exploit(tmp_path, mutated):
    source = _trainer(tmp_path / "source", lr=0.1, wd=0.01)
    source.train()
    trial = _trainer(tmp_path / "trial", lr=0.01, wd=0.2)
    trial._resume_with_new_hyperparameters = mutated  # what the PBT path of the Ray Tune backend sets
    trial.train(resume_from_checkpoint=str(tmp_path / "source" / "checkpoint-3"))
    # linear decay over 6 steps; step 4 logs the rate it used (before its scheduler step, as transformers):
    # base * (1 - 3/6)
    base = 0.01 if mutated else 0.1
    assert _lr_at(trial, 4) == pytest.approx(base * (1 - 3 / 6))
    decays = {g["weight_decay"] for g in trial.optimizer.param_groups}
    assert decays == ({0.0, 0.2} if mutated else {0.0, 0.01})
