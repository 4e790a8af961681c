"""Optimizer, weight-decay groups and learning-rate schedules, with the Hugging Face Trainer's semantics.

* ``get_scheduler(name, optimizer, ...)`` builds the HF scheduler family (``linear``, ``cosine``, ...);
  for the same inputs it gives the same learning rates as ``transformers.get_scheduler``.
* ``get_decay_parameter_names(model)`` names the parameters that get weight decay (not biases, not norms).
* ``create_optimizer(model, args)`` / ``create_scheduler(optimizer, args, num_training_steps)`` read the
  ``TrainingArguments`` fields of the same names as HF (``optim``, ``optim_args``, ``learning_rate``,
  ``weight_decay``, ``adam_*``, ``lr_scheduler_type``, ``lr_scheduler_kwargs``, ``warmup_steps``,
  ``warmup_ratio``); ``args`` is duck-typed.

Every schedule is a ``LambdaLR`` whose multiplier is a ``functools.partial`` of a module-level function, so
the scheduler pickles and its ``state_dict()`` holds plain Python values only (it loads with
``torch.load(..., weights_only=True)``). The multiplier's settings are not in the state dict: a resumed run
rebuilds the scheduler from the same arguments and then loads the state (the step count).
"""

from __future__ import annotations

import inspect
import json
import math
import re
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau

__all__ = [
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
# Learning-rate multipliers (module-level so that partials of them pickle)
# ---------------------------------------------------------------------------------------------------------


def _warmup(step: int, num_warmup_steps: int) -> float:
    return float(step) / float(max(1, num_warmup_steps))


def _constant(step: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, *, num_warmup_steps: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    return 1.0


def _linear(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    return max(0.0, float(num_training_steps - step) / float(max(1, num_training_steps - num_warmup_steps)))


def _cosine(
    step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float, min_lr_rate: float = 0.0
) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return max(0.0, factor * (1.0 - min_lr_rate) + min_lr_rate)


def _cosine_warmup_with_min_lr(
    step: int,
    *,
    num_warmup_steps: int,
    num_training_steps: int,
    num_cycles: float,
    min_lr_rate: float,
    warmup_lr_rate: float | None,
) -> float:
    # Unlike the other schedules, the first step already has a non-zero lr and the decay is shifted by one.
    if step < num_warmup_steps:
        if warmup_lr_rate is None:
            return (step + 1.0) / max(1.0, float(num_warmup_steps))
        return warmup_lr_rate + (1.0 - warmup_lr_rate) * step / max(1, num_warmup_steps - 1)
    progress = (step - num_warmup_steps + 1.0) / max(1.0, float(num_training_steps - num_warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0.0, factor * (1.0 - min_lr_rate) + min_lr_rate)


def _cosine_with_restarts(
    step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: int
) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(num_cycles) * progress) % 1.0))))


def _polynomial(
    step: int, *, num_warmup_steps: int, num_training_steps: int, lr_end: float, power: float, lr_init: float
) -> float:
    # LambdaLR multiplies by the group's initial lr, so the absolute lr is divided by lr_init here.
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    if step > num_training_steps:
        return lr_end / lr_init
    decay_steps = max(1, num_training_steps - num_warmup_steps)
    pct_remaining = 1 - (step - num_warmup_steps) / decay_steps
    return ((lr_init - lr_end) * pct_remaining**power + lr_end) / lr_init


def _inverse_sqrt(step: int, *, num_warmup_steps: int, timescale: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    shift = timescale - num_warmup_steps
    return 1.0 / math.sqrt((step + shift) / timescale)


_WSD_SHAPES = ("linear", "cosine", "1-sqrt")


def _warmup_stable_decay(
    step: int,
    *,
    num_warmup_steps: int,
    num_stable_steps: int,
    num_decay_steps: int,
    warmup_type: str,
    decay_type: str,
    min_lr_ratio: float,
    num_cycles: float,
) -> float:
    if step < num_warmup_steps:
        progress = float(step) / float(max(1, num_warmup_steps))
        if warmup_type == "linear":
            factor = progress
        elif warmup_type == "cosine":
            factor = 0.5 * (1.0 - math.cos(math.pi * progress))
        else:  # "1-sqrt"
            factor = 1.0 - math.sqrt(1.0 - progress)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    if step < num_warmup_steps + num_stable_steps:
        return 1.0
    if step < num_warmup_steps + num_stable_steps + num_decay_steps:
        progress = float(step - num_warmup_steps - num_stable_steps) / float(max(1, num_decay_steps))
        if decay_type == "linear":
            factor = 1.0 - progress
        elif decay_type == "cosine":
            factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
        else:  # "1-sqrt"
            factor = 1.0 - math.sqrt(progress)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio


# ---------------------------------------------------------------------------------------------------------
# Scheduler builders: (optimizer, warmup, total, **scheduler_specific_kwargs) -> scheduler
# ---------------------------------------------------------------------------------------------------------


def _build_constant(optimizer, warmup, total):
    return LambdaLR(optimizer, _constant)


def _build_constant_with_warmup(optimizer, warmup, total):
    return LambdaLR(optimizer, partial(_constant_with_warmup, num_warmup_steps=warmup))


def _build_linear(optimizer, warmup, total):
    return LambdaLR(optimizer, partial(_linear, num_warmup_steps=warmup, num_training_steps=total))


def _build_cosine(optimizer, warmup, total, num_cycles: float = 0.5):
    fn = partial(_cosine, num_warmup_steps=warmup, num_training_steps=total, num_cycles=num_cycles)
    return LambdaLR(optimizer, fn)


def _build_cosine_with_restarts(optimizer, warmup, total, num_cycles: int = 1):
    fn = partial(
        _cosine_with_restarts, num_warmup_steps=warmup, num_training_steps=total, num_cycles=num_cycles
    )
    return LambdaLR(optimizer, fn)


def _build_polynomial(optimizer, warmup, total, lr_end: float = 1e-7, power: float = 1.0):
    lr_init = optimizer.defaults["lr"]
    if not lr_init > lr_end:
        raise ValueError(f"polynomial: lr_end ({lr_end}) must be smaller than the initial lr ({lr_init})")
    fn = partial(
        _polynomial,
        num_warmup_steps=warmup,
        num_training_steps=total,
        lr_end=lr_end,
        power=power,
        lr_init=lr_init,
    )
    return LambdaLR(optimizer, fn)


def _build_inverse_sqrt(optimizer, warmup, total, timescale: int | None = None):
    if timescale is None:
        timescale = warmup or 10_000
    return LambdaLR(optimizer, partial(_inverse_sqrt, num_warmup_steps=warmup, timescale=timescale))


def _build_reduce_lr_on_plateau(optimizer, warmup, total, **kwargs):
    return ReduceLROnPlateau(optimizer, **kwargs)


def _min_lr_rate(name: str, optimizer: Optimizer, min_lr: float | None, min_lr_rate: float | None) -> float:
    if min_lr is not None and min_lr_rate is not None:
        raise ValueError(f"{name}: set only one of min_lr or min_lr_rate in lr_scheduler_kwargs")
    if min_lr is not None:
        return min_lr / optimizer.defaults["lr"]
    if min_lr_rate is None:
        raise ValueError(f"{name}: set one of min_lr or min_lr_rate in lr_scheduler_kwargs")
    return min_lr_rate


def _build_cosine_with_min_lr(
    optimizer,
    warmup,
    total,
    num_cycles: float = 0.5,
    min_lr: float | None = None,
    min_lr_rate: float | None = None,
):
    rate = _min_lr_rate("cosine_with_min_lr", optimizer, min_lr, min_lr_rate)
    fn = partial(
        _cosine, num_warmup_steps=warmup, num_training_steps=total, num_cycles=num_cycles, min_lr_rate=rate
    )
    return LambdaLR(optimizer, fn)


def _build_cosine_warmup_with_min_lr(
    optimizer,
    warmup,
    total,
    num_cycles: float = 0.5,
    min_lr: float | None = None,
    min_lr_rate: float | None = None,
    warmup_lr_rate: float | None = None,
):
    rate = _min_lr_rate("cosine_warmup_with_min_lr", optimizer, min_lr, min_lr_rate)
    fn = partial(
        _cosine_warmup_with_min_lr,
        num_warmup_steps=warmup,
        num_training_steps=total,
        num_cycles=num_cycles,
        min_lr_rate=rate,
        warmup_lr_rate=None if warmup_lr_rate is None else float(warmup_lr_rate),
    )
    return LambdaLR(optimizer, fn)


def _build_warmup_stable_decay(
    optimizer,
    warmup,
    total,
    num_decay_steps: int | None = None,
    num_stable_steps: int | None = None,
    warmup_type: str = "linear",
    decay_type: str = "cosine",
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
):
    name = "warmup_stable_decay"
    if num_decay_steps is None:
        raise ValueError(f"{name} requires num_decay_steps in lr_scheduler_kwargs")
    if total is None and num_stable_steps is None:
        raise ValueError(f"{name} requires num_training_steps or num_stable_steps (in lr_scheduler_kwargs)")
    if total is not None and num_stable_steps is not None:
        warnings.warn(
            f"{name}: both num_training_steps and num_stable_steps are set; num_stable_steps is used",
            stacklevel=3,
        )
    for kind, value in (("warmup_type", warmup_type), ("decay_type", decay_type)):
        if value not in _WSD_SHAPES:
            raise ValueError(f"{name}: unknown {kind} {value!r}; expected one of {list(_WSD_SHAPES)}")
    if num_stable_steps is None:
        num_stable_steps = total - warmup - num_decay_steps
        if num_stable_steps < 0:
            raise ValueError(
                f"{name}: num_warmup_steps ({warmup}) + num_decay_steps ({num_decay_steps}) exceed "
                f"num_training_steps ({total})"
            )
    fn = partial(
        _warmup_stable_decay,
        num_warmup_steps=warmup,
        num_stable_steps=num_stable_steps,
        num_decay_steps=num_decay_steps,
        warmup_type=warmup_type,
        decay_type=decay_type,
        min_lr_ratio=min_lr_ratio,
        num_cycles=num_cycles,
    )
    return LambdaLR(optimizer, fn)


# name -> (builder, needs num_warmup_steps, needs num_training_steps)
_SCHEDULERS: dict[str, tuple[Callable[..., Any], bool, bool]] = {
    "linear": (_build_linear, True, True),
    "cosine": (_build_cosine, True, True),
    "cosine_with_restarts": (_build_cosine_with_restarts, True, True),
    "polynomial": (_build_polynomial, True, True),
    "constant": (_build_constant, False, False),
    "constant_with_warmup": (_build_constant_with_warmup, True, False),
    "inverse_sqrt": (_build_inverse_sqrt, True, False),
    "reduce_lr_on_plateau": (_build_reduce_lr_on_plateau, False, False),
    "cosine_with_min_lr": (_build_cosine_with_min_lr, True, True),
    "cosine_warmup_with_min_lr": (_build_cosine_warmup_with_min_lr, True, True),
    "warmup_stable_decay": (_build_warmup_stable_decay, True, False),
}

SCHEDULER_NAMES: tuple[str, ...] = tuple(_SCHEDULERS)


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


def get_scheduler(
    name: Any,
    optimizer: Optimizer,
    num_warmup_steps: int | None = None,
    num_training_steps: int | None = None,
    scheduler_specific_kwargs: dict[str, Any] | None = None,
):
    """Build the learning-rate scheduler called ``name`` (a str, or an Enum whose ``.value`` is one).

    Names: see ``SCHEDULER_NAMES``. ``scheduler_specific_kwargs`` holds the schedule's own settings
    (``num_cycles``, ``lr_end``/``power``, ``timescale``, ``min_lr``/``min_lr_rate``, ``num_decay_steps``, ...
    or ``ReduceLROnPlateau``'s arguments); a keyword the schedule does not take raises ``TypeError``.
    """
    key = _enum_value(name)
    if key not in _SCHEDULERS:
        raise ValueError(f"Unknown lr scheduler {key!r}; choose one of {list(SCHEDULER_NAMES)}")
    builder, needs_warmup, needs_total = _SCHEDULERS[key]
    kwargs = dict(scheduler_specific_kwargs or {})
    if needs_warmup and num_warmup_steps is None:
        raise ValueError(f"The {key!r} lr scheduler requires num_warmup_steps")
    if needs_total and num_training_steps is None:
        raise ValueError(f"The {key!r} lr scheduler requires num_training_steps")
    _check_kwargs("lr scheduler", key, builder, kwargs, skip=3)
    return builder(optimizer, num_warmup_steps, num_training_steps, **kwargs)


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
