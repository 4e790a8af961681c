"""The evaluation loop's gather (worker/evaluation._Gatherer) without Ray: with eval_accumulation_steps each
rank's outputs leave it for rank 0 every that many steps, and rank 0 assembles, per rank, exactly what one
gather at the end would have given. Rank 1 is played by a scripted peer at the same collective calls."""

from __future__ import annotations

import numpy as np
import torch

from raytrainer.worker.evaluation import _Accumulator, _Gatherer, nested_concat


class TwoRanks:
    """Rank 0's view of a 2-rank gather_object: its own object plus what rank 1 sends at that call."""

    world_size, is_world_zero = 2, True
    dp_size, model_parallel, is_dp_leader = 2, 1, True

    def __init__(self, peer_sends: list):
        self.peer_sends, self.calls = peer_sends, 0

    def gather_object(self, obj):
        self.calls += 1
        return [obj, self.peer_sends.pop(0)]


def _batches(rank: int, steps: int) -> list[torch.Tensor]:
    """Variable-length sequences (as generated ids are): step s has length 2 + (s + rank) % 3."""
    return [torch.full((3, 2 + (s + rank) % 3), 10 * rank + s) for s in range(steps)]


def test_each_rank_sends_every_eval_accumulation_steps_and_rank_0_assembles_the_same_arrays():
    steps, every = 5, 2
    mine, theirs = _batches(0, steps), _batches(1, steps)
    # rank 1 sends its parts at each of rank 0's flushes: steps 2 and 4, then the rest at the end
    peer = [[[t.numpy() for t in theirs[0:2]]], [[t.numpy() for t in theirs[2:4]]], [[theirs[4].numpy()]]]
    ctx = TwoRanks(peer)
    acc = _Accumulator()
    gatherer = _Gatherer(ctx, [acc], every)
    held = []
    for step, batch in enumerate(mine):
        acc.add(batch)
        gatherer.step_done(step)
        held.append(len(acc.device_parts))
    assert held == [1, 0, 1, 0, 1]  # a rank never holds more than eval_accumulation_steps batches
    (per_rank,) = gatherer.results()
    assert ctx.calls == 3  # two flushes during the loop, one at the end
    once = [nested_concat([t.numpy() for t in mine]), nested_concat([t.numpy() for t in theirs])]
    for got, want in zip(per_rank, once):
        np.testing.assert_array_equal(got, want)
    assert per_rank[0].shape == (15, 4) and (per_rank[0][:3, 2:] == -100).all()  # padded across parts


def test_without_eval_accumulation_steps_one_gather_at_the_end():
    mine, theirs = _batches(0, 3), _batches(1, 3)
    ctx = TwoRanks([[[t.numpy() for t in theirs]]])
    acc = _Accumulator()
    gatherer = _Gatherer(ctx, [acc, _Accumulator()], None)
    for step, batch in enumerate(mine):
        acc.add(batch)
        gatherer.step_done(step)
    assert ctx.calls == 0
    ctx.peer_sends[0].append([])  # rank 1 has no second output either
    per_rank, empty = gatherer.results()
    assert ctx.calls == 1 and empty == [None, None]
    np.testing.assert_array_equal(per_rank[1], nested_concat([t.numpy() for t in theirs]))


class TensorParallelPairs(TwoRanks):
    """Rank 0's view of 4 ranks in 2 tensor-parallel pairs: ranks 1 and 3 compute what 0 and 2 do, and send
    nothing (None); rank 2 sends its pair's outputs."""

    world_size, dp_size, model_parallel = 4, 2, 2

    def gather_object(self, obj):
        self.calls += 1
        return [obj, None, self.peer_sends.pop(0), None]


def test_a_tensor_parallel_pair_s_outputs_count_once():
    mine, theirs = _batches(0, 2), _batches(1, 2)
    ctx = TensorParallelPairs([[[t.numpy() for t in theirs]]])
    acc = _Accumulator()
    gatherer = _Gatherer(ctx, [acc], None)
    for batch in mine:
        acc.add(batch)
    (per_rank,) = gatherer.results()
    assert len(per_rank) == 2  # one entry per data-parallel rank, not per rank
    np.testing.assert_array_equal(per_rank[0], nested_concat([t.numpy() for t in mine]))
    np.testing.assert_array_equal(per_rank[1], nested_concat([t.numpy() for t in theirs]))
