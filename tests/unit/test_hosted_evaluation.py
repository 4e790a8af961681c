"""The last round of a hosted evaluation on N workers (worker/hosted_evaluation.py): which of a rank's rows
are the data set's, and the loss-only step that leaves a trainer's own metric lists as they were. The whole
path runs on workers in tests/integration/test_guarantees.py (11 rows in batches of 2 on 2 workers)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raytrainer.worker.hosted_evaluation import _batch_rows, _first_rows, _metrics_kept, _real_rows


@pytest.mark.parametrize(("remainder", "rank", "rows", "real"), [
    (3, 0, 2, None),  # 11 rows, batches of 2, 2 ranks: rank 0's last batch is all the data set's ...
    (3, 1, 2, 1),  # ... rank 1's holds one row of it and one appended from the start
    (5, 0, 8, 5),  # 21 rows, batches of 8: rank 0 holds the 5 last rows and 3 appended
    (5, 1, 8, None),  # rank 1's batch is all padding: cut whole after the gathering
    (13, 1, 8, 5),  # 29 rows: rank 0 full, rank 1 5 of 8
    (3, 1, None, None),  # a batch without one row count: its loss stands
])
def test_a_ranks_own_rows_on_the_last_round(remainder, rank, rows, real):
    assert _real_rows(rank, remainder, rows) == real


def test_the_first_rows_of_a_batch_and_its_row_count():
    batch = {"input_ids": torch.arange(12).reshape(4, 3), "labels": torch.arange(4), "mode": "x",
             "scale": torch.tensor(2.0)}
    assert _batch_rows(batch) == 4
    first = _first_rows(batch, 1)
    assert first["input_ids"].tolist() == [[0, 1, 2]] and first["labels"].tolist() == [0]
    assert first["mode"] == "x" and first["scale"].item() == 2.0  # not rows: as they are
    assert _batch_rows({"a": torch.zeros(4, 2), "b": torch.zeros(3)}) is None


def test_the_loss_only_step_leaves_the_trainers_metric_lists_as_they_were():
    trainer = SimpleNamespace(_metrics={"eval": {"mean_token_accuracy": [0.5]}},
                              _stored_metrics={"eval": {"rewards/chosen": [1.0]}})
    with _metrics_kept(trainer):
        trainer._metrics["eval"]["mean_token_accuracy"].append(0.9)  # as TRL's compute_loss does
        trainer._stored_metrics["eval"]["rewards/chosen"].append(2.0)  # as DPO's store_metrics does
    assert trainer._metrics == {"eval": {"mean_token_accuracy": [0.5]}}
    assert trainer._stored_metrics == {"eval": {"rewards/chosen": [1.0]}}
    plain = SimpleNamespace()
    with _metrics_kept(plain):  # a trainer without them: nothing added
        pass
    assert vars(plain) == {}
