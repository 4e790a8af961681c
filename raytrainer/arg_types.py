"""Checks of `TrainingArguments`' values (every value of transformers' enums is accepted).

Every check raises a `ValueError` that reads "<field>=<value>: <what is wrong>; <how to fix it>".
"""

import importlib.util
import json
import logging
import os
from enum import Enum
from typing import Any

from transformers.trainer_utils import HubStrategy, IntervalStrategy, SaveStrategy, SchedulerType
from transformers.training_args import OptimizerNames, ParallelMode

__all__ = ["HubStrategy", "IntervalStrategy", "OptimizerNames", "ParallelMode", "SaveStrategy",
           "SchedulerType"]


# "passive" leaves the level to raytrainer's default: INFO on the main process, WARNING on replicas.
LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "passive": -1,
}
_PASSIVE_MAIN_LEVEL = logging.INFO
_PASSIVE_REPLICA_LEVEL = logging.WARNING

DDP_BACKENDS = (None, "gloo", "nccl", "mpi", "ccl", "hccl")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
INCLUDE_FOR_METRICS = ("inputs", "loss")
_DICT_FIELDS = ("lr_scheduler_kwargs", "resources_per_worker", "fsdp_config",
                "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")
TRAIN_SAMPLING_STRATEGIES = ("random", "sequential", "group_by_length")
#: fsdp_config keys raytrainer reads (transformers' names; an ``fsdp_`` prefix is dropped first, as
#: transformers does). ``use_orig_params`` and ``sync_module_states`` are what FSDP2 always does; ``version``
#: must be 2.
FSDP_CONFIG_KEYS = frozenset({
    "transformer_layer_cls_to_wrap", "min_num_params", "activation_checkpointing", "state_dict_type",
    "cpu_ram_efficient_loading", "sync_module_states", "use_orig_params", "reshard_after_forward", "version",
    "cpu_offload", "auto_wrap_policy", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings"})
#: Keys transformers passes to FSDP1 only (fsdp_config version 1): accepted, without effect under FSDP2.
FSDP1_ONLY_KEYS = frozenset({"forward_prefetch", "backward_prefetch", "limit_all_gathers"})
FSDP_OPTIONS = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard", "offload",
                "auto_wrap")


def _normalize_fsdp(value: Any) -> list[str]:
    """HF's forms: a space-separated string, a list, True (= full_shard), or empty/False/None."""
    if value is True:
        return ["full_shard"]
    if not value:
        return []
    items = [value] if isinstance(value, str) else list(value)
    # the command line gives ["full_shard auto_wrap"] for --fsdp "full_shard auto_wrap": split each item
    return [word.lower() for v in items for word in str(v).split()]


def _normalize_fsdp_config(config: dict | None, fsdp: list[str]) -> tuple[dict | None, list[str]]:
    """transformers' reading of ``fsdp_config``: an ``fsdp_`` prefix dropped from each key, a single layer
    class name made a list; ``cpu_offload`` and ``auto_wrap_policy`` given there add the ``fsdp`` options
    they stand for (``offload``, ``auto_wrap``)."""
    if not config:
        return config, fsdp
    config = {(k[5:] if k.startswith("fsdp_") else k): v for k, v in config.items()}
    if isinstance(config.get("transformer_layer_cls_to_wrap"), str):
        config["transformer_layer_cls_to_wrap"] = [config["transformer_layer_cls_to_wrap"]]
    fsdp = list(fsdp)
    if as_flag(config.get("cpu_offload")) and "offload" not in fsdp:
        fsdp.append("offload")
    policy = str(config.get("auto_wrap_policy", "")).upper()
    if policy in ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP") and fsdp and "auto_wrap" not in fsdp:
        fsdp.append("auto_wrap")
    return config, fsdp


def as_flag(value: Any) -> bool:
    """A boolean as transformers reads fsdp_config flags: True, or a string spelling it ("true", "True")."""
    return str(value).lower() == "true"


# ---------------------------------------------------------------------------------------------------------
# Small validation helpers. Every error reads "<field>=<value>: <what is wrong>; <how to fix it>".
# ---------------------------------------------------------------------------------------------------------


def _error(name: str, value: Any, problem: str, fix: str) -> ValueError:
    return ValueError(f"{name}={value!r}: {problem}; {fix}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_positive_int(name: str, value: Any, example: int) -> None:
    if not (_is_int(value) and value > 0):
        raise _error(name, value, "must be a positive integer", f"pass e.g. --{name} {example}")


def _to_enum(name: str, value: Any, enum_cls: type[Enum]) -> Enum:
    """``value`` as a member of ``enum_cls`` (transformers' enums), refused by name when it is not one."""
    try:
        return enum_cls(getattr(value, "value", value))
    except ValueError:
        allowed = tuple(enum_cls)
        shown = ", ".join(repr(m.value) for m in allowed)
        raise _error(name, value, "unknown value, must be one of " + shown,
                     f"pass e.g. --{name} {allowed[0].value}") from None


def _check_one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        shown = ", ".join(repr(v) for v in allowed)
        example = next(v for v in allowed if v is not None)
        raise _error(name, value, f"must be one of {shown}", f"pass e.g. --{name} {example}")


def _parse_dict(name: str, value: Any) -> dict | None:
    """A dict field given as a dict, None, a JSON object string (as the command line gives it), or the path
    of a JSON file holding the object (as transformers reads ``--fsdp_config``)."""
    if value is None or isinstance(value, dict):
        return value
    path = value.strip() if isinstance(value, str) else ""
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            try:
                parsed = json.load(f)
            except json.JSONDecodeError as exc:
                raise _error(name, value, f"names a file that is not valid JSON ({exc.msg}, line "
                             f"{exc.lineno})", "fix the file, or pass the JSON object itself") from None
        if isinstance(parsed, dict):
            return parsed
        raise _error(name, value, "names a JSON file that does not hold an object", "put a JSON object in it")
    if path.endswith(".json"):  # a JSON object never ends so: a file that is not there
        raise _error(name, value, "no such file", "pass the path of a JSON file, or the JSON object itself")
    if isinstance(value, str):
        if not path:
            return {}
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _error(
                name,
                value,
                f"is not valid JSON ({exc.msg})",
                f"""pass a JSON object, e.g. --{name} '{{"key": 1}}'""",
            ) from None
        if isinstance(parsed, dict):
            return parsed
    raise _error(
        name, value, "must be a dict or a JSON object string", f"""pass e.g. --{name} '{{"key": 1}}'"""
    )


def _normalize_steps(name: str, value: Any, strategy: str) -> int | float:
    """An interval in steps: an integer >= 1, or a float in (0, 1) meaning a ratio of the total steps."""
    fix = f"pass e.g. --{name} 500 (or a ratio in (0, 1) of the total steps), or change --{strategy}"
    if not _is_number(value) or value <= 0:
        raise _error(name, value, f"must be a positive number when {strategy} is 'steps'", fix)
    if value >= 1:
        if value != int(value):
            raise _error(name, value, "must be an integer when it is 1 or more", fix)
        return int(value)
    return value


# -- checks that read several fields (called from TrainingArguments.__post_init__) --------------------
# accelerate's dataloader options as transformers' AcceleratorConfig has them by default: what raytrainer's
# loaders do (non_blocking copies too, whatever the value)
_ACCELERATOR_DEFAULTS = {"split_batches": False, "dispatch_batches": None, "even_batches": True,
                         "use_seedable_sampler": True, "gradient_accumulation_kwargs": None,
                         "use_configured_state": False}
DEBUG_OPTIONS = ("underflow_overflow", "tpu_metrics_debug")


def check_moot(args) -> None:
    """transformers' fields that have no effect on Ray or are refused: each non-default value that would
    change what transformers does is an error naming the field and the way to get it with raytrainer."""
    debug = args.debug
    debug = debug.split() if isinstance(debug, str) else [getattr(d, "value", d) for d in debug or ()]
    for option in debug:
        _check_one_of("debug", option, DEBUG_OPTIONS)
    if "tpu_metrics_debug" in debug:
        raise _error("debug", args.debug, "tpu_metrics_debug prints TPU metrics; raytrainer's workers run on "
                     "CPUs and GPUs", "drop it (underflow_overflow works on any device)")
    args.debug = debug
    config = args.accelerator_config
    if isinstance(config, str):
        with open(config) as f:
            config = json.load(f)
    config = dict(vars(config)) if config is not None and not isinstance(config, dict) else config
    for key, value in (config or {}).items():
        if key != "non_blocking" and _ACCELERATOR_DEFAULTS.get(key, ...) != value:  # unknown keys too
            raise _error("accelerator_config", args.accelerator_config,
                         f"sets {key}={value!r}, which raytrainer's loaders do not do (each rank reads its "
                         "own shard of every step's batch, evenly, from a seeded sampler)",
                         f"leave {key} at its default ({_ACCELERATOR_DEFAULTS.get(key)!r}) or drop it")
    from raytrainer import parallelism

    args.parallelism_config = parallelism.parse(args.parallelism_config)
    if args.parallelism_config is not None:
        parallelism.check(args)
    if args.use_liger_kernel or args.liger_kernel_config:
        name = "use_liger_kernel" if args.use_liger_kernel else "liger_kernel_config"
        raise _error(name, getattr(args, name), "raytrainer does not patch models with Liger "
                     "kernels", "apply them in model_init (liger_kernel.transformers."
                     "apply_liger_kernel_to_<arch>() before building the model) so that every worker builds "
                     "the patched model")


def check_neftune(args) -> None:
    alpha = args.neftune_noise_alpha
    if alpha is not None and not (_is_number(alpha) and alpha > 0):
        raise _error("neftune_noise_alpha", alpha, "must be a positive number",
                     "pass e.g. --neftune_noise_alpha 5, or leave it unset")


def check_fsdp(args) -> None:
    unknown = [o for o in args.fsdp if o not in FSDP_OPTIONS]
    if unknown:
        raise _error("fsdp", " ".join(args.fsdp), f"unknown FSDP option {unknown[0]!r}",
                     f"use options from {', '.join(FSDP_OPTIONS)}, e.g. --fsdp 'full_shard auto_wrap'")
    sharding = [o for o in args.fsdp if o not in ("offload", "auto_wrap")]
    if args.fsdp and len(sharding) != 1:
        raise _error("fsdp", " ".join(args.fsdp), "needs exactly one sharding mode",
                     "pick one of full_shard, shard_grad_op, hybrid_shard, hybrid_shard_zero2, no_shard")
    if sharding and sharding[0] != "no_shard" and args.fp16:
        raise _error("fp16", True, "is not supported with FSDP sharding (gradients are sharded)",
                     "use --bf16 with FSDP, or DDP for fp16")
    if sharding and sharding[0] != "no_shard" and args.num_workers == 0:
        raise _error("fsdp", " ".join(args.fsdp), "shards across Ray workers, but num_workers=0",
                     "pass --num_workers 2 (or more), or drop --fsdp")
    config = args.fsdp_config or {}
    extra = sorted(set(config) - FSDP_CONFIG_KEYS - FSDP1_ONLY_KEYS)
    if extra:
        raise _error("fsdp_config", args.fsdp_config, f"unknown key {extra[0]!r}",
                     f"use keys from {', '.join(sorted(FSDP_CONFIG_KEYS))}")
    if str(config.get("version", 2)) != "2":
        raise _error("fsdp_config", args.fsdp_config, f"version {config['version']!r}: raytrainer runs FSDP2 "
                     "(fully_shard) only", "drop 'version' or set it to 2")
    xla = [k for k in ("xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt") if as_flag(config.get(k))]
    if xla:
        raise _error("fsdp_config", args.fsdp_config, f"{xla[0]} is set, and raytrainer does not run on XLA",
                     f"drop {xla[0]!r} (Ray workers run FSDP2 on CUDA or CPU)")
    unsynced = str(config.get("sync_module_states")).lower() == "false"
    if as_flag(config.get("cpu_ram_efficient_loading")) and unsynced:
        raise _error("fsdp_config", args.fsdp_config, "cpu_ram_efficient_loading needs sync_module_states "
                     "(rank 0's weights are broadcast to the other ranks)",
                     "drop sync_module_states or set it true")
    if "reshard_after_forward" in config:
        zero2 = bool({"shard_grad_op", "hybrid_shard_zero2"} & set(args.fsdp))
        if as_flag(config["reshard_after_forward"]) == zero2:
            raise _error("fsdp_config", args.fsdp_config, f"reshard_after_forward "
                         f"{config['reshard_after_forward']!r} contradicts fsdp={' '.join(args.fsdp)!r}",
                         "drop reshard_after_forward: full_shard / hybrid_shard reshard after forward, "
                         "shard_grad_op / hybrid_shard_zero2 do not")
    kind = (args.fsdp_config or {}).get("state_dict_type", "SHARDED_STATE_DICT")
    if kind not in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        raise _error("fsdp_config", args.fsdp_config, f"state_dict_type {kind!r} is unknown",
                     "use SHARDED_STATE_DICT (optimizer state sharded, the default) or FULL_STATE_DICT")


def check_deepspeed(args) -> None:
    if not args.deepspeed:
        return
    if args.fsdp and "no_shard" not in args.fsdp:
        raise _error("deepspeed", "<config>", "cannot be combined with fsdp (two sharding engines)",
                     "pass only one of --deepspeed and --fsdp")
    if args.num_workers == 0:
        raise _error("deepspeed", "<config>", "runs on Ray workers, but num_workers=0",
                     "pass --num_workers 1 (or more), or drop --deepspeed")
    if args.nonfinite_loss == "skip_step":
        raise _error("nonfinite_loss", "skip_step", "DeepSpeed's engine steps by itself (it skips only fp16 "
                     "overflows)", "use nonfinite_loss='error' (the default) or 'ignore' with --deepspeed")
    from raytrainer.strategies.deepspeed_config import check_config

    config = check_config(args)  # file, JSON, stage, "auto" values and mismatches with these arguments
    if (config.get("fp16") or {}).get("enabled") is True and not args.use_gpu:
        raise _error("fp16", True, "DeepSpeed's fp16 runs on GPUs only (on CPU it fails in every worker "
                     "with 'Type fp16 is not supported on your device')", "use --bf16 on CPU, or --use_gpu")


# The package each of transformers' optimizer handlers (``transformers.trainer_optimizer``) imports:
# transformers' own availability check for it, and what to install. The torch optimizers need none.
def _optim_packages() -> dict[str, tuple]:
    from transformers.utils import import_utils as iu

    return {
        "_get_bitsandbytes_optimizer": (iu.is_bitsandbytes_available, "bitsandbytes", "bitsandbytes"),
        "_get_galore_optimizer": (iu.is_galore_torch_available, "galore_torch", "galore-torch"),
        "_get_apollo_optimizer": (iu.is_apollo_torch_available, "apollo_torch", "apollo-torch"),
        "_get_lomo_optimizer": (iu.is_lomo_available, "lomo_optim", "lomo-optim"),
        "_get_grokadamw": (iu.is_grokadamw_available, "grokadamw", "grokadamw"),
        "_get_torchao_optimizer": (iu.is_torchao_available, "torchao", "torchao"),
        "_get_schedule_free_optimizer": (iu.is_schedulefree_available, "schedulefree", "schedulefree"),
        "_get_stable_adamw": (iu.is_torch_optimi_available, "torch-optimi", "torch-optimi"),
        "_get_adamw_anyprecision": (lambda: importlib.util.find_spec("torchdistx") is not None, "torchdistx",
                                    "git+https://github.com/pytorch/torchdistx"),
    }


# Optimizers that update the weights outside the optimizer step raytrainer's loop makes (transformers has its
# own training step for them), or that need a device raytrainer's workers do not have.
_UNSUPPORTED_OPTIMIZERS = {
    "lomo": "updates the weights inside its own fused backward (Lomo.fused_backward), which raytrainer's "
            "training step does not call",
    "adalomo": "updates the weights inside its own fused backward (AdaLomo.fused_backward), which "
               "raytrainer's training step does not call",
    "adamw_torch_xla": "is torch_xla's optimizer for XLA devices, and raytrainer's workers run on CUDA or "
                       "CPU",
    "adamw_torch_npu_fused": "is torch_npu's optimizer for Ascend NPUs, and raytrainer's workers run on CUDA "
                             "or CPU",
}


def check_optim_package(args) -> None:
    """The package the optimizer ``args.optim`` names is installed (on the driver: the workers need it too),
    and ``optim_args`` reads as transformers reads it."""
    from transformers.trainer_optimizer import _OPTIMIZER_HANDLERS, _parse_optim_args

    name = args.optim.value
    if name in _UNSUPPORTED_OPTIMIZERS:
        raise _error("optim", name, _UNSUPPORTED_OPTIMIZERS[name],
                     "use another optimizer, e.g. --optim adamw_torch (or galore_adamw_layerwise for low "
                     "memory)")
    handler = _OPTIMIZER_HANDLERS.get(args.optim)
    available, module, pip_name = _optim_packages().get(getattr(handler, "__name__", ""), (None, None, None))
    if available is not None:
        ok = available()
        if ok and name == "schedule_free_radam":
            ok = available("1.4.0")
            pip_name = "'schedulefree>=1.4.0'"
        if not ok:
            raise ValueError(f"optim={name!r} needs the {module} package: pip install {pip_name} (in the "
                             "workers' environment too)")
    try:
        _parse_optim_args(args.optim_args)
    except ValueError:
        raise _error("optim_args", args.optim_args, "must read 'key=value,key=value' (no empty item)",
                     "pass e.g. --optim_args 'momentum=0.9,nesterov=true'") from None


def check_optim_features(args) -> None:
    name = args.optim.value
    if name.startswith(("galore", "apollo")):  # transformers' low-rank optimizers
        modules = args.optim_target_modules
        kind = "GaLore" if name.startswith("galore") else "APOLLO"
        if not modules:
            raise _error("optim", name, f"needs optim_target_modules (the layers {kind} projects)",
                         "pass e.g. --optim_target_modules 'attn,mlp' or 'all-linear'")
        if not isinstance(modules, (list, str)):
            raise _error("optim_target_modules", modules, "must be a list of names, a regex or 'all-linear'",
                         "pass e.g. --optim_target_modules 'attn,mlp' or 'all-linear'")
        whole = name.removesuffix("_layerwise")
        if name != whole and args.num_workers > 1:
            raise _error("optim", name, "a layer-wise optimizer steps each parameter in its backward hook, "
                         "which DDP's gradient all-reduce does not support",
                         f"use --num_workers 1, or the non-layerwise form ({whole})")
        if name != whole and args.gradient_accumulation_steps != 1:
            raise _error("optim", name, "a layer-wise optimizer steps each parameter in its backward hook, "
                         "so it cannot accumulate gradients (gradient_accumulation_steps="
                         f"{args.gradient_accumulation_steps})",
                         f"pass --gradient_accumulation_steps 1, or use {whole}")
        if args.deepspeed or (args.fsdp and "no_shard" not in args.fsdp):
            raise _error("optim", name,
                         f"{kind} projects whole weight matrices; sharded strategies split them",
                         "use it with DDP (or one worker), or another optimizer with FSDP/DeepSpeed")
    check_optim_package(args)
    if args.tf32 and args.num_workers > 0 and not args.use_gpu:
        raise _error("tf32", True, "is a GPU (Ampere or newer) setting, but use_gpu=False",
                     "pass --use_gpu true on a GPU cluster, or drop --tf32")
    if args.tf32 and args.num_workers == 0 and args.device.type != "cuda":
        where = "use_cpu=True" if args.use_cpu else "it has no CUDA device"
        raise _error("tf32", True, "is a GPU (Ampere or newer) setting, but with num_workers=0 training runs "
                     f"in this process, and {where}",
                     "run on a machine with a GPU, or drop --tf32")
    if args.fp16_full_eval and args.bf16_full_eval:
        raise _error("fp16_full_eval", True, "cannot be combined with bf16_full_eval=True",
                     "pass only one of --fp16_full_eval and --bf16_full_eval")
