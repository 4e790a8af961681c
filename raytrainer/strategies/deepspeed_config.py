"""The DeepSpeed config of ``TrainingArguments(deepspeed=...)``: read and checked on the driver.

transformers fills its "auto" values on each rank (``HfTrainerDeepSpeedConfig``: ``trainer_config_process``,
then ``trainer_config_finalize`` once the model exists) and raises a value that is set but differs from the
argument there. raytrainer checks first, on the driver, before any worker starts (``check_config``):

- every mismatch ``trainer_config_process`` finds is raised at once, naming each value;
- the world size is the number of Ray workers, which the driver knows but its own process group does not
  (it has none): ``train_batch_size`` is micro x accumulation x ``num_workers``;
- ``--bf16`` / ``--fp16`` with no such section turns it on, as accelerate's DeepSpeed plugin does for
  transformers' Trainer; the ranks' config gets ``"auto"`` sections for both (``with_precision_sections``);
- the process's global config (``is_deepspeed_zero3_enabled()``) is left as it was.
"""

from __future__ import annotations

import copy
import json
import os


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


def with_precision_sections(value) -> dict:
    """The config (a path or a dict) with its ``bf16`` and ``fp16`` sections, each ``{"enabled": "auto"}``
    where the config has none, so transformers fills them from ``--bf16`` / ``--fp16``. Without them
    transformers takes the engine's dtype for float32 (``HfTrainerDeepSpeedConfig.dtype()``, what its
    ``_prepare_input`` casts floating inputs to), while accelerate then enables bf16 in the engine from the
    mixed precision: a model with floating inputs (a regressor, audio, vision) met bf16 weights with float32
    inputs and failed at its first matmul."""
    config = load_config(value)
    for section in ("bf16", "fp16"):
        config.setdefault(section, {"enabled": "auto"})
    return config


def zero_stage(config: dict) -> int:
    return int((config.get("zero_optimization") or {}).get("stage", 0) or 0)


class _WithWorldSize:
    """``args`` as transformers reads it, with the world size of the Ray run."""

    def __init__(self, args, world_size: int):
        self._args, self.world_size = args, world_size

    def __getattr__(self, name: str):
        return getattr(self._args, name)


def _transformers_config(config: dict):
    """transformers' ``HfTrainerDeepSpeedConfig`` over a copy of ``config``, leaving the process's global
    config (``is_deepspeed_zero3_enabled()``) as it was."""
    from transformers.integrations import deepspeed as hf_deepspeed

    registered = hf_deepspeed._hf_deepspeed_config_weak_ref
    try:
        return hf_deepspeed.HfTrainerDeepSpeedConfig(copy.deepcopy(config))
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = registered


def _raise_mismatches(mismatches: list[str]) -> None:
    if mismatches:
        raise ValueError(
            "deepspeed: these DeepSpeed config values disagree with the TrainingArguments:\n"
            + "\n".join(mismatches)
            + "\nSet them to \"auto\" in the DeepSpeed config (the arguments then decide), or make the "
              "arguments match.")


def fill_from_args(config: dict, args, world_size: int) -> dict:
    """Fill the "auto" values known before the model exists (on the driver and on every worker)."""
    filled = _transformers_config(config)
    filled.trainer_config_process(_WithWorldSize(args, world_size))
    _raise_mismatches(filled.mismatches)
    config = filled.config
    for name in ("bf16", "fp16"):  # --bf16 / --fp16 with no such section turns it on, as accelerate does
        if getattr(args, name) and name not in config:
            config[name] = {"enabled": True}
    return config


def check_config(args) -> dict:
    """Everything the driver can check before any worker starts; returns the config filled from args."""
    config = load_config(args.deepspeed)
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"deepspeed: zero_optimization.stage={stage!r} must be 0, 1, 2 or 3; fix the config")
    return fill_from_args(config, args, max(args.num_workers, 1))
