"""Evaluation on two real ranks gives what one process gives (worker/hosted_evaluation.py), without Ray.

Each rank is one of two spawned processes in a gloo group, set up as Ray Train sets up a worker group's ranks,
and builds raytrainer's Trainer from the recipe the driver's trainer (``num_workers=2``) made, as a Ray
worker's rank does; the rank's evaluation layer is installed as ``run_hosted`` installs it. Rank 0 gets one
process's predictions, in dataset order, and both ranks one process's metrics -- with
``eval_accumulation_steps``, with ``batch_eval_metrics``, whose ``compute_metrics`` runs on rank 0 only,
over each batch of every rank's rows, and with the plain gather transformers' Seq2SeqTrainer uses; and an
``IterableDataset``, whose last rows accelerate deals out one to each rank.
"""

from __future__ import annotations

import functools
import socket

import numpy as np
import pytest
import torch
from two_ranks import run_two_ranks

from raytrainer import Trainer, TrainingArguments

ROWS, BATCH = 13, 3  # 2 ranks of 3: three rounds, the last holding one real row
CASES = {"plain": {}, "accumulated": {"eval_accumulation_steps": 2}, "batched": {"batch_eval_metrics": True},
         "plain_gather": {}}


class Accuracy:
    """``compute_metrics``: records how it was called, in the process that calls it."""

    def __init__(self):
        self.calls = []

    def __call__(self, p, compute_result=None):
        predictions, labels = (np.asarray(p.predictions), np.asarray(p.label_ids))
        self.calls.append(len(labels))
        return {"accuracy": float((predictions.argmax(-1) == labels).mean()), "rows": len(labels)}


class BatchedAccuracy(Accuracy):
    """transformers' ``batch_eval_metrics`` protocol: called per batch, the result on ``compute_result``."""

    def __init__(self):
        super().__init__()
        self.correct = self.seen = 0

    def __call__(self, p, compute_result=None):
        predictions, labels = p.predictions, p.label_ids
        self.calls.append(len(labels))
        self.correct += int((predictions.argmax(-1) == labels).sum())
        self.seen += len(labels)
        if compute_result:
            result = {"accuracy": self.correct / self.seen, "rows": self.seen}
            self.correct = self.seen = 0
            return result
        return {}


class PlainGather(Trainer):
    """Gathers as transformers' Seq2SeqTrainer does: accelerate's plain gather, which in one process cuts
    nothing, so the short last batch's loss (repeated eval_batch_size times by the loop) weighs as a full
    batch's."""

    def evaluate(self, *args, **kwargs):
        self.gather_function = self.accelerator.gather
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        self.gather_function = self.accelerator.gather
        return super().predict(*args, **kwargs)


class _Scorer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


def _examples() -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, 4, generator=generator)
    return [{"x": x[i], "labels": int(i % 3)} for i in range(ROWS)]


def _trainer(output_dir: str, num_workers: int, case: str) -> Trainer:
    overrides = CASES[case]
    metrics = BatchedAccuracy() if overrides.get("batch_eval_metrics") else Accuracy()
    args = TrainingArguments(output_dir=output_dir, num_workers=num_workers, per_device_eval_batch_size=BATCH,
                             report_to="none", disable_tqdm=True, **overrides)
    cls = PlainGather if case == "plain_gather" else Trainer
    return cls(model=_Scorer(), args=args, eval_dataset=_examples(), compute_metrics=metrics)


def _evaluate_on_rank(recipes: dict, rank: int, port: str, results) -> None:
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
    from raytrainer.rank_context import RankContext
    from raytrainer.worker.hosted_evaluation import evaluate_as_one_process
    from raytrainer.worker.hosted_sharding import build_trainer

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method="env://", rank=rank, world_size=2)
    ctx = RankContext(world_size=2, rank=rank, local_rank=rank, local_world_size=2)
    seen = {"rank": rank}
    for name, recipe in recipes.items():
        trainer_cls, args, kwargs, targs, _given = recipe.unpack(2)
        trainer = build_trainer(trainer_cls, args, kwargs, targs, again=lambda r=recipe: r.unpack(2)[1:3])
        evaluate_as_one_process(trainer, ctx)
        evaluated = trainer.evaluate()
        predicted = trainer.predict(trainer.eval_dataset)
        seen[name] = {"evaluate": evaluated, "metrics": predicted.metrics,
                      "calls": trainer.compute_metrics.calls,
                      "predictions": np.asarray(predicted.predictions),
                      "labels": np.asarray(predicted.label_ids)}
    results.put(seen)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _measured(metrics: dict) -> dict:
    """The metrics without each process's own timings (``*_runtime``, ``*_per_second``...)."""
    return {k: v for k, v in metrics.items() if not k.endswith(("_runtime", "_per_second", "_time"))}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each of two real ranks got in every case, both spawned once."""
    out = str(tmp_path_factory.mktemp("eval"))
    recipes = {name: _trainer(out, 2, name)._recipe for name in CASES}
    seen = run_two_ranks(functools.partial(_evaluate_on_rank, recipes), _free_port(), timeout=240)
    return sorted(seen, key=lambda r: r["rank"])


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_evaluate_and_predict_as_one_process(ranks, tmp_path, case):
    one = _trainer(str(tmp_path), 0, case)
    evaluated, predicted = one.evaluate(), one.predict(one.eval_dataset)
    zero, other = ranks[0][case], ranks[1][case]
    # rank 0: every row once, in dataset order; the other rank holds only its own share
    np.testing.assert_allclose(zero["predictions"], predicted.predictions, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(zero["labels"], predicted.label_ids)
    assert len(other["predictions"]) < ROWS
    for key in ("evaluate", "metrics"):
        mine = zero[key]
        assert _measured(mine) == _measured(other[key])  # rank 0's metrics on every rank
        theirs = evaluated if key == "evaluate" else predicted.metrics
        prefix = "eval" if key == "evaluate" else "test"
        assert mine[f"{prefix}_accuracy"] == pytest.approx(theirs[f"{prefix}_accuracy"])
        assert mine[f"{prefix}_rows"] == theirs[f"{prefix}_rows"] == ROWS
        assert mine[f"{prefix}_loss"] == pytest.approx(theirs[f"{prefix}_loss"], rel=1e-6)
    # compute_metrics ran on rank 0 only: once per call, or once per batch of both ranks' rows
    assert other["calls"] == []
    if case == "batched":
        assert zero["calls"] == [2 * BATCH, 2 * BATCH, 1] * 2
    else:
        assert zero["calls"] == [ROWS, ROWS]


def test_a_plain_gather_s_short_last_batch_weighs_as_in_one_process(ranks, tmp_path):
    """The two ways one process counts the short last batch's loss differ here (so the case above tells
    them apart): per row under gather_for_metrics, as a full batch under the plain gather."""
    rows_weighted = _trainer(str(tmp_path), 0, "plain").evaluate()["eval_loss"]
    batch_weighted = _trainer(str(tmp_path), 0, "plain_gather").evaluate()["eval_loss"]
    assert abs(rows_weighted - batch_weighted) > 1e-3
    assert ranks[0]["plain_gather"]["evaluate"]["eval_loss"] == pytest.approx(batch_weighted, rel=1e-6)


class _Stream(torch.utils.data.IterableDataset):
    """The examples as an ``IterableDataset``: accelerate deals its batches out in equal slices
    (``dispatch_batches``), so the last round's 2 rows are one on each rank."""

    def __init__(self, rows: int):
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(rows, 4, generator=generator)

    def __iter__(self):
        return iter({"x": x, "labels": i % 3} for i, x in enumerate(self.x))


def _evaluate_a_stream(recipe, rank: int, port: str, results) -> None:
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
    from raytrainer.rank_context import RankContext
    from raytrainer.worker.hosted_evaluation import evaluate_as_one_process
    from raytrainer.worker.hosted_sharding import build_trainer

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method="env://", rank=rank, world_size=2)
    trainer_cls, args, kwargs, targs, _given = recipe.unpack(2)
    trainer = build_trainer(trainer_cls, args, kwargs, targs)
    ctx = RankContext(world_size=2, rank=rank, local_rank=rank, local_world_size=2)
    evaluate_as_one_process(trainer, ctx)
    predicted = trainer.predict(trainer.eval_dataset)
    results.put({"rank": rank, "metrics": predicted.metrics, "labels": np.asarray(predicted.label_ids)})


def test_an_iterable_data_sets_last_rows_dealt_one_to_each_rank_weigh_as_in_one_process(tmp_path):
    """14 rows in batches of 3 on 2 ranks: the last round's 2 rows are one on each rank, each batch's loss
    repeated 3 times by transformers' loop; ``gather_for_metrics`` keeps the first 2 of the 6 copies, rank
    0's twice. raytrainer's rank 0 keeps one copy of each rank's: one process's ``test_loss``."""

    def trainer(num_workers: int) -> Trainer:
        args = TrainingArguments(output_dir=str(tmp_path), num_workers=num_workers, report_to="none",
                                 per_device_eval_batch_size=BATCH, disable_tqdm=True)
        return Trainer(model=_Scorer(), args=args, eval_dataset=_Stream(14), compute_metrics=Accuracy())

    one = trainer(0).predict(_Stream(14))
    seen = run_two_ranks(functools.partial(_evaluate_a_stream, trainer(2)._recipe), _free_port(), timeout=240)
    zero = next(r for r in seen if r["rank"] == 0)
    np.testing.assert_array_equal(zero["labels"], one.label_ids)
    assert zero["metrics"]["test_rows"] == one.metrics["test_rows"] == 14
    assert zero["metrics"]["test_accuracy"] == pytest.approx(one.metrics["test_accuracy"])
    assert zero["metrics"]["test_loss"] == pytest.approx(one.metrics["test_loss"], rel=1e-6)
