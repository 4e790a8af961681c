"""Callbacks: transformers' own classes, and where each one runs on a Ray run.

`TrainerCallback`, `TrainerState`, `TrainerControl`, `ExportableState`, `DefaultFlowCallback`,
`PrinterCallback` and `EarlyStoppingCallback` are transformers' (`transformers.trainer_callback`), so a
callback from any library built on transformers (TRL's, an integration's, a user's) is one of raytrainer's.
What raytrainer adds, because a run's ranks live in several processes and its console in the driver:

- where a callback runs: `runs_on_driver(cb)` (the progress bar, the printer, transformers' `report_to`
  integrations, any callback with ``on_driver = True``: once, in the driver, fed by the events of world rank
  zero) and `same_on_every_rank(cb)` (its decisions need no agreement across ranks);
- `CallbackHandler.call_event` also takes a mapping of control flags as a callback's return value
  (``{"should_training_stop": True}``), and refuses an unknown flag or a return value of another type
  instead of ignoring it;
- `ProgressCallback` follows ``state.global_step`` when only some step events reach the driver, starts at a
  resumed run's step and writes to ``file``;
- `state_to_dict` / `state_from_dict`: the state as it travels between Ray actors and into checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from typing import Any

import transformers.trainer_callback as hf
from tqdm.auto import tqdm
from transformers.trainer_callback import (
    DefaultFlowCallback,
    EarlyStoppingCallback,
    ExportableState,
    PrinterCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)

from raytrainer.callback_scan import leaves_control_alone

logger = logging.getLogger(__name__)

__all__ = [
    "CallbackHandler",
    "DefaultFlowCallback",
    "EarlyStoppingCallback",
    "ExportableState",
    "PrinterCallback",
    "ProgressCallback",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "runs_on_driver",
    "same_on_every_rank",
    "state_from_dict",
    "state_to_dict",
    "state_to_json",
]

CONTROL_FLAGS = tuple(f.name for f in dataclasses.fields(TrainerControl))
# TrainerCallback's events, each of which does nothing: a callback that does not override one is not called
# for it (an event is dispatched several times per training step).
_BASE_HOOKS = {name: hook for name, hook in vars(TrainerCallback).items() if name.startswith("on_")}


def runs_on_driver(callback) -> bool:
    """Whether ``callback`` runs once, in the driver (``on_driver``; by default transformers' progress,
    printer and ``report_to`` integration callbacks), rather than on every rank."""
    default = (isinstance(callback, (hf.ProgressCallback, PrinterCallback))
               or type(callback).__module__.startswith("transformers.integrations"))
    return bool(getattr(callback, "on_driver", default))


def explicitly_on_driver(callback) -> bool:
    """Whether a hosted trainer's callback runs in the driver: one that says so (``on_driver = True``).
    transformers' ``report_to`` trackers run where transformers runs them, on rank 0; its progress bar and
    printer are the driver's display."""
    return not isinstance(callback, type) and getattr(callback, "on_driver", None) is True


def same_on_every_rank(callback) -> bool:
    """Whether ``callback``'s control decisions are the same on every rank (they need no agreement): a
    callback's own ``same_on_every_rank``, else yes for transformers' flow, early-stopping, progress and
    printer callbacks, for the driver's, and for one whose code never writes a control flag
    (``callback_scan``)."""
    declared = getattr(callback, "same_on_every_rank", None)
    if declared is not None:
        return bool(declared)
    return (isinstance(callback, (DefaultFlowCallback, EarlyStoppingCallback, hf.ProgressCallback,
                                  PrinterCallback))
            or runs_on_driver(callback) or leaves_control_alone(callback))


def state_to_dict(state: TrainerState) -> dict[str, Any]:
    return dataclasses.asdict(state)


def state_to_json(state: TrainerState) -> str:
    """``trainer_state.json``'s text, as transformers' ``TrainerState.save_to_json`` writes it."""
    return json.dumps(state_to_dict(state), indent=2, sort_keys=True) + "\n"


def state_from_dict(data: Mapping[str, Any]) -> TrainerState:
    """A state from ``state_to_dict`` output or a ``trainer_state.json``; unknown keys (from another version
    of transformers) are dropped with a warning."""
    known = {f.name for f in dataclasses.fields(TrainerState)}
    unknown = sorted(set(data) - known)
    if unknown:
        logger.warning("Ignoring unknown TrainerState fields: %s", ", ".join(unknown))
    return TrainerState(**{k: v for k, v in data.items() if k in known})


class CallbackHandler(hf.CallbackHandler):
    """transformers' handler; a callback may also return a mapping of control flags, and a callback that is
    duck-typed (not a `TrainerCallback`) need not define every event."""

    def __init__(self, callbacks, model=None, processing_class=None, optimizer=None, lr_scheduler=None,
                 flow: bool = True):
        # flow=False: a handler that only shows what the workers' handlers did (the driver's display) has no
        # DefaultFlowCallback, about which transformers' handler would warn; give it one, then take it out.
        flow_callback = None if flow else hf.DefaultFlowCallback()
        super().__init__([*callbacks, *filter(None, [flow_callback])], model, processing_class, optimizer,
                         lr_scheduler)
        if flow_callback is not None:
            self.remove_callback(flow_callback)

    def call_event(self, event: str, args, state, control, **kwargs) -> TrainerControl:
        base = _BASE_HOOKS.get(event)
        for callback in self.callbacks:
            hook = getattr(callback, event, None)
            if hook is None or (base is not None and getattr(hook, "__func__", None) is base):
                continue  # not defined, or TrainerCallback's own hook, which does nothing
            result = hook(args, state, control, model=self.model, processing_class=self.processing_class,
                          optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                          train_dataloader=self.train_dataloader, eval_dataloader=self.eval_dataloader,
                          **kwargs)
            if result is None:
                continue
            where = f"{type(callback).__name__}.{event}"
            if isinstance(result, TrainerControl):
                control = result
            elif isinstance(result, Mapping):
                unknown = [name for name in result if name not in CONTROL_FLAGS]
                if unknown:
                    raise ValueError(f"callback {where} returned unknown control flag(s) "
                                     f"{', '.join(map(repr, unknown))}; valid flags: "
                                     f"{', '.join(CONTROL_FLAGS)}")
                for name, value in result.items():
                    setattr(control, name, bool(value))
            else:
                raise TypeError(
                    f"callback {where} returned {type(result).__name__} {result!r}; an event must return "
                    "None, a TrainerControl, or a mapping of control flags such as "
                    "{'should_training_stop': True}")
        return control


class ProgressCallback(hf.ProgressCallback):
    """transformers' progress bar, run in the driver: it follows ``state.global_step`` (only some step events
    are relayed from the workers), starts at a resumed run's step, names a search trial, shows the latest loss
    and learning rate beside the rate, and writes to ``file`` (stderr by default)."""

    def __init__(self, max_str_len: int = 100, file=None):
        super().__init__(max_str_len)
        self.file = file
        self.current_step = 0

    def _advance_to(self, step: int) -> None:
        if self.training_bar is not None and step > self.current_step:
            self.training_bar.update(step - self.current_step)
            self.current_step = step

    def on_train_begin(self, args, state, control, **kwargs):
        self.current_step = state.global_step
        if state.is_world_process_zero:
            self.training_bar = tqdm(total=state.max_steps, initial=state.global_step, dynamic_ncols=True,
                                     file=self.file,
                                     desc=f"trial {state.trial_name}" if state.trial_name else None)

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._advance_to(state.global_step)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if state.is_world_process_zero and hf.has_length(eval_dataloader) and self.prediction_bar is None:
            self.prediction_bar = tqdm(total=len(eval_dataloader), leave=self.training_bar is None,
                                       dynamic_ncols=True, file=self.file)
        super().on_prediction_step(args, state, control, eval_dataloader=eval_dataloader, **kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not (state.is_world_process_zero and self.training_bar is not None and logs):
            return
        if "loss" in logs:
            latest = {k: f"{logs[k]:.4g}" for k in ("loss", "learning_rate")
                      if isinstance(logs.get(k), float)}
            self.training_bar.set_postfix(latest, refresh=False)
        shown = {k: v for k, v in logs.items() if not k.startswith("_")}
        bar, self.training_bar = self.training_bar, _Writer(self.file)
        try:  # transformers' formatting of the line, written under the bar to our file
            super().on_log(args, state, control, logs=shown, **kwargs)
        finally:
            self.training_bar = bar

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None:
            self._advance_to(state.global_step)  # the last step event may not have been relayed
            self.training_bar.close()
            self.training_bar = None


class _Writer:
    """What ProgressCallback.on_log of transformers calls on its bar: ``write``, to a file of ours."""

    def __init__(self, file):
        self.file = file

    def write(self, text: str) -> None:
        tqdm.write(text, file=self.file)
