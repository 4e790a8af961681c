"""The last round of a hosted evaluation on N workers (worker/hosted_evaluation.py): which of a rank's rows
are the data set's, and the loss-only step that leaves a trainer's own metric lists as they were. The whole
path runs on workers in tests/integration/test_guarantees.py (11 rows in batches of 2 on 2 workers)."""

from __future__ import annotations

import pytest
import torch

from raytrainer.worker.hosted_evaluation import _batch_rows, _first_rows, _real_rows, _rows_again


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


def test_a_rank_s_outputs_of_its_real_rows_are_given_the_padding_rows_back():
    logits = (torch.arange(6.0).reshape(2, 3), torch.ones(2, 4, 5))  # two real rows of a batch of 4
    again = _rows_again(logits, 2, 4)
    assert again[0].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [3.0, 4.0, 5.0], [3.0, 4.0, 5.0]]
    assert again[1].shape == (4, 4, 5)
    assert _rows_again(torch.tensor(1.5), 2, 4).item() == 1.5 and _rows_again(None, 2, 4) is None
