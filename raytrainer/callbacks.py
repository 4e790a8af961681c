"""Callbacks: the training state, the control flags, the event hooks and the built-in callbacks.

The names, fields, events and semantics follow the Hugging Face ``Trainer`` callback API, so a callback
written for it works here unchanged. What raytrainer adds:

- ``TrainerControl.update`` and callbacks that return a mapping of flags (``{"should_training_stop": True}``);
  an unknown flag or a return value of the wrong type is an error instead of being silently ignored;
- ``TrainerState.to_dict`` / ``from_dict`` (the state travels between Ray actors and into checkpoints);
- a ``ProgressCallback`` that copes with receiving only some of the step events (in raytrainer it runs in the
  driver, fed by events relayed from the world-rank-zero worker).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

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
]

# Log keys that are bookkeeping, not something to show a person.
_PRIVATE_LOG_KEYS = frozenset({"total_flos"})


def _strategy(value: Any) -> Any:
    """The plain value of a strategy field, whether it is a str-Enum member or a string."""
    return getattr(value, "value", value)


def _has_length(obj: Any) -> bool:
    try:
        return len(obj) is not None
    except (TypeError, AttributeError, NotImplementedError):
        return False


def _format_logs(logs: Mapping[str, Any], max_str_len: int | None = None) -> dict[str, Any]:
    """A display copy of ``logs``: private keys dropped, floats as ``.4g``, long strings replaced."""
    shown: dict[str, Any] = {}
    for key, value in logs.items():
        if key in _PRIVATE_LOG_KEYS or key.startswith("_"):
            continue
        if isinstance(value, float):
            shown[key] = f"{value:.4g}"
        elif max_str_len is not None and isinstance(value, str) and len(value) > max_str_len:
            shown[key] = (
                f"[String too long to display, length: {len(value)} > {max_str_len}. "
                "Consider increasing `max_str_len` if needed.]"
            )
        else:
            shown[key] = value
    return shown


class ExportableState:
    """Mixin for objects whose state is saved in a checkpoint (in ``TrainerState.stateful_callbacks``).

    ``state()`` returns ``{"args": {...}, "attributes": {...}}``: ``args`` are the constructor keyword
    arguments, ``attributes`` what has changed since. Both must be JSON-serialisable. ``from_state``
    rebuilds an instance from that dictionary.
    """

    def state(self) -> dict:
        raise NotImplementedError(f"{type(self).__name__} must implement state() to be saved in a checkpoint")

    @classmethod
    def from_state(cls, state: Mapping[str, Any]):
        instance = cls(**state["args"])
        for name, value in state["attributes"].items():
            setattr(instance, name, value)
        return instance


@dataclass
class TrainerState:
    """The inner state of training, saved in each checkpoint (``trainer_state.json``), given to callbacks.

    A "step" is one optimizer update: with ``gradient_accumulation_steps=n`` one step consumes n batches
    (per rank). ``epoch`` is fractional during training (2.5 = halfway through the third epoch).
    ``logging_steps`` / ``eval_steps`` / ``save_steps`` hold absolute step counts once ``compute_steps``
    has run. ``stateful_callbacks`` maps a callback class name to its ``ExportableState.state()`` (a list
    of them when several instances of one class are attached); a list of callbacks given to the
    constructor is converted to that form.
    """

    epoch: float | None = None
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, str | float | int | bool] | None = None
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.log_history is None:
            self.log_history = []
        if self.stateful_callbacks is None:
            self.stateful_callbacks = {}
        elif not isinstance(self.stateful_callbacks, Mapping):
            self.stateful_callbacks = self._export_callbacks(self.stateful_callbacks)

    @staticmethod
    def _export_callbacks(callbacks) -> dict[str, Any]:
        exported: dict[str, Any] = {}
        for callback in callbacks:
            if not isinstance(callback, ExportableState):
                raise TypeError(
                    f"stateful_callbacks must be ExportableState instances, got {type(callback).__name__}"
                )
            name = type(callback).__name__
            if name not in exported:
                exported[name] = callback.state()
            else:
                if not isinstance(exported[name], list):
                    exported[name] = [exported[name]]
                exported[name].append(callback.state())
        return exported

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainerState:
        """Build a state from ``to_dict()`` output; unknown keys are dropped with a warning."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            logger.warning("Ignoring unknown TrainerState fields: %s", ", ".join(unknown))
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save_to_json(self, json_path) -> None:
        with open(json_path, "w", encoding="utf-8") as f:
            f.write(self.to_json_string())

    @classmethod
    def load_from_json(cls, json_path) -> TrainerState:
        with open(json_path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def compute_steps(self, args, max_steps: int) -> None:
        """Store absolute logging/eval/save steps; a value below 1 is a ratio of ``max_steps``, rounded up."""
        for kind in ("logging", "eval", "save"):
            num_steps = getattr(args, f"{kind}_steps", None)
            if num_steps is None:
                continue
            if num_steps < 1:
                num_steps = math.ceil(max_steps * num_steps)
            setattr(self, f"{kind}_steps", int(num_steps))


@dataclass
class TrainerControl(ExportableState):
    """Switches that callbacks flip to steer the training loop.

    - ``should_training_stop``: stop training; stays set until a new training begins.
    - ``should_epoch_stop``: end the current epoch; reset at the next epoch begin.
    - ``should_save`` / ``should_evaluate`` / ``should_log``: do it at this step; reset at the next step
      begin (and each one once it has been done).
    """

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.should_save = False
        self.should_evaluate = False
        self.should_log = False

    @classmethod
    def flag_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def update(self, flags: Mapping[str, bool]) -> TrainerControl:
        """Set the given flags (all or none: unknown names raise ``ValueError`` before anything changes)."""
        valid = self.flag_names()
        unknown = [name for name in flags if name not in valid]
        if unknown:
            names = ", ".join(repr(name) for name in unknown)
            plural = "s" if len(unknown) > 1 else ""
            raise ValueError(f"unknown control flag{plural} {names}; valid flags: {', '.join(valid)}")
        for name, value in flags.items():
            setattr(self, name, bool(value))
        return self

    def state(self) -> dict:
        return {"args": dataclasses.asdict(self), "attributes": {}}


class TrainerCallback:
    """Base class for objects that watch the training loop at fixed events and may steer it.

    Every event has the signature ``(self, args, state, control, **kwargs)`` and does nothing by default.
    ``args`` is the ``TrainingArguments``, ``state`` the ``TrainerState``, ``control`` the
    ``TrainerControl``. The keyword arguments always include ``model``, ``processing_class``,
    ``optimizer``, ``lr_scheduler``, ``train_dataloader`` and ``eval_dataloader`` (any may be None);
    ``on_evaluate`` and ``on_predict`` also get ``metrics``, ``on_log`` gets ``logs``.

    To steer the loop, change ``control`` and return nothing, return a ``TrainerControl`` (it replaces
    the current one), or return a mapping of flags, e.g. ``{"should_training_stop": True}``.

    Where each event fires (one update step may span several micro-batches with gradient accumulation)::

        on_init_end                              # Trainer constructed
        on_train_begin
        for epoch in range(num_train_epochs):
            on_epoch_begin
            for step in update_steps_of(epoch):
                on_step_begin
                for micro_batch in accumulation_window:
                    forward, backward
                    on_substep_end               # after every micro-batch but the last of the window
                clip gradients
                on_pre_optimizer_step            # gradients final, not yet applied
                optimizer.step()
                on_optimizer_step                # applied, not yet zeroed
                lr_scheduler.step(); zero_grad(); state.global_step += 1
                on_step_end                      # DefaultFlowCallback decides log / evaluate / save here
                if control.should_log:      log(...)            -> on_log
                if control.should_evaluate: evaluate()          -> on_prediction_step per batch,
                                                                   on_log (eval metrics), on_evaluate
                if control.should_save:     save checkpoint     -> on_save
                if control.should_epoch_stop or control.should_training_stop: break
            on_epoch_end                         # also after a break; epoch strategies decide here
            [log / evaluate / save as above]
            if control.should_training_stop: break
        on_train_end

        predict(): on_prediction_step per batch, then on_predict
        push_to_hub(): on_push_begin

    In raytrainer the loop runs inside every Ray Train worker, so callbacks fire on every rank: use
    ``state.is_world_process_zero`` (or ``is_local_process_zero``) to act once. Display callbacks such as
    ``ProgressCallback`` run in the driver on relayed events, which may skip steps.

    ``on_driver = True`` makes a callback run in the driver's process instead of on the workers: it sees
    world rank 0's events (throttled for steps) and cannot steer training. Set it on callbacks that only
    display or record, to have their effects in the driver's process. The one exception: a driver-side
    callback that also sets ``may_stop_training = True`` may set ``control.should_training_stop``; the
    workers then wait for the driver's decision after each evaluation and stop at that step (see
    ``raytrainer/worker/stop.py``; hyperparameter-search pruning uses it).
    """

    on_driver: bool = False
    #: True when the callback's decisions depend only on what every rank shares (global_step, epoch,
    #: args, broadcast eval metrics). When every callback says so, ranks cannot disagree and raytrainer
    #: skips the per-step all-reduce of the control flags; any other callback turns it on.
    same_on_every_rank: bool = False

    def on_init_end(self, args, state, control, **kwargs):
        """The Trainer has been constructed."""

    def on_train_begin(self, args, state, control, **kwargs):
        """Training begins (after a checkpoint to resume from, if any, has been loaded)."""

    def on_train_end(self, args, state, control, **kwargs):
        """Training has ended."""

    def on_epoch_begin(self, args, state, control, **kwargs):
        """An epoch begins."""

    def on_epoch_end(self, args, state, control, **kwargs):
        """An epoch has ended (or was cut short by ``should_epoch_stop`` / ``should_training_stop``)."""

    def on_step_begin(self, args, state, control, **kwargs):
        """An update step begins (it may take several micro-batches with gradient accumulation)."""

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        """Gradients are accumulated and clipped; the optimizer has not stepped yet."""

    def on_optimizer_step(self, args, state, control, **kwargs):
        """The optimizer has stepped; gradients are not zeroed yet."""

    def on_substep_end(self, args, state, control, **kwargs):
        """A micro-batch of a gradient-accumulation window (not its last) has been processed."""

    def on_step_end(self, args, state, control, **kwargs):
        """An update step has ended; ``state.global_step`` counts it."""

    def on_evaluate(self, args, state, control, **kwargs):
        """An evaluation has finished; its results are in ``kwargs["metrics"]``."""

    def on_predict(self, args, state, control, **kwargs):
        """A prediction run has finished; its metrics are in ``kwargs["metrics"]``."""

    def on_save(self, args, state, control, **kwargs):
        """A checkpoint has been saved."""

    def on_log(self, args, state, control, **kwargs):
        """``kwargs["logs"]`` have just been logged."""

    def on_prediction_step(self, args, state, control, **kwargs):
        """One batch of evaluation or prediction has been processed."""

    def on_push_begin(self, args, state, control, **kwargs):
        """A push to the hub is about to start."""


class CallbackHandler(TrainerCallback):
    """Calls its callbacks in order for each event and folds what they return into the control."""

    def __init__(self, callbacks, model=None, processing_class=None, optimizer=None, lr_scheduler=None):
        self.callbacks: list[TrainerCallback] = []
        for callback in callbacks or ():
            self.add_callback(callback)
        self.model = model
        self.processing_class = processing_class
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.train_dataloader = None
        self.eval_dataloader = None

    def add_callback(self, callback) -> None:
        """Add a callback instance, or a callback class (instantiated with no arguments)."""
        instance = callback() if isinstance(callback, type) else callback
        cls = type(instance)
        if any(type(existing) is cls for existing in self.callbacks):
            # transformers' warning, on its logger (see worker/console.py)
            logging.getLogger("transformers.trainer_callback").warning(
                f"You are adding a {cls} to the callbacks of this Trainer, but there is already one. "
                f"The currentlist of callbacks is\n:{self.callback_list}"
            )
        self.callbacks.append(instance)

    def pop_callback(self, callback):
        """Remove and return the first callback that is ``callback`` (or an instance of it), else None."""
        for existing in self.callbacks:
            if (isinstance(callback, type) and isinstance(existing, callback)) or existing is callback:
                self.callbacks.remove(existing)
                return existing
        return None

    def remove_callback(self, callback) -> None:
        """Remove the first callback that is ``callback`` (or an instance of it); ValueError if absent."""
        if self.pop_callback(callback) is None:
            name = callback.__name__ if isinstance(callback, type) else type(callback).__name__
            raise ValueError(f"{name} is not among the callbacks:\n{self.callback_list}")

    @property
    def callback_list(self) -> str:
        return "\n".join(type(cb).__name__ for cb in self.callbacks)

    def on_init_end(self, args, state, control, **kwargs):
        return self.call_event("on_init_end", args, state, control, **kwargs)

    def on_train_begin(self, args, state, control, **kwargs):
        control._new_training()
        return self.call_event("on_train_begin", args, state, control, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        return self.call_event("on_train_end", args, state, control, **kwargs)

    def on_epoch_begin(self, args, state, control, **kwargs):
        control._new_epoch()
        return self.call_event("on_epoch_begin", args, state, control, **kwargs)

    def on_epoch_end(self, args, state, control, **kwargs):
        return self.call_event("on_epoch_end", args, state, control, **kwargs)

    def on_step_begin(self, args, state, control, **kwargs):
        control._new_step()
        return self.call_event("on_step_begin", args, state, control, **kwargs)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        return self.call_event("on_pre_optimizer_step", args, state, control, **kwargs)

    def on_optimizer_step(self, args, state, control, **kwargs):
        return self.call_event("on_optimizer_step", args, state, control, **kwargs)

    def on_substep_end(self, args, state, control, **kwargs):
        return self.call_event("on_substep_end", args, state, control, **kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        return self.call_event("on_step_end", args, state, control, **kwargs)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        control.should_evaluate = False
        return self.call_event("on_evaluate", args, state, control, metrics=metrics, **kwargs)

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        return self.call_event("on_predict", args, state, control, metrics=metrics, **kwargs)

    def on_save(self, args, state, control, **kwargs):
        control.should_save = False
        return self.call_event("on_save", args, state, control, **kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        control.should_log = False
        return self.call_event("on_log", args, state, control, logs=logs, **kwargs)

    def on_prediction_step(self, args, state, control, **kwargs):
        return self.call_event("on_prediction_step", args, state, control, **kwargs)

    def on_push_begin(self, args, state, control, **kwargs):
        return self.call_event("on_push_begin", args, state, control, **kwargs)

    def call_event(self, event: str, args, state, control, **kwargs) -> TrainerControl:
        """Call ``event`` on every callback in order and return the resulting control.

        A callback may return None (control kept, possibly changed in place), a ``TrainerControl`` (it
        replaces the control) or a mapping of flag names to booleans (applied with ``control.update``).
        """
        for callback in self.callbacks:
            hook = getattr(callback, event, None)
            if hook is None:  # duck-typed callbacks need not define every event
                continue
            result = hook(
                args,
                state,
                control,
                model=self.model,
                processing_class=self.processing_class,
                optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler,
                train_dataloader=self.train_dataloader,
                eval_dataloader=self.eval_dataloader,
                **kwargs,
            )
            if result is None:
                continue
            where = f"{type(callback).__name__}.{event}"
            if isinstance(result, TrainerControl):
                control = result
            elif isinstance(result, Mapping):
                try:
                    control.update(result)
                except ValueError as err:
                    raise ValueError(f"callback {where} returned {err}") from None
            else:
                raise TypeError(
                    f"callback {where} returned {type(result).__name__} {result!r}; an event must return "
                    "None, a TrainerControl, or a mapping of control flags such as "
                    "{'should_training_stop': True}"
                )
        return control


class DefaultFlowCallback(TrainerCallback):
    """Decides when to log, evaluate and save from the ``*_strategy`` / ``*_steps`` arguments, and stops
    training at ``state.max_steps``.

    Reads ``args.logging_first_step``, ``logging_strategy``, ``eval_strategy``, ``eval_delay`` and
    ``save_strategy``, and the absolute ``state.logging_steps`` / ``eval_steps`` / ``save_steps``.
    """

    same_on_every_rank = True

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        logging_strategy = _strategy(args.logging_strategy)
        eval_strategy = _strategy(args.eval_strategy)
        save_strategy = _strategy(args.save_strategy)
        eval_due = eval_strategy == "steps" and args.eval_delay <= step

        if step == 1 and args.logging_first_step:
            control.should_log = True
        if logging_strategy == "steps" and state.logging_steps > 0 and step % state.logging_steps == 0:
            control.should_log = True

        on_eval_step = state.eval_steps > 0 and step % state.eval_steps == 0
        if eval_due and on_eval_step:
            control.should_evaluate = True

        if save_strategy == "steps" and state.save_steps > 0 and step % state.save_steps == 0:
            control.should_save = True

        if step >= state.max_steps:
            control.should_training_stop = True
            # Finish on an evaluated and saved step when those are step-based; epoch-based ones are
            # decided in on_epoch_end, which the loop fires after stopping too.
            if eval_due:
                control.should_evaluate = True
            if save_strategy == "steps":
                control.should_save = True
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if _strategy(args.logging_strategy) == "epoch":
            control.should_log = True
        if _strategy(args.eval_strategy) == "epoch" and args.eval_delay <= state.epoch:
            control.should_evaluate = True
        if _strategy(args.save_strategy) == "epoch":
            control.should_save = True
        return control


class ProgressCallback(TrainerCallback):
    """Shows a tqdm bar for training (and one for evaluation/prediction batches) and writes logs under it.

    Only acts where ``state.is_world_process_zero``. The bar follows ``state.global_step``, not the number
    of events, so it stays right when only some step events arrive (raytrainer relays throttled step
    events from the workers to the driver, where this callback runs). ``file`` is where the bars and
    logs go (stderr by default).
    """

    same_on_every_rank = True

    on_driver = True

    def __init__(self, max_str_len: int = 100, file=None):
        self.max_str_len = max_str_len
        self.file = file
        self.training_bar = None
        self.prediction_bar = None
        self.current_step = 0

    def _advance_to(self, step: int) -> None:
        if self.training_bar is not None and step > self.current_step:
            self.training_bar.update(step - self.current_step)
            self.current_step = step

    def on_train_begin(self, args, state, control, **kwargs):
        self.current_step = state.global_step  # a resumed run starts part-way
        if state.is_world_process_zero:
            self.training_bar = tqdm(
                total=state.max_steps, initial=state.global_step, dynamic_ncols=True, file=self.file,
                desc=f"trial {state.trial_name}" if state.trial_name else None,
            )

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._advance_to(state.global_step)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if state.is_world_process_zero and _has_length(eval_dataloader):
            if self.prediction_bar is None:
                self.prediction_bar = tqdm(
                    total=len(eval_dataloader),
                    leave=self.training_bar is None,
                    dynamic_ncols=True,
                    file=self.file,
                )
            self.prediction_bar.update(1)

    def _close_prediction_bar(self) -> None:
        if self.prediction_bar is not None:
            self.prediction_bar.close()
            self.prediction_bar = None

    def on_evaluate(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._close_prediction_bar()

    def on_predict(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._close_prediction_bar()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs:
            if "loss" in logs:  # beside steps/s and the ETA: the latest loss and learning rate
                shown = {k: f"{logs[k]:.4g}" for k in ("loss", "learning_rate")
                         if isinstance(logs.get(k), float)}
                self.training_bar.set_postfix(shown, refresh=False)
            tqdm.write(str(_format_logs(logs, self.max_str_len)), file=self.file)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None:
            self._advance_to(state.global_step)  # the last step event may not have been relayed
            self.training_bar.close()
            self.training_bar = None


class PrinterCallback(TrainerCallback):
    """Prints each log dict (without bookkeeping keys such as ``total_flos``) on local process zero."""

    same_on_every_rank = True

    on_driver = True

    def __init__(self, file=None):
        self.file = file

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_local_process_zero and logs is not None:
            print(_format_logs(logs), file=self.file)


class EarlyStoppingCallback(TrainerCallback, ExportableState):
    """Stops training when ``args.metric_for_best_model`` has not improved for ``early_stopping_patience``
    evaluations in a row.

    "Improved" means better than ``state.best_metric`` (in the direction of ``args.greater_is_better``) by
    more than ``early_stopping_threshold``. The Trainer updates ``state.best_metric`` after each evaluation,
    so this callback compares each new evaluation with the best of the previous ones. Needs an
    ``eval_strategy`` other than "no".
    """

    same_on_every_rank = True

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float | None = 0.0):
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold or 0.0
        # Number of evaluations in a row that did not improve on the best metric.
        self.early_stopping_patience_counter = 0

    @staticmethod
    def _greater_is_better(args) -> bool:
        greater = getattr(args, "greater_is_better", None)
        if greater is None:  # the TrainingArguments default: losses go down, other metrics go up
            return not args.metric_for_best_model.endswith("loss")
        return bool(greater)

    def check_metric_value(self, args, state, control, metric_value) -> None:
        best = state.best_metric
        if best is None:
            improved = True
        else:
            better = metric_value > best if self._greater_is_better(args) else metric_value < best
            improved = better and abs(metric_value - best) > self.early_stopping_threshold
        self.early_stopping_patience_counter = 0 if improved else self.early_stopping_patience_counter + 1

    def on_train_begin(self, args, state, control, **kwargs):
        if getattr(args, "metric_for_best_model", None) is None:
            raise ValueError(
                "EarlyStoppingCallback needs a metric to watch, but metric_for_best_model is not set. "
                "Set it in TrainingArguments, e.g. metric_for_best_model='eval_loss' "
                "(with load_best_model_at_end=True to get the best model back at the end)."
            )
        if _strategy(args.eval_strategy) == "no":
            raise ValueError(
                "EarlyStoppingCallback needs evaluations, but eval_strategy is 'no'. "
                "Set eval_strategy='steps' (with eval_steps) or eval_strategy='epoch' in TrainingArguments."
            )
        if not getattr(args, "load_best_model_at_end", False):
            logger.warning(
                "EarlyStoppingCallback is used without load_best_model_at_end=True: after training stops, "
                "the model is the last one trained, not the best one."
            )

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metric_name = args.metric_for_best_model
        if not metric_name.startswith("eval_"):
            metric_name = f"eval_{metric_name}"
        metric_value = (metrics or {}).get(metric_name)
        if metric_value is None:
            logger.warning(
                "EarlyStoppingCallback: metric %r is not among the evaluation metrics (%s); "
                "early stopping is skipped for this evaluation",
                metric_name,
                ", ".join(sorted(metrics or {})),
            )
            return None
        self.check_metric_value(args, state, control, metric_value)
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True
        return None

    def state(self) -> dict:
        return {
            "args": {
                "early_stopping_patience": self.early_stopping_patience,
                "early_stopping_threshold": self.early_stopping_threshold,
            },
            "attributes": {"early_stopping_patience_counter": self.early_stopping_patience_counter},
        }
