"""What the driver does with the workers' events while a command runs: a pump thread drains the group's
channel a few times a second and hands each event to its handler -- worker log lines are printed, rank 0's
callback events are replayed into the driver's display callbacks, committed checkpoints go to the registry,
pace reports to the straggler watch. No Ray here: the channel is the driver's handle on it
(driver/channel.py's ``RayChannel``, or a test's in-process one)."""

from __future__ import annotations

import logging
import re
import threading
import time

from raytrainer.callbacks import CallbackHandler, TrainerControl, TrainerState
from raytrainer.driver.pace import StragglerWatch
from raytrainer.hosted_callbacks import shown_on_driver
from raytrainer.logging_utils import emit_worker_record, say
from raytrainer.protocol import Attempt, CallbackEvent, Event, Kind

logger = logging.getLogger(__name__)


class _Sized:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


class DriverDisplay:
    """The driver's callbacks (progress bar or printer, any with ``on_driver = True``: ``shown_on_driver``),
    fed by rank 0; transformers' trackers run on rank 0."""

    def __init__(self, trainer):
        callbacks = [cb for cb in trainer.callback_handler.callbacks if shown_on_driver(cb)]
        model = trainer._display_model if hasattr(type(trainer), "_display_model") else trainer.model
        self.handler = CallbackHandler(callbacks, model, trainer.processing_class, None, None, flow=False)
        self.args = trainer.args
        self.state = TrainerState(is_local_process_zero=True, is_world_process_zero=True)
        self.control = TrainerControl()
        self.stragglers = StragglerWatch()
        self._done = 0
        # Callbacks that may stop training decide at each evaluation; the workers wait for the decision.
        self.steers = any(getattr(cb, "may_stop_training", False) for cb in callbacks)

    def replay(self, event: CallbackEvent) -> None:
        for key, value in event.state.items():
            setattr(self.state, key, value)
        if event.name == "on_prediction_step":
            done, total = event.kwargs["done"], event.kwargs["total"]
            self.handler.eval_dataloader = _Sized(total) if total is not None else None
            for _ in range(max(done - self._done, 0)):
                self.handler.call_event(event.name, self.args, self.state, self.control)
            self._done = done
            return
        if event.name in ("on_evaluate", "on_predict"):
            self._done = 0
        self.handler.call_event(event.name, self.args, self.state, self.control, **event.kwargs)


class Pump(threading.Thread):
    """Drains ``channel`` every ``period`` seconds while a command runs, and once more when stopped."""

    def __init__(self, channel, display: DriverDisplay, registry, period: float = 0.1,
                 started_at: float | None = None):
        super().__init__(daemon=True, name="raytrainer-events")
        self.channel, self.display, self.registry, self.period = channel, display, registry, period
        # the start of a new group's workers (None on a warm group): the console says when they are up and
        # when the first step is done, once each
        self.started_at = started_at
        self._first_step_said = started_at is None
        self._stop_event = threading.Event()
        self._stop_sent = False
        self._attempt, self._evaluations = 0, 0
        self.handlers = {
            Kind.LOG: emit_worker_record,
            Kind.CALLBACK: self.display.replay,
            Kind.CHECKPOINT: self.registry.add,
            Kind.CHECKPOINT_PART: self.registry.add_part,
            Kind.PACE: self.display.stragglers.observe,
            Kind.ATTEMPT: self._new_attempt,
        }

    def run(self) -> None:
        while not self._stop_event.wait(self.period):
            self.drain()
        # The last events too, on this thread: the driver's callbacks see a call's events from one thread
        # (a tracker's state may be thread-local: MLflow's active run is).
        self.drain()

    def drain(self) -> None:
        try:
            events = self.channel.drain()
        except Exception as exc:  # the channel died: nothing more will arrive
            logger.debug("event channel unavailable: %s", exc)
            return
        for event in events:
            self.handle(event)
        if self.display.control.should_training_stop and not self._stop_sent:
            # A driver-side callback asked to stop (e.g. a pruned search trial): tell the workers.
            self._stop_sent = True
            self.channel.request_stop()

    def handle(self, event: Event) -> None:
        try:
            self.handlers[event.kind](event.payload)
        except Exception:
            logger.exception("while showing a worker event")
        if not self._first_step_said and event.kind is Kind.CALLBACK and event.payload.name == "on_step_end":
            self._first_step_said = True
            say(f"first step done, {time.time() - self.started_at:.0f} s after the workers' start")
        if event.kind is Kind.CALLBACK and event.payload.name == "on_evaluate" and self.display.steers:
            self._evaluations += 1  # the workers wait for this decision (worker/stop.py)
            stop = bool(self.display.control.should_training_stop)
            self.channel.decide_evaluation(self._attempt, self._evaluations, stop)

    def _new_attempt(self, attempt: Attempt) -> None:
        """A (re)started worker group numbers its evaluations from 1; a restart is said on the console, with
        where training resumes and how many steps it does again."""
        if attempt.number > 0 and not attempt.failed:
            logger.warning(restart_line(attempt, self.display.state.global_step))
        elif attempt.number == 0 and self.started_at is not None:
            count = f"{attempt.world_size} " if attempt.world_size else ""
            say(f"{count}workers up in {time.time() - self.started_at:.0f} s")
        self._attempt, self._evaluations = attempt.number, 0

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def restart_line(attempt: Attempt, reached: int) -> str:
    """What the console says when Ray Train has started a command's worker group again (``reached``: the
    last step the group before reported)."""
    head = (f"restart {attempt.number}: Ray Train started the worker group again after it lost a worker or "
            f"its node (a preempted node's restart does not count against max_failures)")
    before, now = attempt.previous_world_size, attempt.world_size
    if before and now and before != now:
        change = "shrunk" if now < before else "grown"
        head += (f", {change} from {before} to {now} workers (the global batch "
                 f"is kept: the per-device batch and gradient_accumulation_steps follow the world size)")
    if attempt.latest_checkpoint is None:
        return f"{head}; no checkpoint of this call was committed, so the call runs again from its start"
    found = re.search(r"checkpoint-(\d+)/*$", attempt.latest_checkpoint)
    again = "" if found is None else (f"; the group before reached step {reached}: "
                                      f"{max(reached - int(found.group(1)), 0)} step(s) are trained again")
    return f"{head}; resuming from {attempt.latest_checkpoint}{again}"
