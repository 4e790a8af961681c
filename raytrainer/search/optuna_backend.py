"""The Optuna backend: one study, each trial a raytrainer run (``output_dir/run-<trial number>``).

Study options come from the search's kwargs (``sampler``, ``pruner``, ``storage``, ``study_name``,
``load_if_exists``); ``timeout``, ``n_jobs``, ``gc_after_trial``, ``callbacks``, ``catch`` go to
``study.optimize``. ``n_trials`` is the number of trials this call runs, as in transformers: a search resumed
on a ``storage`` (an RDB URL such as ``sqlite:///search.db``, with ``load_if_exists=True``) keeps the study's
finished trials and runs ``n_trials`` more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from raytrainer.driver.group import GroupPool
from raytrainer.search.common import BestRun, TrialSummary, run_trial, split_hyperparameters

logger = logging.getLogger(__name__)

_STUDY_KEYS = ("sampler", "pruner", "storage", "study_name", "load_if_exists")
_OPTIMIZE_KEYS = ("timeout", "n_jobs", "gc_after_trial", "callbacks", "catch", "show_progress_bar")


def run_optuna(trainer, hp_space: Callable, compute_objective: Callable, n_trials: int, direction,
               hp_name: Callable | None = None, **kwargs) -> BestRun | list[BestRun]:
    import optuna

    unknown = set(kwargs) - set(_STUDY_KEYS) - set(_OPTIMIZE_KEYS)
    if unknown:
        raise TypeError(f"hyperparameter_search(backend='optuna') got unknown arguments {sorted(unknown)}; "
                        f"it takes {sorted(_STUDY_KEYS + _OPTIMIZE_KEYS)}.")
    study_kwargs = {k: kwargs[k] for k in _STUDY_KEYS if k in kwargs}
    optimize_kwargs = {k: kwargs[k] for k in _OPTIMIZE_KEYS if k in kwargs}
    multi = isinstance(direction, list)
    if multi:
        study = optuna.create_study(directions=direction, **study_kwargs)
    else:
        study = optuna.create_study(direction=direction, **study_kwargs)
    if optimize_kwargs.get("n_jobs", 1) != 1 and trainer.args.num_workers == 0:
        logger.warning("n_jobs=%s ignored: with num_workers=0 trials train in this process, one at a time.",
                       optimize_kwargs["n_jobs"])
        optimize_kwargs["n_jobs"] = 1
    if optimize_kwargs.get("n_jobs", 1) != 1:
        from raytrainer.driver.ray_runtime import ensure_ray

        ensure_ray(trainer.args)  # once, before the trials' threads each look for Ray

    waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    if waiting and optimize_kwargs.get("n_jobs", 1) != 1 and str(study_kwargs.get("storage", "")).startswith(
            "sqlite"):
        logger.warning("n_jobs=%s with enqueued trials in a SQLite study: SQLite has no row locks, so two "
                       "threads may take the same enqueued trial (it then runs twice and the second tell "
                       "fails). Use n_jobs=1, or a PostgreSQL/MySQL storage.", optimize_kwargs["n_jobs"])
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    done = len(study.get_trials(deepcopy=False, states=finished))
    if done:
        logger.info("study %r holds %d finished trials; running %d more", study.study_name, done, n_trials)
    summaries: dict[int, TrialSummary] = {}

    def objective(trial):
        params = hp_space(trial)
        split_hyperparameters(trainer, params, warn=trial.number == 0 or not summaries)
        trial_id = hp_name(trial) if hp_name is not None else str(trial.number)

        def report(step, value, metrics) -> bool:
            if multi:  # Optuna has no intermediate values (nor pruning) for multi-objective studies
                return False
            trial.report(value, step)
            return trial.should_prune()

        summary = run_trial(trainer, trial, trial_id, params, compute_objective, report, pool=pool)
        summaries[trial.number] = summary
        trial.set_user_attr("raytrainer_output_dir", summary.output_dir)
        if summary.pruned:
            raise optuna.TrialPruned(f"pruned at step {summary.evaluations[-1]['step']}")
        if multi and not isinstance(summary.objective, (list, tuple)):
            raise ValueError(f"direction has {len(direction)} objectives, but compute_objective returned "
                             f"{summary.objective!r}; return a list of {len(direction)} values.")
        return summary.objective

    pool = GroupPool(trainer.args)  # trials run one after another on the same live worker groups
    try:
        study.optimize(objective, n_trials=n_trials, **optimize_kwargs)
    finally:
        pool.close()
    if not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        states = [t.state.name for t in study.get_trials(deepcopy=False)]
        raise RuntimeError(f"hyperparameter_search: no trial completed (their states: {states}); the "
                           "errors logged above say why.")
    if multi:
        return [_best_run(t, summaries) for t in study.best_trials]
    return _best_run(study.best_trial, summaries)


def _best_run(trial, summaries: dict) -> BestRun:
    summary = summaries.get(trial.number)
    if summary is None and "raytrainer_output_dir" in trial.user_attrs:  # a trial of an earlier session
        summary = TrialSummary.load(trial.user_attrs["raytrainer_output_dir"])
    objective = trial.values if len(trial.values) > 1 else trial.value
    return BestRun(str(trial.number), objective, trial.params, summary)
