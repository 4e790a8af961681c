"""The straggler warning: the driver's view of each rank's pace (measured by worker/pace.py).

Every rank of a data-parallel run waits for the slowest at each step, so one slow worker (a busy node, slow
data loading, a throttled device) sets the pace of all of them. At each logging step rank 0 reports each
rank's own work per step (reading its batches and the forward pass, collectives excluded); a rank whose
work stays well above the others' median for two reports in a row is named once, with its node, and the
pace it had over those reports (one report can hold more or fewer batch reads than steps: accelerate's
loader reads a batch ahead, two at an epoch's first step and none at its last).
"""

from __future__ import annotations

import logging
import statistics

from raytrainer.protocol import Pace

logger = logging.getLogger(__name__)


class StragglerWatch:
    """``ratio``: how many times the others' median a rank must take; ``min_gap``: and by how many seconds
    per step at least (clock noise at millisecond steps is not a straggler); ``windows``: for how many
    consecutive reports (the first one holds warm-up)."""

    def __init__(self, ratio: float = 1.5, min_gap: float = 0.02, windows: int = 2):
        self.ratio, self.min_gap, self.windows = ratio, min_gap, windows
        self._streak: dict[int, list[tuple[float, float]]] = {}  # (its seconds, the others') per report
        self.warned: set[int] = set()

    def observe(self, report: Pace) -> list[str]:
        """The warnings this report raises (each is logged too)."""
        per_rank, nodes = report.seconds_per_step, report.nodes
        if len(per_rank) < 2:
            return []
        messages = []
        for rank, seconds in enumerate(per_rank):
            others = statistics.median(per_rank[:rank] + per_rank[rank + 1:])
            slow = seconds > self.ratio * others and seconds - others > self.min_gap
            streak = self._streak[rank] = [*self._streak.get(rank, []), (seconds, others)] if slow else []
            if len(streak) >= self.windows and rank not in self.warned:
                self.warned.add(rank)
                node = f" on node {nodes[rank]}" if nodes else ""
                seconds, others = (statistics.fmean(column) for column in zip(*streak))
                messages.append(
                    f"rank {rank}{node} is a straggler: its own work (reading batches, forward) takes "
                    f"{seconds:.3f} s per step against {others:.3f} s on the other ranks (median), and every "
                    f"rank waits for it at each step. Check that node's load, its data loading "
                    f"(dataloader_num_workers) and its device.")
        for message in messages:
            logger.warning(message)
        return messages
