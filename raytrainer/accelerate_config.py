"""An accelerate config file (what ``accelerate config`` writes) as TrainingArguments values.

Read with accelerate's own loader. MULTI_GPU / MULTI_CPU / NO map to ``num_workers`` (DDP with more
than one), FSDP to ``fsdp`` + ``fsdp_config``; ``num_processes`` (all machines together) becomes
``num_workers``, ``mixed_precision`` ``bf16`` / ``fp16``, ``use_cpu`` the opposite of ``use_gpu``.
"""

from __future__ import annotations

import os

_SHARDING = {"FULL_SHARD": "full_shard", "SHARD_GRAD_OP": "shard_grad_op", "NO_SHARD": "no_shard",
             "HYBRID_SHARD": "hybrid_shard", "HYBRID_SHARD_ZERO2": "hybrid_shard_zero2"}
_SHARDING_BY_NUMBER = dict(zip(range(1, 6), ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard",
                                              "hybrid_shard_zero2"]))


def _fsdp(config: dict) -> tuple[list[str], dict]:
    if int(config.get("fsdp_version", 1)) == 2:
        options = ["full_shard" if config.get("fsdp_reshard_after_forward", True) else "shard_grad_op"]
    else:
        strategy = config.get("fsdp_sharding_strategy", "FULL_SHARD")
        options = [_SHARDING_BY_NUMBER.get(strategy) if isinstance(strategy, int)
                   else _SHARDING.get(str(strategy).upper())]
        if options[0] is None:
            raise ValueError(f"accelerate_config: unknown fsdp_sharding_strategy {strategy!r}; use one of "
                             f"{', '.join(_SHARDING)}")
    fsdp_config: dict = {}
    if config.get("fsdp_offload_params"):
        options.append("offload")
    policy = str(config.get("fsdp_auto_wrap_policy") or "NO_WRAP").upper()
    if policy == "TRANSFORMER_BASED_WRAP":
        options.append("auto_wrap")
        layers = config.get("fsdp_transformer_layer_cls_to_wrap")
        if layers:
            names = layers.split(",") if isinstance(layers, str) else list(layers)
            fsdp_config["transformer_layer_cls_to_wrap"] = [n.strip() for n in names]
    elif policy == "SIZE_BASED_WRAP":
        options.append("auto_wrap")
        fsdp_config["min_num_params"] = int(config.get("fsdp_min_num_params", 100_000_000))
    if config.get("fsdp_activation_checkpointing"):
        fsdp_config["activation_checkpointing"] = True
    return options, fsdp_config


def values_from_accelerate_config(path: str) -> dict:
    if not os.path.isfile(path):
        raise ValueError(
            f"accelerate_config={path!r}: no such file; give the YAML that `accelerate config` wrote.")
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(path)
    kind = getattr(config.distributed_type, "value", str(config.distributed_type)).upper()
    values: dict = {"use_gpu": not config.use_cpu}
    processes = getattr(config, "num_processes", -1)
    if processes and processes > 0:
        values["num_workers"] = processes
    precision = str(config.mixed_precision or "no").lower()
    if precision in ("bf16", "fp16"):
        values[precision] = True
    if kind == "FSDP":
        values["fsdp"], values["fsdp_config"] = _fsdp(config.fsdp_config or {})
    elif kind == "DEEPSPEED":
        raise ValueError(f"accelerate_config={path!r} asks for DeepSpeed, which raytrainer does not run yet; "
                         "use an FSDP or MULTI_GPU / MULTI_CPU config.")
    elif kind not in ("MULTI_GPU", "MULTI_CPU", "NO"):
        raise ValueError(f"accelerate_config={path!r}: distributed_type {kind} is not supported; use FSDP, "
                         "MULTI_GPU, MULTI_CPU or NO.")
    return values
