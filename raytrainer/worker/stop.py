"""Stopping a run from the driver: a driver-side callback (``on_driver = True``) that may set
``control.should_training_stop`` declares ``may_stop_training = True``; the driver then tells the event
channel, and this callback, on every rank, turns the request into ``should_training_stop``.

The channel is polled without waiting (at most one request in flight, a new one every ``interval``
seconds), and the flag is OR-ed across ranks with the other control flags after ``on_step_end``, so
every rank stops at the same step -- a few steps after the driver asked, not at the end of the run.
"""

from __future__ import annotations

import time

from raytrainer.callbacks import TrainerCallback


class DriverStopCallback(TrainerCallback):
    same_on_every_rank = False  # ranks see the request at different steps: the flags must be OR-ed

    def __init__(self, channel, interval: float = 0.2):
        self.channel = channel  # the Channel actor handle
        self.interval = interval
        self._pending = None
        self._last = 0.0
        self._stop = False

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
        self._poll()  # ask right after an evaluation, when a pruning decision is most likely
