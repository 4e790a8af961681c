"""A preemption notice becomes a checkpoint at a step boundary, the same step on every rank.

Ray Train (2.60 and later) watches the nodes its workers run on for drains -- a spot instance's reclaim, a
preemptible VM's notice, ``ray drain-node`` -- and hands every worker the notice (``PreemptionInfo``). On a
notice, each rank flags it (and rank 0 flags an elastic run's request to grow, polled from the group's
channel: driver/scaling_policy.py); the ranks agree without waiting on each other: at a check every rank
starts an all-reduce (MAX) of its flag on a gloo group beside the training group and reads the result of
the previous check's, long finished by then. The ranks compare at every step at first, then about once a
second of training (``CHECK_EVERY_S``: a step count set once from the ranks' mean step time over the
first ``TIMED_STEPS`` steps), so a step of a few milliseconds does not pay for a check it does not need. So
every rank decides at the same step, at most one check after the last rank saw the notice, and no step
waits for a collective or syncs the device for it.

The decision is ``control.should_save``: an ordinary checkpoint, written and committed like any other. At
the next step the ranks commit it and wait: a step taken now would be trained again after the restart.
When the node goes, Ray Train restarts the group on what is left (the restart counts against
``FailureConfig.max_preemption_failures``, unbounded by default, not against ``max_failures``), and the
restart resumes from that checkpoint, no step done twice. Ray Train's controller restarts the group at the
notice's deadline (Ray's default 120 s when it gives none); if the group is still there
``HOLD_PAST_DEADLINE_S`` later, training goes on. A second notice (another node)
saves again. A growth is the same checkpoint, then a wait of at most ``GROWTH_HOLD_S`` for Ray Train to
start the bigger group from it. A SIGTERM to a rank's process (worker/signals.py) is the same checkpoint,
committed, then every rank stops (``failures.Terminated``): Ray Train restarts the group from it per
``max_failures``.
"""

from __future__ import annotations

import logging
import time

import torch

from raytrainer.callbacks import TrainerCallback
from raytrainer.elastic import GROWTH_HOLD_S
from raytrainer.failures import Terminated
from raytrainer.rank_context import side_group
from raytrainer.worker import signals

logger = logging.getLogger(__name__)


def ray_notice():
    """Ray Train's notice that nodes of this run are being preempted (``PreemptionInfo``), or None (none
    yet, or a Ray without preemption notices)."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().preemption_context.preemption_info
    except (ImportError, AttributeError, RuntimeError):
        return None


#: How often the ranks compare what they have heard, in seconds of training (Ray polls for drains every
#: 5 s; its default drain deadline is 120 s).
CHECK_EVERY_S = 1.0
#: The first steps, each compared, whose mean time across ranks sets how many steps make CHECK_EVERY_S.
TIMED_STEPS = 8
#: How long the ranks hold after a notice without a deadline (Ray Train's own default deadline).
DEFAULT_HOLD_S = 120.0
#: How long past the deadline the ranks still hold: Ray Train's controller restarts the group at the
#: deadline (``FailureConfig.preemption_grace_s``, 0 by default) and the node goes then; a step begun
#: meanwhile would be trained again.
HOLD_PAST_DEADLINE_S = 10.0


class PreemptionCallback(TrainerCallback):
    """On every rank of a Ray run: a checkpoint at the step the ranks agree on after a preemption notice,
    committed, then no step until the node has gone (the restart resumes there, no step trained twice) or
    the notice's deadline has passed with the node still there (training goes on). After a SIGTERM to a
    rank's process: the same checkpoint, committed, then every rank stops."""

    same_on_every_rank = True  # the ranks agree through the callback's own all-reduce, one check behind
    stays_on_ranks = True  # not sent back to the driver after a call (worker/rank.callback_states)
    hold_past_deadline_s = HOLD_PAST_DEADLINE_S

    def __init__(self, session, notice=ray_notice, growth=None):
        self.session, self.ctx, self.notice = session, session.ctx, notice
        self.handled = 0  # notices saved for: a checkpoint per newly preempted node
        # an elastic run's growths (rank 0 polls the channel; counted from those asked before this call)
        self.growth = growth if self.ctx.is_world_zero else None
        self.grown = 0  # growths saved for
        self.listener = signals.listen()  # this process's first SIGTERM, heard while training
        self.signalled = 0  # 1 + the rank whose process received a SIGTERM, once agreed (0: none)
        self._growth_base = self._growth_asked = 0
        self._growth_ref = None
        if self.growth is not None:
            import ray

            self._growth_base = self._growth_asked = ray.get(self.growth.growth_requested())
        self.every: int | None = None  # steps between checks, once TIMED_STEPS were timed
        self._timed_from: tuple[int, float] | None = None
        self._hold: str | None = None  # the next step waits: for the node to go, or for the group to grow
        # [preempted nodes heard of, growths asked, 1 + this rank if its process received a SIGTERM]
        self._flag = torch.zeros(3, dtype=torch.int64)
        self._work = None
        # the check's all-reduces run on CPU threads beside the step's group (NCCL's stream on a GPU)
        self._group = side_group("preemption") if self.ctx.distributed else None

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

    def _growths_asked(self) -> int:
        """Rank 0: the growths the channel has asked for since this call began (polled without waiting: at
        most one request in flight)."""
        import ray

        if self._growth_ref is not None and ray.wait([self._growth_ref], timeout=0)[0]:
            self._growth_asked, self._growth_ref = ray.get(self._growth_ref), None
        if self._growth_ref is None:
            self._growth_ref = self.growth.growth_requested()
        return self._growth_asked - self._growth_base

    def _agreed(self) -> tuple[int, int, int]:
        """The previous check's agreed counts (every rank the same), and this rank's own counts sent."""
        agreed = (self.handled, self.grown, self.signalled)
        if self._work is not None:
            self._work.wait()
            agreed = tuple(int(v) for v in self._flag.tolist())
        info = self.notice()
        self._flag[0] = 0 if info is None else max(len(info.preempted_node_to_ranks), 1)
        self._flag[1] = self._growths_asked() if self.growth is not None else 0
        self._flag[2] = self.ctx.rank + 1 if self.listener is not None and self.listener.received else 0
        if self._group is None:
            return tuple(max(a, int(v)) for a, v in zip(agreed, self._flag.tolist()))
        self._work = torch.distributed.all_reduce(self._flag, op=torch.distributed.ReduceOp.MAX,
                                                  group=self._group, async_op=True)
        return agreed

    #: What each reason to save says on rank 0 (``%d``: the step).
    SAYS = {"preemption": "a node of this run is being preempted (Ray's notice): every rank saves a "
                          "checkpoint at step %d, then waits for the node to go",
            "growth": "the cluster has room for more workers: every rank saves a checkpoint at step %d, from "
                      "which Ray Train starts the group bigger",
            "signal": "rank %d's process received a SIGTERM: every rank saves a checkpoint at step %d, "
                      "commits it and stops"}

    def on_step_end(self, args, state, control, **kwargs):
        if not self._due(state.global_step):
            return
        preempted, growths, signalled = self._agreed()
        if signalled > self.signalled:
            self.signalled, self._hold = signalled, "signal"
        elif preempted > self.handled:
            self.handled, self._hold = preempted, "preemption"
        elif growths > self.grown:
            self.grown, self._hold = growths, "growth"
        else:
            return
        control.should_save = True
        if self.ctx.is_world_zero:
            said = (self.signalled - 1,) if self._hold == "signal" else ()
            logger.warning(self.SAYS[self._hold], *said, state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        """The step after the notice's checkpoint: the checkpoint is committed (every rank), then no rank
        steps until the node has gone -- Ray Train then restarts the group from it -- or the deadline has
        passed with the node still there."""
        if not self._hold:
            return
        why, self._hold = self._hold, None
        writer = getattr(self.session, "writer", None)
        if writer is not None:
            writer.commit()  # a collective: every rank is at this step
        if why == "signal":
            signals.stop_listening(self.listener, acted=True)
            raise Terminated(
                f"rank {self.signalled - 1}'s process received a SIGTERM: every rank saved "
                f"checkpoint-{state.global_step}, committed it, and stopped. Ray Train starts the workers "
                "again from it while max_failures allows; past that, continue from it with "
                "trainer.train(resume_from_checkpoint=True)")
        if why == "growth":
            hold_until = time.time() + GROWTH_HOLD_S
            if self.growth is not None:  # rank 0: the scaling policy may restart the group now
                self.growth.growth_committed(self._growth_base + self.grown, state.global_step)
        else:
            hold_until = self._deadline() + self.hold_past_deadline_s
        if self.ctx.is_world_zero:
            logger.warning("checkpoint-%d is committed; no step until %s (in at most %.0f s)",
                           state.global_step, "the node goes" if why == "preemption" else "the group grows",
                           max(hold_until - time.time(), 0.0))
        while time.time() < hold_until:
            time.sleep(min(1.0, max(hold_until - time.time(), 0.0)))
        if self.ctx.is_world_zero:  # Ray Train did not restart the group
            waited = "its deadline" if why == "preemption" else f"{GROWTH_HOLD_S:.0f} s after the commit"
            logger.warning("the group was not restarted by %s: training goes on", waited)

    def _deadline(self) -> float:
        """The earliest deadline (``time.time()``) any rank was given (a collective: the ranks that have
        not heard yet know none); Ray Train's default from now when no rank has one."""
        info = self.notice()
        mine = info.deadline_ms / 1000 if info is not None and info.deadline_ms else float("inf")
        if self._group is not None:
            if self._work is not None:
                self._work.wait()
                self._work = None
            box = torch.tensor([mine], dtype=torch.float64)
            torch.distributed.all_reduce(box, op=torch.distributed.ReduceOp.MIN, group=self._group)
            mine = float(box.item())
        return mine if mine != float("inf") else time.time() + DEFAULT_HOLD_S

    def on_train_end(self, args, state, control, **kwargs):
        signals.stop_listening(self.listener, acted=False)
        if self._work is not None:  # every rank started it at the same last step
            self._work.wait()
            self._work = None
