"""Stopping a run from the driver. A driver-side callback (``on_driver = True``) that may set
``control.should_training_stop`` declares ``may_stop_training = True``; this callback then runs on every
rank (after the relay on rank 0), and the run follows the driver's decisions:

- at each evaluation, every rank waits until the driver has replayed that evaluation to its callbacks
  and recorded its decision on the event channel (``decide_evaluation``); a stop takes effect right
  there, before another step, identically on every rank (they all read the same recorded decision).
  A pruner's or a scheduler's decision after an evaluation therefore costs no extra training step;
- between evaluations (e.g. Ray Tune ending a trial), the channel's stop flag is polled without waiting
  (at most one request in flight, a new one every ``interval`` seconds); ranks may see it at different
  steps, so the flag is OR-ed across ranks with the other control flags after ``on_step_end``.
"""

from __future__ import annotations

import time

from raytrainer.callbacks import TrainerCallback


class DriverStopCallback(TrainerCallback):
    same_on_every_rank = False  # the polled stop flag reaches ranks at different steps: flags are OR-ed

    def __init__(self, channel, interval: float = 0.2, decision_timeout: float = 1800.0):
        self.channel = channel  # the Channel actor handle
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
            self._pending, self._last = self.channel.stop_requested.remote(), now
        return self._stop

    def on_step_end(self, args, state, control, **kwargs):
        if self._poll():
            control.should_training_stop = True

    def on_evaluate(self, args, state, control, **kwargs):
        import ray

        self._evaluations += 1
        deadline = time.monotonic() + self.decision_timeout
        while (decision := ray.get(self.channel.evaluation_decision.remote(self._evaluations))) is None:
            if time.monotonic() > deadline:  # failing beats ranks deciding differently
                raise TimeoutError(f"no decision from the driver on evaluation {self._evaluations} at step "
                                   f"{state.global_step} within {self.decision_timeout:.0f}s")
            time.sleep(0.02)
        if decision:
            self._stop = True
            control.should_training_stop = True
