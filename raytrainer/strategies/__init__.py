"""Distribution strategies. The only place that chooses one: ``select_strategy``."""

from __future__ import annotations

from raytrainer.strategies.base import Strategy


def strategy_class(args, world_size: int) -> type[Strategy]:
    """DeepSpeed when ``deepspeed`` is set, FSDP when ``fsdp`` asks for sharding or ``parallelism_config``
    lays out a mesh (FSDP2 over its data-parallel dimensions, tensor parallelism inside), else DDP with more
    than one rank, else a single device.

    ``fsdp="no_shard"`` is plain data parallelism, as in HF: DDP.
    """
    if args.deepspeed:
        from raytrainer.strategies.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy
    if (args.fsdp and "no_shard" not in args.fsdp) or getattr(args, "parallelism_config", None) is not None:
        from raytrainer.strategies.fsdp import FSDPStrategy

        return FSDPStrategy
    if world_size > 1:
        from raytrainer.strategies.ddp import DDPStrategy

        return DDPStrategy
    from raytrainer.strategies.single import SingleDeviceStrategy

    return SingleDeviceStrategy


def select_strategy(args, ctx) -> Strategy:
    return strategy_class(args, ctx.world_size)(ctx, args)


__all__ = ["Strategy", "select_strategy", "strategy_class"]
