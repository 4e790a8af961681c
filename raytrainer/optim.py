"""What raytrainer adds to transformers' optimizers and learning-rate schedules.

The optimizer, its weight-decay groups and the schedule are transformers.Trainer's own:
``raytrainer.Trainer.create_optimizer`` / ``create_scheduler`` / ``get_optimizer_cls_and_kwargs`` /
``get_decay_parameter_names`` are those methods (every ``optim`` of
``transformers.training_args.OptimizerNames``, ``optim_args``, GaLore and its layer-wise form,
``TrainingArguments.get_warmup_steps``), and
``get_scheduler`` here is ``transformers.get_scheduler`` itself.

transformers' step schedules are ``LambdaLR`` objects whose multiplier is a ``functools.partial`` of a
module-level function: they pickle (to Ray workers) and their ``state_dict()`` holds plain Python values
(``torch.load(..., weights_only=True)`` reads it). A resumed run rebuilds the scheduler from the same
arguments and then loads the state (the step count). What stays here is raytrainer's own: which schedulers
step on an evaluation metric, and the PBT re-application of hyperparameters after a checkpoint is loaded.
"""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

from torch.optim import Optimizer
from torch.optim.lr_scheduler import ReduceLROnPlateau
from transformers import optimization as _hf_optimization
from transformers.optimization import get_scheduler
from transformers.trainer_pt_utils import LayerWiseDummyScheduler

__all__ = ["METRIC_SCHEDULERS", "LayerWiseScheduler", "get_scheduler", "layer_wise_schedules",
           "reapply_hyperparameters"]

# Schedulers stepped with a metric after each evaluation instead of after each optimizer step (the loop and
# the evaluation hook test against these, as transformers' Trainer does).
# An older transformers has no GreedyLR.
METRIC_SCHEDULERS: tuple[type, ...] = (
    ReduceLROnPlateau, *([_hf_optimization.GreedyLR] if hasattr(_hf_optimization, "GreedyLR") else []),
)


class LayerWiseScheduler(LayerWiseDummyScheduler):
    """transformers' scheduler for a layer-wise optimizer (GaLore ``*_layerwise``: each parameter's own
    optimizer and schedule step in its backward hook), reporting one rate per group of the one-group dummy
    optimizer (the first parameter's). transformers' ``get_lr`` gives every parameter's rate, which torch's
    ``LRScheduler.step`` (``zip(..., strict=True)``) refuses. ``Trainer.create_scheduler`` has
    ``transformers.get_scheduler`` build this class in place of ``LayerWiseDummyScheduler``."""

    def get_lr(self):
        return super().get_lr()[: len(self.optimizer.param_groups)]


@contextlib.contextmanager
def layer_wise_schedules():
    """While ``transformers.get_scheduler`` is called for a ``LayerWiseDummyOptimizer``: it builds
    ``LayerWiseScheduler`` in place of ``LayerWiseDummyScheduler`` (the per-parameter schedules are its
    own)."""
    with mock.patch.object(_hf_optimization, "LayerWiseDummyScheduler", LayerWiseScheduler):
        yield


def reapply_hyperparameters(optimizer: Optimizer, scheduler, args: Any) -> None:
    """After a checkpoint's optimizer and scheduler state were loaded: take THIS run's ``learning_rate`` and
    ``weight_decay`` instead of the checkpoint's (a PBT exploit continues another trial's checkpoint with
    mutated hyperparameters). The schedule keeps its position; its base rate becomes the new one."""
    for group in optimizer.param_groups:
        if group.get("weight_decay", 0.0) > 0.0:
            group["weight_decay"] = args.weight_decay
        group["initial_lr"] = args.learning_rate
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is None:  # no base-rate schedule (e.g. ReduceLROnPlateau): set the rate itself
        for group in optimizer.param_groups:
            group["lr"] = args.learning_rate
        return
    scheduler.base_lrs = [args.learning_rate] * len(optimizer.param_groups)
    for group, fn in zip(optimizer.param_groups, lambdas):
        group["lr"] = args.learning_rate * fn(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
