"""An accelerate config file (what ``accelerate config`` writes) as TrainingArguments values.

Read with accelerate's own loader. MULTI_GPU / MULTI_CPU / NO map to ``num_workers`` (DDP with more
than one), FSDP to ``fsdp`` + ``fsdp_config``; ``num_processes`` (all machines together) becomes
``num_workers``, ``mixed_precision`` ``bf16`` / ``fp16``, ``use_cpu`` the opposite of ``use_gpu``;
DEEPSPEED to ``deepspeed``: its ``deepspeed_config_file``, or a config made of ``zero_stage``, the offload
devices, ``gradient_accumulation_steps`` and ``gradient_clipping`` (the rest "auto").
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
    if str(config.get("fsdp_cpu_ram_efficient_loading")).lower() == "true":  # rank 0 builds, then broadcasts
        fsdp_config["cpu_ram_efficient_loading"] = True
    if config.get("fsdp_state_dict_type"):
        fsdp_config["state_dict_type"] = str(config["fsdp_state_dict_type"]).upper()
    return options, fsdp_config


def _deepspeed(config: dict, yaml_path: str):
    """A ``deepspeed_config_file`` as is, else a DeepSpeed config built from the plugin's keys; what the
    YAML leaves out is "auto" (taken from the TrainingArguments)."""
    if config.get("deepspeed_config_file"):
        path = os.path.expanduser(config["deepspeed_config_file"])
        here = os.path.dirname(os.path.abspath(yaml_path))
        return path if os.path.isabs(path) else os.path.join(here, path)
    zero: dict = {"stage": int(config.get("zero_stage", 2))}
    for key in ("offload_optimizer", "offload_param"):
        device = str(config.get(f"{key}_device") or "none").lower()
        if device != "none":
            zero[key] = {"device": device}
    if config.get("zero3_save_16bit_model") is not None:
        zero["stage3_gather_16bit_weights_on_model_save"] = bool(config["zero3_save_16bit_model"])
    ds: dict = {"zero_optimization": zero,
                "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                "gradient_accumulation_steps": config.get("gradient_accumulation_steps", "auto"),
                "gradient_clipping": config.get("gradient_clipping", "auto"),
                "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
    return ds


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
        values["deepspeed"] = _deepspeed(config.deepspeed_config or {}, path)
    elif kind not in ("MULTI_GPU", "MULTI_CPU", "NO"):
        raise ValueError(f"accelerate_config={path!r}: distributed_type {kind} is not supported; use FSDP, "
                         "MULTI_GPU, MULTI_CPU or NO.")
    return values
