"""ZeRO-3 resumed from DeepSpeed's universal checkpoint (a checkpoint of another number of ranks): DeepSpeed
gives every flat fp32 partition the same ``step`` tensor (torch's Adam advances each parameter's step in
place, so with two parameter groups, transformers' decay / no-decay, the step went up by two per update)
and every group the first group's hyperparameters (the no-decay group decayed): the resumed run drifted
from the uninterrupted one. A real one-rank ZeRO-3 engine
on gloo, in this process."""

from __future__ import annotations

import pytest
import torch


def _engine(config):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
              {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=0.05)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _step(engine, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
    engine.step()


def _weights(engine) -> list[torch.Tensor]:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.timeout(180)
def test_a_universal_zero3_resume_steps_each_group_once_and_follows_the_uninterrupted_run(
        tmp_path, gloo_group, monkeypatch):
    import deepspeed.utils.groups as ds_groups

    from raytrainer.strategies.deepspeed import _convert_to_universal, _repair_zero3_load

    monkeypatch.setenv("LOCAL_RANK", "0")
    # DeepSpeed caches the world's group from an earlier test's process group, destroyed since
    monkeypatch.setattr(ds_groups, "_WORLD_GROUP", None)
    monkeypatch.setattr(ds_groups, "_DATA_PARALLEL_GROUP", None)
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 3}}
    first = _engine(config)
    for i in range(3):
        _step(first, i)
    first.save_checkpoint(str(tmp_path), tag="step3")
    _convert_to_universal(str(tmp_path / "step3"), str(tmp_path / "step3_universal"))
    for i in range(3, 6):
        _step(first, i)

    resumed = _engine({**config, "checkpoint": {"load_universal": True}})
    resumed.load_checkpoint(str(tmp_path), tag="step3_universal", load_optimizer_states=True)
    states = list(resumed.optimizer.optimizer.state.values())
    assert len(states) == 2 and states[0]["step"] is states[1]["step"]  # DeepSpeed's load, as found
    groups = resumed.optimizer.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.1]  # ... the first group's for both
    _repair_zero3_load(resumed.optimizer, str(tmp_path / "step3_universal"))
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert states[0]["step"] is not states[1]["step"] and [float(s["step"]) for s in states] == [3.0, 3.0]
    for i in range(3, 6):
        _step(resumed, i)
    assert [float(s["step"]) for s in resumed.optimizer.optimizer.state.values()] == [6.0, 6.0]
    for a, b in zip(_weights(first), _weights(resumed)):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
