"""Hyperparameter search: every trial is a full raytrainer run (its own Ray workers), driven by Optuna or
Ray Tune. ``Trainer.hyperparameter_search`` is the entry point; ``common`` holds what both share."""

from __future__ import annotations

from raytrainer.search.common import BestRun, TrialSummary, default_compute_objective

__all__ = ["BestRun", "TrialSummary", "default_compute_objective", "hyperparameter_search"]


def hyperparameter_search(trainer, hp_space=None, compute_objective=None, n_trials: int = 20,
                          direction="minimize", backend=None, hp_name=None, **kwargs):
    """Checks on the driver (model_init, optimizers, direction, picklability), then the backend's search.

    Returns a ``BestRun`` (a list of them, one per Pareto-optimal trial, for a list of directions)."""
    from raytrainer.search import common

    common.check_search(trainer, direction)
    name = common.pick_backend(backend)
    if hp_space is None:
        hp_space = common.default_hp_space_optuna if name == "optuna" else common.default_hp_space_ray
    compute_objective = compute_objective or common.default_compute_objective
    if trainer.args.num_workers > 0 or name == "ray":  # shipped to Ray workers / Tune trial actors
        common.check_picklable(trainer, hp_space=hp_space, compute_objective=compute_objective)
    if name == "optuna":
        from raytrainer.search.optuna_backend import run_optuna

        return run_optuna(trainer, hp_space, compute_objective, n_trials, direction, hp_name, **kwargs)
    from raytrainer.search.ray_tune_backend import run_ray_tune

    return run_ray_tune(trainer, hp_space, compute_objective, n_trials, direction, hp_name, **kwargs)
