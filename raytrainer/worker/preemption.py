"""A preemption notice becomes a checkpoint at a step boundary, the same step on every rank.

Ray Train (2.60 and later) watches the nodes its workers run on for drains -- a spot instance's reclaim, a
preemptible VM's notice, ``ray drain-node`` -- and hands every worker the notice (``PreemptionInfo``). On a
notice, each rank flags it; the ranks agree without waiting on each other: at each step's end every rank
starts an all-reduce (MAX) of its flag on a gloo group beside the training group and reads the result of
the previous step's, long finished by then. So every rank decides at the same step, at most one step after
the last rank saw the notice, and no step waits for a collective or syncs the device for it.

The decision is ``control.should_save``: an ordinary checkpoint, written and committed like any other.
Training then goes on, as Ray advises: when the node goes, Ray Train restarts the group on what is left
(the restart counts against ``FailureConfig.max_preemption_failures``, unbounded by default, not against
``max_failures``), and the restart resumes from that checkpoint -- the steps redone are those after it.
A second notice (another node) saves again.
"""

from __future__ import annotations

import logging

import torch

from raytrainer.callbacks import TrainerCallback

logger = logging.getLogger(__name__)


def ray_notice() -> int:
    """How many nodes of this run Ray Train has said are being preempted (0: none, or no Ray notices)."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        info = get_train_context().preemption_context.preemption_info
    except (ImportError, AttributeError, RuntimeError):  # a Ray without preemption notices
        return 0
    return 0 if info is None else max(len(info.preempted_node_to_ranks), 1)


class PreemptionCallback(TrainerCallback):
    """On every rank of a Ray run: a checkpoint at the step the ranks agree on after a preemption notice."""

    same_on_every_rank = True  # the ranks agree through the callback's own all-reduce, one step behind

    def __init__(self, ctx, notice=ray_notice):
        self.ctx, self.notice = ctx, notice
        self.handled = 0  # notices saved for: a checkpoint per newly preempted node
        self.saved_at: list[int] = []  # the steps of the checkpoints notices asked for
        self._flag = torch.zeros(1, dtype=torch.int64)
        self._work = None
        self._group = _side_group() if ctx.distributed else None

    def _agreed(self) -> int:
        """The previous step's agreed count (every rank the same), and this step's own flag sent."""
        agreed = self.handled
        if self._work is not None:
            self._work.wait()
            agreed = int(self._flag.item())
        self._flag.fill_(self.notice())
        if self._group is None:
            return max(agreed, int(self._flag.item()))
        self._work = torch.distributed.all_reduce(self._flag, op=torch.distributed.ReduceOp.MAX,
                                                  group=self._group, async_op=True)
        return agreed

    def on_step_end(self, args, state, control, **kwargs):
        agreed = self._agreed()
        if agreed > self.handled:
            self.handled = agreed
            self.saved_at.append(state.global_step)
            control.should_save = True
            if self.ctx.is_world_zero:
                logger.warning("a node of this run is being preempted (Ray's notice): every rank saves a "
                               "checkpoint at step %d, and the run goes on until the node goes",
                               state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self._work is not None:  # every rank started it at the same last step
            self._work.wait()
            self._work = None


_side_groups: dict = {}  # the default group -> a gloo group over the same ranks


def _side_group():
    """A gloo group over the training group's ranks (made once per process group, a collective every rank
    reaches as the callback is made): its all-reduces run on CPU threads, beside NCCL's stream."""
    import torch.distributed as dist

    world = dist.group.WORLD
    group = _side_groups.get(world)
    if group is None:
        _side_groups.clear()
        group = _side_groups[world] = dist.new_group(backend="gloo")
    return group
