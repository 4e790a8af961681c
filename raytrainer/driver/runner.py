"""Runs a Trainer method where the arguments say: in this process (``num_workers=0``) or on Ray workers.

Either way the same code path runs on each rank (``run_rank``); only the transport differs.
"""

from __future__ import annotations

from raytrainer.callbacks import TrainerState
from raytrainer.driver import preflight
from raytrainer.worker.context import RankContext, local_context
from raytrainer.worker.logs import rank_logging


def run(trainer, method: str, kwargs: dict):
    """Validate on the driver, run ``method`` on every rank, return rank 0's answer."""
    spec = preflight.check(trainer, method, kwargs)
    if trainer.args.num_workers == 0:
        return _run_local(trainer, method, kwargs)
    from raytrainer.driver.launch import launch

    payload = launch(trainer, spec, method, kwargs)
    return _absorb(trainer, method, payload)


def _run_local(trainer, method: str, kwargs: dict):
    ctx = local_context(trainer.args.use_gpu)
    try:
        return run_rank(trainer, ctx, None, method, kwargs)["output"]
    finally:
        trainer._ctx = trainer._strategy = None
        trainer.model_wrapped = trainer.model


def run_rank(trainer, ctx: RankContext, channel, method: str, kwargs: dict) -> dict:
    """What every rank does: take its place, route its logs, run ``method``, hand back its part."""
    from raytrainer.worker.relay import RelayCallback

    trainer.args._set_process(ctx.world_size, ctx.rank, ctx.local_rank, ctx.node_rank)
    trainer._ctx = ctx
    if channel is not None:
        # Display callbacks run on the driver; rank 0 relays the events they need.
        for cb in [cb for cb in trainer.callback_handler.callbacks if getattr(cb, "on_driver", False)]:
            trainer.callback_handler.remove_callback(cb)
        if ctx.is_world_zero:
            trainer.callback_handler.add_callback(RelayCallback(channel))
    with rank_logging(trainer.args, ctx.rank, channel):
        output = getattr(trainer, method)(**kwargs)
        weights = None
        if method == "train" and channel is not None:
            weights = trainer._strategy.full_state_dict(trainer.model_wrapped)  # a collective
    if not ctx.is_world_zero:
        return {"global_step": trainer.state.global_step}
    return {"output": output, "state": trainer.state.to_dict(), "weights": weights}


def _absorb(trainer, method: str, payload: dict):
    """Take rank 0's answer into the driver's Trainer: trained weights and final state after train()."""
    if method == "train":
        trainer.model.load_state_dict(payload["weights"])
        trainer.state = TrainerState.from_dict(payload["state"])
    return payload["output"]
