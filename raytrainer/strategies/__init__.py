"""Distribution strategies. The only place that chooses one: ``select_strategy``."""

from __future__ import annotations

from raytrainer.strategies.base import Strategy


def select_strategy(args, ctx) -> Strategy:
    """DDP when there is more than one rank, a single-device strategy otherwise."""
    if ctx.world_size > 1:
        from raytrainer.strategies.ddp import DDPStrategy

        return DDPStrategy(ctx, args)
    from raytrainer.strategies.single import SingleDeviceStrategy

    return SingleDeviceStrategy(ctx, args)


__all__ = ["Strategy", "select_strategy"]
