"""``evaluate()`` before ``train()`` on two gloo ranks (accelerate set up from the environment, as on Ray
workers): transformers' own ``train()`` then runs on the bare model, its gradients never averaged, and
``wrap_after_evaluation`` (worker/hosted.py, run by every rank before a ``train()`` command) makes it wrap the
model in DDP as for a first call. The first half pins transformers' behaviour: when transformers or
accelerate fixes it, the assertion on ``plain`` fails and the fix can go."""

from __future__ import annotations

import functools
import os
import socket

import numpy as np
import pytest
from two_ranks import run_two_ranks

pytestmark = pytest.mark.timeout(300)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _rank(fixed: bool, output_dir: str, rank: int, port: str, results):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
    import torch
    import transformers

    from raytrainer.worker.hosted import wrap_after_evaluation

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(6, 3)

        def forward(self, x, labels=None):
            logits = self.net(x)
            return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 6, generator=gen)
    rows = [{"x": x[i], "labels": int(x[i, 0] > 0)} for i in range(32)]
    args = transformers.TrainingArguments(output_dir, per_device_train_batch_size=4, max_steps=3,
                                          learning_rate=0.5, optim="sgd", report_to=[], use_cpu=True,
                                          disable_tqdm=True, save_strategy="no", ddp_backend="gloo")
    trainer = transformers.Trainer(model=Net(), args=args, train_dataset=rows, eval_dataset=rows[:8])
    trainer.evaluate()
    if fixed:
        wrap_after_evaluation(trainer)
    trainer.train()
    results.put(dict(rank=rank, wrapped=type(trainer.model_wrapped).__name__,
                     weight=trainer.model.net.weight.detach().numpy().copy()))


def _run(tmp_path, fixed: bool) -> list[dict]:
    target = functools.partial(_rank, fixed, str(tmp_path / ("fixed" if fixed else "plain")))
    return sorted(run_two_ranks(target, _free_port()), key=lambda r: r["rank"])


def test_a_train_after_evaluate_wraps_the_model_and_keeps_the_ranks_replicas_equal(tmp_path):
    plain = _run(tmp_path, fixed=False)
    assert [r["wrapped"] for r in plain] == ["Net", "Net"]  # transformers' own: no DDP, so
    assert not np.array_equal(plain[0]["weight"], plain[1]["weight"])  # each rank trained its own replica
    fixed = _run(tmp_path, fixed=True)
    assert [r["wrapped"] for r in fixed] == ["DistributedDataParallel"] * 2
    np.testing.assert_array_equal(fixed[0]["weight"], fixed[1]["weight"])
