"""Optimizer, weight-decay groups and learning-rate schedules, with the Hugging Face Trainer's semantics.

* ``get_scheduler(name, optimizer, ...)`` is ``transformers.get_scheduler`` itself (``linear``, ``cosine``,
  ``reduce_lr_on_plateau``, ``warmup_stable_decay``, ...: every name of ``transformers.SchedulerType``).
* ``get_decay_parameter_names(model)`` names the parameters that get weight decay (not biases, not norms).
* ``create_optimizer(model, args)`` / ``create_scheduler(optimizer, args, num_training_steps)`` read the
  ``TrainingArguments`` fields of the same names as HF (``optim``, ``optim_args``, ``learning_rate``,
  ``weight_decay``, ``adam_*``, ``lr_scheduler_type``, ``lr_scheduler_kwargs``, ``warmup_steps``,
  ``warmup_ratio``); ``args`` is duck-typed.

transformers' step schedules are ``LambdaLR`` objects whose multiplier is a ``functools.partial`` of a
module-level function: they pickle (to Ray workers) and their ``state_dict()`` holds plain Python values
(``torch.load(..., weights_only=True)`` reads it). A resumed run rebuilds the scheduler from the same
arguments and then loads the state (the step count). What stays here is raytrainer's own: the warmup that
also reads ``warmup_ratio``, the optimizer table and ``optim_args`` typing, and the PBT re-application.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import ReduceLROnPlateau
from transformers import optimization as _hf_optimization
from transformers.optimization import get_scheduler
from transformers.trainer_utils import SchedulerType

__all__ = [
    "METRIC_SCHEDULERS",
    "OPTIMIZER_NAMES",
    "SCHEDULER_NAMES",
    "create_optimizer",
    "create_scheduler",
    "get_decay_parameter_names",
    "get_scheduler",
    "parse_optim_args",
    "warmup_steps_for",
]


# ---------------------------------------------------------------------------------------------------------
# Learning-rate schedules: transformers' own
# ---------------------------------------------------------------------------------------------------------

SCHEDULER_NAMES: tuple[str, ...] = tuple(member.value for member in SchedulerType)

# Schedulers stepped with a metric after each evaluation instead of after each optimizer step (the loop and
# the evaluation hook test against these, as transformers' Trainer does).
# An older transformers has no GreedyLR.
METRIC_SCHEDULERS: tuple[type, ...] = (
    ReduceLROnPlateau, *([_hf_optimization.GreedyLR] if hasattr(_hf_optimization, "GreedyLR") else []),
)


def warmup_steps_for(args: Any, num_training_steps: int) -> int:
    """Warmup steps as HF's ``TrainingArguments.get_warmup_steps``.

    ``args.warmup_steps`` when it is >= 1; a ``warmup_steps`` in (0, 1) is a ratio of ``num_training_steps``;
    otherwise ``ceil(num_training_steps * args.warmup_ratio)`` (0 when neither is set).
    """
    steps = getattr(args, "warmup_steps", 0) or 0
    ratio = getattr(args, "warmup_ratio", 0.0) or 0.0
    if steps < 0 or ratio < 0:
        raise ValueError(f"warmup_steps ({steps}) and warmup_ratio ({ratio}) must be >= 0")
    if steps >= 1:
        return int(steps)
    if steps > 0:
        return math.ceil(num_training_steps * steps)
    return math.ceil(num_training_steps * ratio)


def create_scheduler(optimizer: Optimizer, args: Any, num_training_steps: int):
    """The scheduler that ``args.lr_scheduler_type`` / ``args.lr_scheduler_kwargs`` describe."""
    kwargs = getattr(args, "lr_scheduler_kwargs", None)
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs) if kwargs.strip() else None
    if hasattr(optimizer, "optimizers"):  # layer-wise GaLore: a schedule per parameter's optimizer
        from raytrainer.galore import LayerWiseScheduler

        return LayerWiseScheduler(optimizer, lambda opt: create_scheduler(opt, args, num_training_steps))
    return get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=warmup_steps_for(args, num_training_steps),
        num_training_steps=num_training_steps,
        scheduler_specific_kwargs=kwargs,
    )


# ---------------------------------------------------------------------------------------------------------
# Weight-decay groups
# ---------------------------------------------------------------------------------------------------------

_NORM_TYPES: tuple[type, ...] = tuple(
    t
    for t in (
        nn.LayerNorm,
        nn.GroupNorm,
        nn.LocalResponseNorm,
        nn.modules.batchnorm._NormBase,  # BatchNorm*, SyncBatchNorm, InstanceNorm*
        getattr(nn, "RMSNorm", None),
    )
    if t is not None
)
# Custom norm classes: LlamaRMSNorm, T5LayerNorm, LayerNorm2d, FusedRMSNorm ...
_NORM_CLASS_NAME = re.compile(r"Norm(\d+d)?$")


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or bool(_NORM_CLASS_NAME.search(type(module).__name__))


def get_decay_parameter_names(model: nn.Module) -> list[str]:
    """Names (as ``model.named_parameters()`` gives them) of the parameters that get weight decay.

    Every parameter except biases (a last name component containing ``bias``, e.g. ``bias`` or
    ``in_proj_bias``) and the parameters that normalisation layers own directly. A normalisation layer is
    a torch norm (LayerNorm, GroupNorm, BatchNorm*, InstanceNorm*, RMSNorm) or any module whose class name
    ends in ``Norm`` (``LlamaRMSNorm``, ``T5LayerNorm``, ``LayerNorm2d``). Only a norm's own parameters are
    excluded, not those of modules nested inside it, so a wrapper named like ``PreNorm`` that holds a
    sublayer still decays that sublayer's weights.
    """
    norm_params = {
        id(p) for module in model.modules() if _is_norm(module) for p in module.parameters(recurse=False)
    }
    return [
        name
        for name, p in model.named_parameters()
        if id(p) not in norm_params and "bias" not in name.rsplit(".", 1)[-1].lower()
    ]


# ---------------------------------------------------------------------------------------------------------
# Optimizer
# ---------------------------------------------------------------------------------------------------------


def _enum_value(value: Any) -> Any:
    return getattr(value, "value", value)


def _check_kwargs(kind: str, name: str, fn: Callable[..., Any], kwargs: dict[str, Any], skip: int) -> None:
    """TypeError naming ``kind`` ``name`` and the accepted keywords when ``fn`` would not take ``kwargs``."""
    params = list(inspect.signature(fn).parameters.values())[skip:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(f"{kind} {name!r} does not accept {unknown}; it accepts {accepted}")

_OPTIMIZERS: dict[str, tuple[type[Optimizer], dict[str, Any], bool]] = {
    # name -> (class, fixed kwargs, takes adam betas/eps)
    "adamw_torch": (torch.optim.AdamW, {"fused": False}, True),
    "adamw_torch_fused": (torch.optim.AdamW, {"fused": True}, True),
    "sgd": (torch.optim.SGD, {}, False),
    "adagrad": (torch.optim.Adagrad, {}, False),
    "rmsprop": (torch.optim.RMSprop, {}, False),
    "adafactor": (torch.optim.Adafactor, {}, False),  # torch's Adafactor (factored second moments)
}

OPTIMIZER_NAMES: tuple[str, ...] = tuple(_OPTIMIZERS)


def _convert(value: str) -> Any:
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def parse_optim_args(optim_args: str | dict[str, Any] | None) -> dict[str, Any]:
    """``"momentum=0.9,nesterov=true"`` -> ``{"momentum": 0.9, "nesterov": True}``.

    Values become int, float, bool (``true``/``false``) or None (``none``) when they read as one, else stay
    strings. Spaces are ignored, as in HF. A dict is returned as a copy.
    """
    if not optim_args:
        return {}
    if isinstance(optim_args, dict):
        return dict(optim_args)
    parsed: dict[str, Any] = {}
    for item in optim_args.replace(" ", "").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(
                f"optim_args must look like 'k1=v1,k2=v2'; cannot read {item!r} in {optim_args!r}"
            )
        parsed[key] = _convert(value)
    return parsed


def create_optimizer(model: nn.Module, args: Any) -> Optimizer:
    """The optimizer ``args.optim`` names, over two groups: decayed weights and the rest (no decay).

    Only parameters with ``requires_grad`` are included. Reads ``optim``, ``optim_args``, ``learning_rate``,
    ``weight_decay``, ``adam_beta1``, ``adam_beta2``, ``adam_epsilon`` from ``args``. ``optim_args`` keywords
    are passed to the optimizer's constructor and win over the values taken from ``args``.
    """
    name = _enum_value(args.optim)
    if name.startswith("galore_"):
        from raytrainer.galore import create_galore_optimizer

        base = {"lr": args.learning_rate, "weight_decay": args.weight_decay}
        if "adamw" in name:
            base.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
        return create_galore_optimizer(model, args, base, parse_optim_args(getattr(args, "optim_args", None)))
    if name not in _OPTIMIZERS:
        raise ValueError(f"Unknown optim {name!r}; choose one of {list(OPTIMIZER_NAMES)}")
    cls, fixed, adam_like = _OPTIMIZERS[name]

    decay = set(get_decay_parameter_names(model))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("create_optimizer: the model has no parameter with requires_grad=True")
    groups = [
        {"params": [p for n, p in trainable if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
    ]

    kwargs: dict[str, Any] = {"lr": args.learning_rate, **fixed}
    if adam_like:
        kwargs.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    extra = parse_optim_args(getattr(args, "optim_args", None))
    _check_kwargs("optim", name, cls.__init__, extra, skip=2)
    kwargs.update(extra)
    return cls(groups, **kwargs)


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
