"""Stopping a run from the driver. A driver-side callback (``on_driver = True``) that may set
``control.should_training_stop`` declares ``may_stop_training = True``; this callback then runs on every
rank (after the relay on rank 0), and the run follows the driver's decisions:

- at each evaluation, rank 0 waits until the driver has replayed that evaluation to its callbacks and
  recorded its decision on the event channel (``decide_evaluation``, per worker-group attempt), and
  broadcasts it; a stop takes effect right there, before another step, identically on every rank. A
  pruner's or a scheduler's decision after an evaluation therefore costs no extra training step;
- between evaluations (e.g. Ray Tune ending a trial), rank 0 polls the channel's stop flag without
  waiting (at most one request in flight, a new one every ``interval`` seconds); the flag reaches the
  other ranks OR-ed with the other control flags after ``on_step_end``.

Only rank 0 talks to the channel: at 64 workers the driver's actor gets one request per poll, not 64.
"""

from __future__ import annotations

import time

from raytrainer.callbacks import TrainerCallback


class DriverStopCallback(TrainerCallback):
    same_on_every_rank = False  # the polled stop flag reaches ranks at different steps: flags are OR-ed

    def __init__(self, channel, ctx, attempt: int = 0, interval: float = 0.2,
                 decision_timeout: float = 1800.0):
        self.channel = channel  # the rank's ChannelClient
        self.ctx, self.attempt = ctx, attempt
        self.interval = interval
        self.decision_timeout = decision_timeout
        self._pending = None
        self._last = 0.0
        self._stop = False
        self._evaluations = 0

    def _poll(self) -> bool:
        import ray

        if self._pending is not None:
            ready, _ = ray.wait([self._pending], timeout=0)
            if ready:
                self._stop = self._stop or bool(ray.get(self._pending))
                self._pending = None
        now = time.monotonic()
        if self._pending is None and not self._stop and now - self._last >= self.interval:
            self._pending, self._last = self.channel.stop_requested(), now
        return self._stop

    def on_step_end(self, args, state, control, **kwargs):
        if self.ctx.is_world_zero and self._poll():
            control.should_training_stop = True

    def on_evaluate(self, args, state, control, **kwargs):
        self._evaluations += 1
        decision = self._wait_for_decision(state) if self.ctx.is_world_zero else None
        decision = self.ctx.broadcast_object(decision)
        if decision:
            self._stop = True
            control.should_training_stop = True

    def _wait_for_decision(self, state) -> bool:
        deadline = time.monotonic() + self.decision_timeout
        while (decision := self.channel.evaluation_decision(self.attempt, self._evaluations)) is None:
            if time.monotonic() > deadline:  # failing beats ranks deciding differently
                raise TimeoutError(f"no decision from the driver on evaluation {self._evaluations} at step "
                                   f"{state.global_step} within {self.decision_timeout:.0f}s")
            time.sleep(0.02)
        return decision
