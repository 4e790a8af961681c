"""Memory and speed features in-process: gradient checkpointing, torch.compile, Adafactor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raytrainer import Trainer, TrainingArguments


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.checkpointing = None
        self.net_calls = 0  # the layers' forward runs: with checkpointing, recomputed in each backward

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
        # as HF models take it (transformers' loop also passes every_n_layers and offload)
        self.checkpointing = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}

    def _net(self, x):
        self.net_calls += 1
        return self.net(x)

    def forward(self, x, labels=None):
        if self.checkpointing is not None and self.training:
            logits = torch.utils.checkpoint.checkpoint(self._net, x, **self.checkpointing)
        else:
            logits = self._net(x)
        return nn.functional.cross_entropy(logits, labels), logits


def data(n=32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    return [{"x": x[i], "labels": int(x[i, 0] > 0)} for i in range(n)]


def train(tmp_path, **kw):
    base = {"output_dir": str(tmp_path), "num_workers": 0, "per_device_train_batch_size": 8, "max_steps": 8,
            "learning_rate": 0.05, "optim": "adamw_torch", "save_strategy": "no", "disable_tqdm": True}
    args = TrainingArguments(**{**base, **kw})
    trainer = Trainer(model=Net(), args=args, train_dataset=data())
    trainer.train()
    return trainer


def test_gradient_checkpointing_recomputes_and_gives_the_same_weights(tmp_path):
    plain = train(tmp_path / "a")
    checkpointed = train(tmp_path / "b", gradient_checkpointing=True)
    assert checkpointed.model.checkpointing == {"use_reentrant": False}
    # each of the 8 steps' forward runs again in its backward (the driver's loss check runs one more in both)
    assert checkpointed.model.net_calls - plain.model.net_calls == 8
    for k, v in plain.model.state_dict().items():
        torch.testing.assert_close(checkpointed.model.state_dict()[k], v)


def test_gradient_checkpointing_without_support_is_refused(tmp_path):
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 2)

        def forward(self, x, labels=None):
            return (nn.functional.cross_entropy(self.lin(x), labels),)

    args = TrainingArguments(output_dir=str(tmp_path), num_workers=0, max_steps=2, save_strategy="no",
                             gradient_checkpointing=True)
    trainer = Trainer(model=Bare(), train_dataset=data(), args=args)
    with pytest.raises(ValueError, match="has no gradient_checkpointing_enable"):
        trainer.train()


def test_torch_compile_trains_through_a_compiled_graph(tmp_path):
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    plain = train(tmp_path / "a")
    compiled = train(tmp_path / "b", torch_compile_backend="eager")  # eager: exact, no C++ build
    assert compiled.args.torch_compile is True
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    for k, v in plain.model.state_dict().items():
        torch.testing.assert_close(compiled.model.state_dict()[k], v)


def test_adafactor_is_transformers_and_trains(tmp_path):
    from transformers.optimization import Adafactor

    trainer = train(tmp_path, optim="adafactor", learning_rate=0.01)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside accelerate's wrapper
    assert type(optimizer) is Adafactor  # transformers' (with a fixed lr), not torch's
    assert optimizer.defaults["relative_step"] is False
    assert optimizer.state  # it took steps: factored second moments exist
    initial = Net().state_dict()
    assert all(not torch.equal(trainer.model.state_dict()[k], v) for k, v in initial.items())
