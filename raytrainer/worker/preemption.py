"""A preemption notice becomes a checkpoint at a step boundary, the same step on every rank.

Ray Train (2.60 and later) watches the nodes its workers run on for drains -- a spot instance's reclaim, a
preemptible VM's notice, ``ray drain-node`` -- and hands every worker the notice (``PreemptionInfo``). On a
notice, each rank flags it; the ranks agree without waiting on each other: at a check every rank
starts an all-reduce (MAX) of its flag on a gloo group beside the training group and reads the result of
the previous check's, long finished by then. The ranks compare at every step at first, then about once a
second of training (``CHECK_EVERY_S``: a step count set once from the ranks' mean step time over the
first ``TIMED_STEPS`` steps), so a step of a few milliseconds does not pay for a check it does not need. So
every rank decides at the same step, at most one check after the last rank saw the notice, and no step
waits for a collective or syncs the device for it.

The decision is ``control.should_save``: an ordinary checkpoint, written and committed like any other.
Training then goes on, as Ray advises: when the node goes, Ray Train restarts the group on what is left
(the restart counts against ``FailureConfig.max_preemption_failures``, unbounded by default, not against
``max_failures``), and the restart resumes from that checkpoint -- the steps redone are those after it.
A second notice (another node) saves again.
"""

from __future__ import annotations

import logging
import time

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


#: How often the ranks compare what they have heard, in seconds of training (Ray polls for drains every
#: 5 s; its default drain deadline is 120 s).
CHECK_EVERY_S = 1.0
#: The first steps, each compared, whose mean time across ranks sets how many steps make CHECK_EVERY_S.
TIMED_STEPS = 8


class PreemptionCallback(TrainerCallback):
    """On every rank of a Ray run: a checkpoint at the step the ranks agree on after a preemption notice."""

    same_on_every_rank = True  # the ranks agree through the callback's own all-reduce, one check behind

    def __init__(self, ctx, notice=ray_notice):
        self.ctx, self.notice = ctx, notice
        self.handled = 0  # notices saved for: a checkpoint per newly preempted node
        self.saved_at: list[int] = []  # the steps of the checkpoints notices asked for
        self.every: int | None = None  # steps between checks, once TIMED_STEPS were timed
        self._timed_from: tuple[int, float] | None = None
        self._flag = torch.zeros(1, dtype=torch.int64)
        self._work = None
        self._group = _side_group() if ctx.distributed else None

    def _due(self, step: int) -> bool:
        """Whether the ranks compare at this step: every step at first, then every ``every`` steps (the
        same steps on every rank: the cadence comes from the ranks' mean step time, agreed once)."""
        if self.every is not None:
            return step % self.every == 0
        if self._timed_from is None:
            self._timed_from = (step, time.perf_counter())
        elif step - self._timed_from[0] == TIMED_STEPS:
            mean = (time.perf_counter() - self._timed_from[1]) / TIMED_STEPS
            mean = self.ctx.sum([mean])[0] / self.ctx.world_size
            self.every = max(1, int(CHECK_EVERY_S / max(mean, 1e-9)))
        return True

    def _agreed(self) -> int:
        """The previous check's agreed count (every rank the same), and this rank's own count sent."""
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
        if not self._due(state.global_step):
            return
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
