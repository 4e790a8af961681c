"""GaLore optimizers in-process (skipped, with the reason, when galore-torch is not installed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

galore_torch = pytest.importorskip("galore_torch",
                                   reason="galore-torch is not installed (pip install galore-torch)")

import transformers  # noqa: E402
from transformers.trainer_pt_utils import LayerWiseDummyOptimizer, LayerWiseDummyScheduler  # noqa: E402

from raytrainer import Trainer, TrainingArguments  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(16, 32)
        self.mlp = nn.Linear(32, 32)
        self.head = nn.Linear(32, 3)

    def forward(self, x, labels=None):
        logits = self.head(torch.tanh(self.mlp(torch.tanh(self.proj(x)))))
        return nn.functional.cross_entropy(logits, labels), logits


def _data(n=64):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, generator=g)
    return [{"x": x[i], "labels": int(x[i, 0] > 0) + int(x[i, 1] > 0)} for i in range(n)]


def _train(tmp_path, optim: str):
    args = TrainingArguments(output_dir=str(tmp_path), optim=optim, optim_target_modules=["mlp"],
                             optim_args="rank=4,update_proj_gap=5,scale=0.25", learning_rate=0.01,
                             per_device_train_batch_size=8, num_train_epochs=4, logging_steps=8,
                             save_strategy="no", disable_tqdm=True, report_to="none")
    trainer = Trainer(model=Net(), args=args, train_dataset=_data())
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, before, losses


def test_galore_adamw_keeps_the_target_layers_state_low_rank(tmp_path):
    trainer, _, losses = _train(tmp_path, "galore_adamw")
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside accelerate's wrapper
    assert type(optimizer) is galore_torch.GaLoreAdamW
    state = optimizer.state
    assert state[trainer.model.mlp.weight]["exp_avg"].shape == (32, 4)  # projected: rank 4, not 32 x 32
    assert state[trainer.model.proj.weight]["exp_avg"].shape == (32, 16)  # not a target: full
    assert losses[-1] < losses[0] * 0.8


def test_layerwise_galore_steps_each_parameter_in_backward(tmp_path):
    trainer, before, losses = _train(tmp_path, "galore_adamw_layerwise")
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside accelerate's wrapper
    assert isinstance(optimizer, LayerWiseDummyOptimizer)  # transformers' own
    assert isinstance(trainer.lr_scheduler, LayerWiseDummyScheduler)
    assert len(optimizer.optimizer_dict) == 6  # one optimizer per parameter
    for name, tensor in trainer.model.state_dict().items():
        assert not torch.equal(tensor, before[name]), f"{name} was never stepped"
    assert losses[-1] < losses[0] * 0.8
    # each parameter's own linear schedule ran to the end (32 steps): lr 0
    assert set(trainer.lr_scheduler.get_lr()) == {0.0}


@pytest.mark.parametrize("optim", ["galore_adamw", "galore_adafactor", "galore_adamw_layerwise"])
def test_galore_groups_are_transformers(tmp_path, optim):
    kw = dict(optim=optim, optim_target_modules=["mlp"], optim_args="rank=4,update_proj_gap=5,scale=0.5",
              learning_rate=0.01, report_to="none", use_cpu=True)
    ours = Trainer(model=Net(), args=TrainingArguments(output_dir=str(tmp_path / "a"), **kw))
    theirs = transformers.Trainer(model=Net(), args=transformers.TrainingArguments(str(tmp_path / "b"), **kw))

    def described(trainer):
        opt = trainer.create_optimizer()
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        optimizers = list(opt.optimizer_dict.values()) if hasattr(opt, "optimizer_dict") else [opt]
        return type(opt), [(type(o), [({k: v for k, v in g.items() if k != "params"},
                                       [names[id(p)] for p in g["params"]]) for g in o.param_groups])
                           for o in optimizers]

    cls, optimizers = described(ours)
    assert (cls, optimizers) == described(theirs)
    projected = [settings for _, groups in optimizers for settings, names in groups
                 if names == ["mlp.weight"]]
    assert projected and all((s["rank"], s["update_proj_gap"], s["scale"]) == (4, 5, 0.5) for s in projected)


def test_layerwise_galore_is_refused_with_accumulation(tmp_path):
    with pytest.raises(ValueError, match=r"optim='galore_adamw_layerwise': .*cannot accumulate gradients"):
        TrainingArguments(output_dir=str(tmp_path), optim="galore_adamw_layerwise",
                          optim_target_modules=["mlp"], gradient_accumulation_steps=2)
