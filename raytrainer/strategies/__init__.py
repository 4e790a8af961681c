"""Distribution strategies. The only place that chooses one: ``select_strategy``."""

from __future__ import annotations

from raytrainer.strategies.base import Strategy


def select_strategy(args, ctx) -> Strategy:
    """FSDP when ``fsdp`` asks for sharding, else DDP with more than one rank, else a single device.

    ``fsdp="no_shard"`` is plain data parallelism, as in HF: DDP.
    """
    if args.fsdp and "no_shard" not in args.fsdp:
        from raytrainer.strategies.fsdp import FSDPStrategy

        return FSDPStrategy(ctx, args)
    if ctx.world_size > 1:
        from raytrainer.strategies.ddp import DDPStrategy

        return DDPStrategy(ctx, args)
    from raytrainer.strategies.single import SingleDeviceStrategy

    return SingleDeviceStrategy(ctx, args)


__all__ = ["Strategy", "select_strategy"]
