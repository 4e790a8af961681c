"""Relays world rank 0's callback events to the driver, where display callbacks run.

Step and prediction-step events are throttled (the driver's progress bar needs a few updates a second,
not one per step); every other event is sent as it happens.
"""

from __future__ import annotations

import time

from raytrainer.callbacks import TrainerCallback
from raytrainer.protocol import CallbackEvent, Kind
from raytrainer.trainer_utils import has_length

# what the driver's callbacks read of the state (transformers' trackers: the step, the trial, the steps plan)
_STATE_FIELDS = ("global_step", "max_steps", "epoch", "num_train_epochs", "best_metric", "best_global_step",
                 "best_model_checkpoint", "total_flos", "train_batch_size", "logging_steps", "eval_steps",
                 "save_steps", "is_hyper_param_search", "trial_name", "trial_params")


class RelayCallback(TrainerCallback):
    same_on_every_rank = True  # it only reports

    def __init__(self, channel, interval: float = 0.25):
        self.channel = channel
        self.interval = interval
        self._last = 0.0
        self._eval_batches = 0

    def _send(self, event: str, state, urgent: bool = True, **kwargs) -> None:
        snapshot = {f: getattr(state, f) for f in _STATE_FIELDS}
        self.channel.send(Kind.CALLBACK, CallbackEvent(event, snapshot, kwargs), urgent=urgent)

    def _throttled(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.interval:
            return True
        self._last = now
        return False

    def on_train_begin(self, args, state, control, **kwargs):
        self._send("on_train_begin", state)

    def on_step_end(self, args, state, control, **kwargs):
        if not self._throttled():
            self._send("on_step_end", state, urgent=False)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._send("on_epoch_end", state, urgent=False)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._send("on_log", state, logs=dict(logs or {}))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self._eval_batches = 0
        self._send("on_evaluate", state, metrics=dict(metrics or {}))

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        self._eval_batches = 0
        self._send("on_predict", state, metrics=dict(metrics or {}))

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        self._eval_batches += 1
        if not self._throttled():
            total = len(eval_dataloader) if has_length(eval_dataloader) else None  # a stream: unknown
            self._send("on_prediction_step", state, urgent=False, done=self._eval_batches, total=total)

    def on_save(self, args, state, control, **kwargs):
        self._send("on_save", state)

    def on_train_end(self, args, state, control, **kwargs):
        self._send("on_train_end", state)
