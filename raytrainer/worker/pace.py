"""Each rank's own pace, for the driver's straggler warning (driver/pace.py).

In a data-parallel step every rank waits for the slowest at the gradient all-reduce, so the wall time of a
step is the same everywhere and says nothing about who is slow. What differs is the work a rank does
before it reaches a collective: reading its batches, and the forward pass. ``PaceMeter`` times those two
on each rank (a clock read around the batch fetch, and a forward pre-hook and hook on the unwrapped model,
which run inside DDP's wrapper after its buffer broadcast).

Nothing is sent on its own: at each logging step the loop already sums the loss across ranks in one
all-reduce, and the per-rank seconds ride in that same tensor, one slot per rank (``window``). Rank 0
passes the result to the driver with the rank's node, gathered once per ``train()``.
"""

from __future__ import annotations

import time

import torch
from transformers import TrainerCallback

from raytrainer.protocol import Pace


class PaceMeter:
    def __init__(self, model: torch.nn.Module, ctx, time_forward: bool = True):
        self.ctx = ctx
        self.seconds = 0.0  # this rank's own work since the last window
        self.steps = 0
        self._forward_started = None
        # Under torch.compile a clock read in a hook would break the graph: there only batch reading counts.
        self._hooks = ([model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]
                       if time_forward else [])
        self.nodes = ctx.gather_object(_node()) if ctx.distributed else None  # rank 0 only; once

    def _pre(self, module, inputs):
        self._forward_started = time.perf_counter()

    def _post(self, module, inputs, output):
        if self._forward_started is not None and module.training:
            self.seconds += time.perf_counter() - self._forward_started
        self._forward_started = None

    def fetching(self, started: float) -> None:
        """The batches of one step were read, starting at ``started`` (``time.perf_counter()``)."""
        self.seconds += time.perf_counter() - started
        self.steps += 1

    def slots(self) -> list[float]:
        """This rank's seconds per step since the last window, in its own slot of a world-size vector (the
        other slots 0): summed across ranks, the vector holds every rank's pace."""
        out = [0.0] * self.ctx.world_size
        out[self.ctx.rank] = self.seconds / max(self.steps, 1)
        self.seconds, self.steps = 0.0, 0
        return out

    def report(self, per_rank: list[float]) -> Pace:
        return Pace(per_rank, self.nodes)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


class PaceCallback(TrainerCallback):
    """The straggler warning for transformers' loop (each rank of a hosted trainer, worker/hosted.py): the
    same meter, its batch reading timed around the trainer's ``get_batch_samples`` (which reads an update's
    batches, the collator included), its forward by the meter's hooks. transformers' loop sums its loss for
    a log in a gather of its own, so the ranks' seconds take one small all-reduce of their own (a float per
    rank), at steps every rank knows without agreeing: every ``logging_steps`` steps (or 50, when logs are
    not by steps), never on a flag one rank's callback could set alone."""

    same_on_every_rank = True

    def __init__(self, trainer, ctx, sink):
        self.trainer, self.ctx, self.sink, self.meter = trainer, ctx, sink, None
        inner = trainer.get_batch_samples  # the class's own, bound

        def get_batch_samples(*args, **kwargs):
            started = time.perf_counter()
            batches = inner(*args, **kwargs)
            if self.meter is not None:
                self.meter.fetching(started)
            return batches

        trainer.get_batch_samples = get_batch_samples

    def on_train_begin(self, args, state, control, **kwargs):
        self.on_train_end(args, state, control)
        self.meter = PaceMeter(self.trainer.model, self.ctx, time_forward=not args.torch_compile)

    def on_step_end(self, args, state, control, **kwargs):
        by_steps = getattr(args.logging_strategy, "value", args.logging_strategy) == "steps"
        every = max(1, int(state.logging_steps)) if by_steps and state.logging_steps else 50
        if self.meter is None or state.global_step % every:
            return
        per_rank = self.ctx.sum(self.meter.slots())
        if self.ctx.is_world_zero:
            self.sink(self.meter.report(per_rank))

    def on_train_end(self, args, state, control, **kwargs):
        if self.meter is not None:
            self.meter.close()
        self.meter = None


def _node() -> str:
    """This process's node, as ``ray status`` names it (its IP), or the host name outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    import socket

    return socket.gethostname()
