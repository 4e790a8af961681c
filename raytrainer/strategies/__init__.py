"""Distribution strategies: the only place that names one (``strategy_name``) and says what it can resume
(``check_resume``). transformers' loop and accelerate run them on the ranks; these modules hold what
raytrainer adds to that: per-shard construction under FSDP (fsdp.py, file_shards.py), ZeRO checkpoints
resumed on any world size (deepspeed.py, deepspeed_universal.py), background writes (dcp.py,
deepspeed_writes.py), DeepSpeed's configuration checked on the driver (deepspeed_config.py)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def strategy_name(args, world_size: int) -> str:
    """``"DeepSpeed"`` when ``deepspeed`` is set, ``"FSDP"`` when ``fsdp`` asks for sharding or
    ``parallelism_config`` lays out a mesh (FSDP2 over its data-parallel dimensions, tensor parallelism
    inside), else ``"DDP"`` with more than one rank, else ``"SingleDevice"``. ``fsdp="no_shard"`` is plain
    data parallelism, as in transformers: DDP. (Part of a worker group's shape, driver/resources.group_key,
    and of the console's start line.)"""
    if args.deepspeed:
        return "DeepSpeed"
    if (args.fsdp and "no_shard" not in args.fsdp) or getattr(args, "parallelism_config", None) is not None:
        return "FSDP"
    return "DDP" if world_size > 1 else "SingleDevice"


def check_resume(args, files: list[str], step: int, world_size: int) -> None:
    """On the driver: refuse a checkpoint (its ``files``, saved at ``step``) this run's strategy cannot resume
    on ``world_size`` workers -- one whose model is only a DeepSpeed engine's ZeRO-3 partitions, outside a
    ZeRO-3 run -- and say when a ZeRO checkpoint of another world size will be converted first."""
    from raytrainer.checkpoint import zero_model_tag
    from raytrainer.strategies.deepspeed_config import load_config, zero_stage

    tag = zero_model_tag(files)
    if tag is not None and not (args.deepspeed and zero_stage(load_config(args.deepspeed)) == 3):
        raise ValueError(
            f"resume_from_checkpoint: this checkpoint holds the model only as DeepSpeed ZeRO-3 "
            f"partitions ({tag}/), which only a ZeRO-3 DeepSpeed engine reads. Resume it with a ZeRO-3 "
            f"`deepspeed` config, or write its weights out with `raytrainer consolidate CHECKPOINT OUT` "
            f"and start from those (model_init loading OUT, or a model built from it).")
    if args.deepspeed:
        from raytrainer.strategies.deepspeed import partitions

        saved = partitions(files, step)
        if saved and len(saved) != world_size:
            logger.warning("resume_from_checkpoint: this DeepSpeed ZeRO checkpoint was saved by %d workers "
                           "and this run has %d: rank 0 converts it to DeepSpeed's universal format first "
                           "(reads every partition once)", len(saved), world_size)


__all__ = ["check_resume", "strategy_name"]
