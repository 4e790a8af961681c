"""What both search backends share: ``BestRun``, the default search spaces and objective, turning a trial's
hyperparameters into TrainingArguments, the picklability preflight, and running one trial.

A trial is a copy of the user's Trainer with the trial's arguments (``output_dir/run-<trial id>``). With
``num_workers > 0`` its model is built by ``model_init(trial)`` on each of the trial's workers, as in any
run with ``model_init``: no trial's weights are built on, or cross, the process that holds the trial (the
search driver for Optuna, the Tune trial actor for Ray Tune). The workers get a picklable stand-in for the
trial (``worker_trial``): Tune's config dict as it is, an Optuna trial as a ``FixedTrial`` of its
parameters. With ``num_workers=0`` the model is built in this process with the live trial. The copy's
``train()`` is an ordinary raytrainer run (on the search's pooled workers). A driver-side ``TrialReporter``
(``on_driver = True``) sees each evaluation's metrics, reports the objective to the backend and, when
the backend prunes the trial, asks the workers to stop (``may_stop_training``, see worker/stop.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import inspect
import json
import logging
import os
import posixpath
import sys
import threading
from collections.abc import Callable
from typing import Any

import cloudpickle
from transformers.trainer_utils import (  # noqa: F401  (transformers' defaults, used from here)
    default_compute_objective,
    default_hp_space_optuna,
    default_hp_space_ray,
)

from raytrainer.callbacks import CallbackHandler, TrainerCallback, TrainerControl, TrainerState
from raytrainer.deps import require
from raytrainer.integrations import for_trial, is_tracker
from raytrainer.storage import join_uri
from raytrainer.trainer_utils import BestRun  # noqa: F401  (the backends import it from here)

logger = logging.getLogger(__name__)

SUMMARY_NAME = "trial_summary.json"
_MODEL_INIT_LOCK = threading.Lock()  # seeding + model_init touch global RNGs: one trial at a time


@dataclasses.dataclass
class TrialSummary:
    """One trial's run: where it wrote, its best committed checkpoint, what its evaluations said."""

    trial_id: str
    output_dir: str
    hyperparameters: dict[str, Any]
    objective: float | list[float] | None = None
    best_checkpoint: str | None = None  # state.best_model_checkpoint, else the latest committed one
    checkpoints: list[str] = dataclasses.field(default_factory=list)
    evaluations: list[dict] = dataclasses.field(default_factory=list)  # each: step, objective, metrics
    global_step: int = 0
    pruned: bool = False  # stopped early by the search: an Optuna pruner, or a Tune scheduler ending it

    def save(self) -> None:
        os.makedirs(self.output_dir, exist_ok=True)
        with open(os.path.join(self.output_dir, SUMMARY_NAME), "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=2, default=str)

    @classmethod
    def load(cls, output_dir: str) -> TrialSummary | None:
        path = os.path.join(output_dir, SUMMARY_NAME)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return cls(**json.load(f))


def pick_backend(backend: str | None) -> str:
    """HF's choice: the backend asked for, else optuna when installed, else Ray Tune."""
    if backend is None:
        try:
            import optuna  # noqa: F401

            return "optuna"
        except ImportError:
            name = "ray"
    else:
        name = getattr(backend, "value", backend)
        if name not in ("optuna", "ray"):
            raise ValueError(f"backend={backend!r}: raytrainer searches with backend='optuna' or 'ray'.")
    require("optuna" if name == "optuna" else "ray.tune", f"hyperparameter_search(backend={name!r})")
    return name


# -- checks on the driver --------------------------------------------------------------------------------
def check_search(trainer, direction) -> None:
    if trainer.model_init is None:
        raise RuntimeError(
            "hyperparameter_search needs a model_init: pass `model_init=` (a function returning a fresh "
            "model, taking no argument or the trial) to Trainer instead of `model=`.")
    if trainer.optimizer is not None or trainer.lr_scheduler is not None:
        raise RuntimeError("hyperparameter_search cannot reuse `optimizers=`: each trial builds its own "
                           "optimizer for its own model. Use optimizer_cls_and_kwargs or override "
                           "create_optimizer.")
    for d in direction if isinstance(direction, list) else [direction]:
        if d not in ("minimize", "maximize"):
            raise ValueError(f"direction={d!r}: use 'minimize' or 'maximize' (or a list of them).")


def check_picklable(trainer, **extra) -> None:
    """Everything a trial ships to Ray must pickle; the error names the first object that does not."""
    objects = {}
    if not is_hosted(trainer):  # a hosted trainer's recipe pickled its constructor's objects already
        objects = {"model_init": trainer.model_init, "compute_metrics": trainer.compute_metrics,
                   "train_dataset": trainer.train_dataset, "eval_dataset": trainer.eval_dataset,
                   "data_collator": trainer.data_collator, "compute_loss_func": trainer.compute_loss_func,
                   "preprocess_logits_for_metrics": trainer.preprocess_logits_for_metrics}
    objects.update(extra)
    for cb in trainer.callback_handler.callbacks:
        if not is_tracker(cb):  # a tracker stays in this process: each trial builds its own (for_trial)
            objects[f"callback {type(cb).__name__}"] = cb
    for name, value in objects.items():
        if value is None:
            continue
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            described = getattr(value, "__qualname__", None) or type(value).__name__
            raise ValueError(
                f"hyperparameter_search: {name} ({described}) cannot be pickled, so it cannot reach the "
                f"trials' Ray workers ({type(exc).__name__}: {exc}). Define it at module level and keep "
                "locks, open files, sockets and generators out of it (build them inside model_init)."
            ) from exc


# -- hyperparameters -> arguments ---------------------------------------------------------------------------
def model_init_takes_trial(trainer) -> bool:
    return len(inspect.signature(trainer.model_init).parameters) == 1


def split_hyperparameters(trainer, params: dict[str, Any], warn: bool = True):
    """(TrainingArguments values, the other hyperparameters). The others reach model_init through the
    trial and are reported; names that nothing can use get a warning that names them."""
    fields = {f.name for f in dataclasses.fields(trainer.args) if f.init}
    arg_values = {k: v for k, v in params.items() if k in fields}
    others = {k: v for k, v in params.items() if k not in fields}
    if warn and others:
        hints = {k: difflib.get_close_matches(k, sorted(fields), n=1, cutoff=0.8) for k in others}
        hinted = ", ".join(f"{k!r} (did you mean {m[0]!r}?)" for k, m in hints.items() if m)
        if not model_init_takes_trial(trainer):
            logger.warning(
                "hyperparameters %s are not TrainingArguments fields and model_init takes no trial "
                "argument, so nothing uses them; give model_init a `trial` parameter to read them.%s",
                sorted(others), f" Possible typos: {hinted}." if hinted else "")
        elif hinted:
            logger.warning("hyperparameters %s go to model_init (they are not TrainingArguments fields); "
                           "possible typos: %s.", sorted(others), hinted)
    return arg_values, others


def trial_args(args, values: dict[str, Any], trial_id: str):
    """The trial's TrainingArguments: the trial's values (cast to each field's type, as HF does), output
    under ``output_dir/run-<trial id>`` (and ``storage_path/run-<trial id>``), validated again."""
    cast = {}
    for key, value in values.items():
        old = getattr(args, key)
        if isinstance(old, bool) or old is None or value is None:
            cast[key] = value
        elif isinstance(old, (int, float, str)):
            cast[key] = type(old)(value)
        else:
            cast[key] = value
    name = f"run-{trial_id}"
    cast["output_dir"] = os.path.join(os.path.abspath(args.output_dir), name)
    if args.storage_path:
        cast["storage_path"] = join_uri(args.storage_path, name)
    with _accelerator_state_kept():
        return dataclasses.replace(args, **cast)


@contextlib.contextmanager
def _accelerator_state_kept():
    """transformers' arguments reset this process's accelerator state when made (``_setup_devices``), which
    a trainer of this process training now (a Ray Tune trial's, whose summary is written at each evaluation)
    or later (the search's caller) reads: kept as it was (accelerate's states share one dict each)."""
    from accelerate.state import AcceleratorState, PartialState

    kept = [(cls._shared_state, dict(cls._shared_state)) for cls in (PartialState, AcceleratorState)]
    try:
        yield
    finally:
        for shared, before in kept:
            if before:
                shared.clear()
                shared.update(before)


# -- one trial ----------------------------------------------------------------------------------------------
class TrialReporter(TrainerCallback):
    """Runs on the driver of a trial's run: each evaluation's objective goes to ``report(step, objective,
    metrics)``; when that returns True (prune), training stops on every worker within a few steps.

    ``stop_at_the_end_prunes``: whether a stop at the run's last step marks the trial pruned. An Optuna
    pruner's verdict there does (transformers raises ``TrialPruned`` after any evaluation); a Tune scheduler's
    STOP there is its way of saying the trial reached ``max_t``, and the trial ran to its end."""

    on_driver = True
    may_stop_training = True
    same_on_every_rank = True

    def __init__(self, compute_objective: Callable, report: Callable | None,
                 stop_at_the_end_prunes: bool = True):
        self.compute_objective, self.report = compute_objective, report
        self.stop_at_the_end_prunes = stop_at_the_end_prunes
        self.evaluations: list[dict] = []
        self.pruned = False
        self._control = None  # the run's control on the driver, once training has begun
        self._stop_asked = False
        self._at_the_end = False  # the last evaluation was at the run's last step

    def __getstate__(self):  # workers get a hollow copy (they drop driver-side callbacks anyway)
        return {"compute_objective": None, "report": None, "evaluations": [], "pruned": False,
                "stop_at_the_end_prunes": self.stop_at_the_end_prunes, "_control": None, "_stop_asked": False,
                "_at_the_end": False}

    def stop(self) -> None:
        """Stop the run now (from any thread of the trial's driver), as when the trial is pruned."""
        self._stop_asked = True
        self.pruned = self.pruned or self.stop_at_the_end_prunes or not self._at_the_end
        if self._control is not None:
            self._control.should_training_stop = True

    def on_train_begin(self, args, state, control, **kwargs):
        self._control = control
        if self._stop_asked:
            control.should_training_stop = True

    def on_step_end(self, args, state, control, **kwargs):
        self.on_train_begin(args, state, control)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics = {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float))}
        objective = self.compute_objective(dict(metrics))
        self.evaluations.append({"step": state.global_step, "objective": objective, "metrics": metrics})
        self._at_the_end = bool(state.max_steps) and state.global_step >= state.max_steps
        if self.report is not None and not self.pruned and self.report(state.global_step, objective, metrics):
            self.pruned = self.stop_at_the_end_prunes or not self._at_the_end
            control.should_training_stop = True


class EvaluateAtTheEnd(TrainerCallback):
    """A trial that has not evaluated by its last step evaluates there, on its workers: its objective is the
    last evaluation's, and HF evaluates once after ``train()`` when training never did. Here the trained
    model stays where it is instead of coming back to the driver to be shipped out again."""

    same_on_every_rank = True  # global_step, max_steps and the evaluations are the same on every rank

    def __init__(self):
        self.evaluated = False

    def on_evaluate(self, args, state, control, **kwargs):
        self.evaluated = True

    def on_step_end(self, args, state, control, **kwargs):
        if not self.evaluated and state.max_steps and state.global_step >= state.max_steps:
            control.should_evaluate = True


def worker_trial(trial, trainer=None):
    """The trial as ``model_init(trial)`` gets it on the workers, picklable: Tune's config dict as it is;
    a live Optuna trial (it holds its study's storage) as a ``FixedTrial`` of the parameters suggested
    (by ``hp_space``, and by ``trainer``'s ``model_init``), whose ``params``, ``number`` and ``suggest_*``
    of those names answer as the live trial's do."""
    optuna = sys.modules.get("optuna")
    if optuna is None or not isinstance(trial, optuna.trial.Trial):
        return trial
    from raytrainer.search.suggested_trial import SuggestedTrial

    if trainer is not None and trainer.model_init is not None and _takes_the_trial(trainer.model_init):
        _suggest_as_model_init_does(trainer, trial)
    return SuggestedTrial(dict(trial.params), trial.number)


def _takes_the_trial(model_init) -> bool:
    import inspect

    return len(inspect.signature(model_init).parameters) == 1


def _suggest_as_model_init_does(trainer, trial) -> None:
    """transformers' own tests and some scripts suggest inside ``model_init`` (their ``hp_space`` returns
    ``{}``). Run it once here, on the meta device (no weights; random state put back), with the live trial,
    so that Optuna records those suggestions and the workers' trial answers them. A ``model_init`` that
    cannot run on the meta device (``from_pretrained``) has made its suggestions before it fails, if any."""
    from raytrainer.meta_model import build_on_meta

    with _MODEL_INIT_LOCK:
        build_on_meta(lambda: trainer.call_model_init(trial))


def build_model(trainer, trial, seed: int):
    """model_init(trial) under the trial's seed (HF seeds before model_init), without disturbing the
    caller's random state."""
    import torch

    from raytrainer.trainer_utils import set_seed

    with _MODEL_INIT_LOCK, torch.random.fork_rng():
        set_seed(seed)
        return trainer.call_model_init(trial)


def trial_trainer(trainer, args, model, reporter: TrialReporter):
    """A copy of ``trainer`` for one trial: its arguments, its model, its own callbacks and state.

    ``model=None``: the trial's workers build it with ``model_init``; the copy keeps the caller's instance
    (HF's ``model_init()`` one, from ``Trainer.__init__``) for the driver's checks only -- it never trains."""
    from raytrainer import data as rdata

    t = copy.copy(trainer)
    t.args = args
    if model is not None:
        t.model = t.model_wrapped = model
        t.model_init = None  # the model is built already, with the trial; the workers must not rebuild it
    model = t.model
    t.optimizer = t.lr_scheduler = None
    t.label_names = args.label_names or rdata.default_label_names(model)
    t.can_return_loss = t.label_names == [] or "return_loss" in inspect.signature(model.forward).parameters
    callbacks = [c for c in trainer.callback_handler.callbacks if not isinstance(c, TrialReporter)]
    # the trackers: a new instance each (a tracker run per trial), told of the trial's Trainer as
    # transformers' Trainer.__init__ tells them (on_init_end); the other callbacks: a copy each
    trackers = {id(c): for_trial(c, args) for c in callbacks}
    t.callback_handler = CallbackHandler(
        [trackers[id(c)] or copy.deepcopy(c) for c in callbacks] + [EvaluateAtTheEnd(), reporter], model,
        t.processing_class)
    t.state = TrainerState(is_local_process_zero=True, is_world_process_zero=True)
    t.control = TrainerControl()
    for tracker in filter(None, trackers.values()):
        tracker.on_init_end(args, t.state, t.control, model=model, processing_class=t.processing_class)
    t._session = None
    for name in ("_loss_kwargs_cache", "_compute_loss_num_items", "_num_params", "_group"):
        t.__dict__.pop(name, None)  # the trial's worker group comes from the search's pool (run_trial)
    return t


def run_trial(trainer, trial, trial_id: str, params: dict[str, Any], compute_objective: Callable,
              report: Callable | None = None, reporter: TrialReporter | None = None,
              resume_from_checkpoint: str | None = None, pool=None) -> TrialSummary:
    """Train one trial on Ray workers -- a live group borrowed from ``pool`` (the search's), else a group of
    its own closed at the trial's end; the objective is the last evaluation's (HF's rule), from an extra
    evaluate() when training never evaluated."""
    arg_values, _ = split_hyperparameters(trainer, params, warn=False)
    args = trial_args(trainer.args, arg_values, trial_id)
    reporter = reporter or TrialReporter(compute_objective, report)
    if hasattr(trainer, "for_trial"):  # a hosted trainer, or raytrainer's Trainer on transformers' loop
        return run_hosted_trial(trainer, trial, trial_id, params, args, reporter, resume_from_checkpoint,
                                pool)
    on_workers = bool(args.num_workers)  # the workers build the model (model_init with worker_trial)
    t = trial_trainer(trainer, args, None if on_workers else build_model(trainer, trial, args.seed), reporter)
    t._search_trial = (str(trial_id), _plain(params))  # the run's state.trial_name / trial_params
    logger.info("trial %s: %s -> %s", trial_id, params, args.output_dir)
    # a PBT exploit: another trial's checkpoint, this trial's (mutated) learning_rate and weight_decay
    t._resume_with_new_hyperparameters = resume_from_checkpoint is not None
    if pool is not None and on_workers:
        pool.lend(t)
    try:
        t.train(resume_from_checkpoint=resume_from_checkpoint,
                trial=worker_trial(trial, trainer) if on_workers else None)
        # the trained weights stay in storage: t.model is the caller's instance, never to be filled with them
        trained = t.__dict__.pop("_pending_weights", None) if on_workers else None
        if not reporter.evaluations and not reporter.pruned:
            # a callback stopped training before EvaluateAtTheEnd's last step: evaluate the final weights
            if trained is not None:
                t.model = t.model_wrapped = build_model(trainer, trial, args.seed)
                trained(t.model)
            t.evaluate()
    finally:
        if pool is not None and on_workers:
            pool.take_back(t)
        else:
            t.close()
    return summarize(trial_id, params, args, reporter, t.state)


def run_hosted_trial(trainer, trial, trial_id: str, params: dict[str, Any], args, reporter: TrialReporter,
                     resume_from_checkpoint: str | None, pool) -> TrialSummary:
    """One trial of a hosted trainer (raytrainer/hosted.py): its copy with the trial's arguments trains on a
    pooled group, transformers' loop on each rank building the model with ``model_init(trial)``; the
    driver's ``reporter`` prunes it. A trial that never evaluated evaluates its trained model where it is.
    raytrainer's Trainer in this process (raytrainer/one_loop.py) runs its trials here the same way."""
    t = trainer.for_trial(args, [reporter])
    # a PBT exploit: another trial's checkpoint, this trial's (mutated) learning_rate and weight_decay
    t._resume_with_new_hyperparameters = resume_from_checkpoint is not None
    logger.info("trial %s: %s -> %s", trial_id, params, args.output_dir)
    if pool is not None:
        pool.lend(t)
    try:
        # on Ray workers, model_init gets the trial's values (worker_trial); in this process, the live trial
        t.train(resume_from_checkpoint=resume_from_checkpoint,
                trial=worker_trial(trial, trainer) if is_hosted(t) else trial)
        if not reporter.evaluations and not reporter.pruned:
            t.evaluate()
    finally:
        if pool is not None:
            pool.take_back(t)
        elif is_hosted(t):
            t.close()
    return summarize(trial_id, params, args, reporter, t.state)


def summarize(trial_id, params: dict[str, Any], args, reporter: TrialReporter, state) -> TrialSummary:
    """The trial's summary (saved in its output_dir): its evaluations, objective, committed checkpoints."""
    last = reporter.evaluations[-1] if reporter.evaluations else None
    summary = TrialSummary(
        trial_id=str(trial_id), output_dir=args.output_dir, hyperparameters=_plain(params),
        objective=last["objective"] if last else None, evaluations=reporter.evaluations,
        global_step=state.global_step, pruned=reporter.pruned)
    fill_checkpoints(summary, args, state.best_model_checkpoint)
    summary.save()
    return summary


def is_hosted(trainer) -> bool:
    """A hosted trainer's driver side (raytrainer/hosted.py): its constructor's objects already pickled."""
    return hasattr(type(trainer), "hosted_class")


def fill_checkpoints(summary: TrialSummary, args, best: str | None = None) -> None:
    from raytrainer.checkpoint import committed_checkpoints
    from raytrainer.storage import Storage, uri_basename

    storage = Storage.for_run(args)
    summary.checkpoints = [storage.uri_of(posixpath.basename(path))
                           for _, path in committed_checkpoints(storage, warn=False)]
    if best and any(uri_basename(best) == uri_basename(p) for p in summary.checkpoints):
        summary.best_checkpoint = best
    elif summary.checkpoints:
        summary.best_checkpoint = summary.checkpoints[-1]


def _plain(params: dict[str, Any]) -> dict[str, Any]:
    """Hyperparameter values as plain Python numbers/strings (numpy scalars from Ray Tune included)."""
    out = {}
    for k, v in params.items():
        out[k] = v.item() if hasattr(v, "item") and not isinstance(v, (list, dict)) else v
    return out
