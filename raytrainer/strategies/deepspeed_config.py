"""The DeepSpeed config of ``TrainingArguments(deepspeed=...)``: read, checked, "auto" values filled.

The rules are HF's (``HfTrainerDeepSpeedConfig``): every ``"auto"`` value takes the matching
TrainingArguments value; a value that is set but differs from the argument is an error listing every
such mismatch, because two sources of truth for the batch size or the learning rate silently train
something else than what was asked. Reading needs no ``deepspeed`` import, so the driver checks the
config before any worker starts.

=============================================  ===========================================================
DeepSpeed key                                  from TrainingArguments
=============================================  ===========================================================
train_micro_batch_size_per_gpu                 per_device_train_batch_size
gradient_accumulation_steps                    gradient_accumulation_steps
train_batch_size                               world size x per_device_train_batch_size x accumulation
gradient_clipping                              max_grad_norm
optimizer.params.lr / betas / eps /            learning_rate / [adam_beta1, adam_beta2] / adam_epsilon /
weight_decay                                   weight_decay
scheduler.params.warmup_min_lr / warmup_max_lr 0 / learning_rate
scheduler.params.warmup_num_steps /            warmup steps / the run's optimizer updates (on the worker)
total_num_steps
fp16.enabled / bf16.enabled                    fp16 or fp16_full_eval / bf16 or bf16_full_eval (a missing
                                               section is added when fp16 / bf16 is set, as accelerate does)
zero_optimization.reduce_bucket_size,          model.config.hidden_size ** 2, 0.9 x that, 10 x hidden_size
stage3_prefetch_bucket_size,                   (on the worker; without a hidden_size the key is left to
stage3_param_persistence_threshold             DeepSpeed's default)
=============================================  ===========================================================
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

_MISSING = object()


def load_config(value) -> dict:
    """The config as a dict, from a dict, a JSON file path or a JSON string (as HF accepts)."""
    if isinstance(value, dict):
        return copy.deepcopy(value)
    if not isinstance(value, str):
        raise ValueError(f"deepspeed={value!r}: must be a path to a DeepSpeed JSON config or a dict; "
                         "pass e.g. --deepspeed ds_config.json")
    text = value
    if not value.lstrip().startswith("{"):
        path = os.path.expanduser(value)
        if not os.path.isfile(path):
            raise ValueError(f"deepspeed={value!r}: no such file; pass the path of a DeepSpeed JSON config "
                             "(e.g. ds_config_zero2.json) or a dict")
        with open(path) as f:
            text = f.read()
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"deepspeed={value!r}: not valid JSON ({exc}); fix the config file") from None
    if not isinstance(config, dict):
        raise ValueError(f"deepspeed={value!r}: the DeepSpeed config must be a JSON object")
    return config


def zero_stage(config: dict) -> int:
    return int((config.get("zero_optimization") or {}).get("stage", 0) or 0)


def _get(config: dict, dotted: str):
    node = config
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return _MISSING
        node = node[key]
    return node


def _set(config: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = config
    for key in parents:
        node = node[key]
    node[last] = value


class _Filler:
    """Fills "auto" values and collects mismatches between set values and the arguments."""

    def __init__(self, config: dict):
        self.config = config
        self.mismatches: list[str] = []

    def match(self, key: str, value, arg_name: str, must_match: bool = True) -> None:
        current = _get(self.config, key)
        if current is _MISSING:
            return
        if current == "auto":
            _set(self.config, key, value)
        elif must_match and current != value:
            self.mismatches.append(f"- ds {key}={current} vs hf {arg_name}={value}")

    def drop_auto(self, key: str) -> None:
        if _get(self.config, key) == "auto":
            *parents, last = key.split(".")
            node = self.config
            for part in parents:
                node = node[part]
            del node[last]

    def check(self) -> None:
        if self.mismatches:
            raise ValueError(
                "deepspeed: these DeepSpeed config values disagree with the TrainingArguments:\n"
                + "\n".join(self.mismatches)
                + "\nSet them to \"auto\" in the DeepSpeed config (the arguments then decide), or make the "
                  "arguments match.")


def fill_from_args(config: dict, args, world_size: int) -> dict:
    """Fill the "auto" values known before the model exists (on the driver and on every worker)."""
    config = copy.deepcopy(config)
    fill = _Filler(config)
    micro, ga = args.per_device_train_batch_size, args.gradient_accumulation_steps
    fill.match("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    fill.match("gradient_accumulation_steps", ga, "gradient_accumulation_steps")
    fill.match("train_batch_size", world_size * micro * ga,
               f"workers*per_device_train_batch_size*gradient_accumulation_steps ({world_size}*{micro}*{ga})")
    fill.match("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    fill.match("optimizer.params.lr", args.learning_rate, "learning_rate")
    fill.match("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    fill.match("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    fill.match("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    fill.match("scheduler.params.warmup_min_lr", 0, "warmup_min_lr", must_match=False)
    fill.match("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    fill.match("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
    fill.match("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval")
    fill.check()
    # --bf16 / --fp16 with a config that has no such section turns it on, as accelerate does
    for name in ("bf16", "fp16"):
        if getattr(args, name) and name not in config:
            config[name] = {"enabled": True}
    return config


def fill_for_run(config: dict, args, num_training_steps: int, hidden_size: int | None) -> dict:
    """Fill the values that need the run's length and the model (on the workers)."""
    config = copy.deepcopy(config)
    fill = _Filler(config)
    fill.match("scheduler.params.total_num_steps", num_training_steps, "max_steps")
    fill.match("scheduler.params.warmup_num_steps", args.get_warmup_steps(num_training_steps), "warmup_steps")
    buckets = {"zero_optimization.reduce_bucket_size": lambda h: h * h,
               "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
               "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h}
    for key, rule in buckets.items():
        if hidden_size:
            fill.match(key, rule(hidden_size), "model.config.hidden_size", must_match=False)
        else:
            fill.drop_auto(key)  # DeepSpeed's default
    fill.check()
    leftover = _autos(config)
    if leftover:
        raise ValueError(f"deepspeed: raytrainer cannot fill the \"auto\" value of {', '.join(leftover)}; "
                         "set it in the DeepSpeed config")
    return config


def _autos(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [k for key, v in node.items() for k in _autos(v, f"{prefix}{key}.")]
    return [prefix.rstrip(".")] if node == "auto" else []


def check_config(args) -> dict:
    """Everything the driver can check before any worker starts; returns the config filled from args."""
    config = load_config(args.deepspeed)
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"deepspeed: zero_optimization.stage={stage!r} must be 0, 1, 2 or 3; fix the config")
    world = max(args.num_workers, 1)
    return fill_from_args(config, args, world)
