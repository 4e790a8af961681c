"""What every rank does with one Trainer call, on a Ray worker or in the driver's own process
(``num_workers=0``): take its place in the run, route its logs, run the method, hand back its part."""

from __future__ import annotations

import io
import logging

import torch

from raytrainer import final_weights
from raytrainer.callbacks import runs_on_driver, state_to_dict
from raytrainer.parallelism import model_parallel_size
from raytrainer.protocol import Kind, RankResult
from raytrainer.worker.logs import rank_logging
from raytrainer.worker.session import RankSession

logger = logging.getLogger(__name__)


def run_rank(trainer, session: RankSession, method: str, kwargs: dict) -> RankResult:
    """What every rank does: take its place, route its logs, run ``method``, hand back its part. The
    Trainer refers to the session while the method runs (``trainer._session``), and only then."""
    ctx, channel = session.ctx, session.channel
    trainer.args._set_process(ctx.world_size, ctx.rank, ctx.local_rank, ctx.node_rank, ctx.device)
    ctx.model_parallel = model_parallel_size(getattr(trainer.args, "parallelism_config", None))
    if getattr(trainer.args, "elastic", False):  # the global batch of max workers, on this many
        from raytrainer.elastic import fit_batch

        fit_batch(trainer.args, ctx.world_size)
    trainer._session = session
    try:
        with rank_logging(trainer.args, ctx.rank, channel, session.transformers_log_level):
            if channel is not None:
                session.checkpoint_sink = lambda info: channel.send(Kind.CHECKPOINT, info, urgent=True)
                kwargs = after_restart(trainer, session, method, kwargs)
                if kwargs is None:  # an earlier attempt failed deterministically: the driver raises its error
                    return RankResult(global_step=0)
                _split_callbacks(trainer, session)
                if method == "train" and ctx.on_ray:  # a checkpoint on Ray's preemption notice
                    from raytrainer.worker.preemption import PreemptionCallback

                    growth = channel if getattr(trainer.args, "elastic", False) else None
                    trainer.callback_handler.add_callback(PreemptionCallback(session, growth=growth))
                if ctx.is_world_zero:  # each rank's pace, at each logging step (worker/pace.py)
                    session.pace_sink = lambda report: channel.send(Kind.PACE, report)
            output = getattr(trainer, method)(**kwargs)
            weights_at = None
            if method == "train" and channel is not None:
                weights_at = final_weights.write(trainer, session)  # a collective; the weights go to storage
    finally:
        trainer._session = None
    if not ctx.is_world_zero:
        return RankResult(trainer.state.global_step)
    return RankResult(trainer.state.global_step, output, state_to_dict(trainer.state), weights_at,
                      callback_states(trainer.callback_handler.callbacks) if channel is not None else None)


_STAYS = (torch.nn.Module, torch.optim.Optimizer, io.IOBase)

#: A callback attribute bigger than this (pickled) stays on the workers: the channel carries small results.
MAX_CALLBACK_ATTRIBUTE_BYTES = 1 << 20


def callback_states(callbacks) -> list[tuple[str, dict]]:
    """Rank 0's worker-side callbacks after a call, as (class name, attributes): the driver's instances
    take them on (``absorb_callback_states``), so a script reads on the driver what its callbacks recorded
    on the workers -- as with transformers, where they ran in its own process. Attributes that cannot be
    pickled, modules, optimizers, open files, and attributes bigger than MAX_CALLBACK_ATTRIBUTE_BYTES stay
    behind, as do raytrainer's own rank-side callbacks (``stays_on_ranks``: the driver has no instance, and
    one that holds the rank's session would pickle the strategy's model to find out)."""
    import cloudpickle

    from raytrainer.worker.channel_client import MAX_RESULT_TENSOR_BYTES, tensor_bytes

    states, tensors = [], 0
    for callback in callbacks:
        if runs_on_driver(callback) or getattr(callback, "stays_on_ranks", False):
            continue
        attributes = {}
        for name, value in vars(callback).items():
            # weights never travel; a file belongs to its process (cloudpickle would send its contents)
            if name.startswith("__") or isinstance(value, _STAYS):
                continue
            try:
                size, held = len(cloudpickle.dumps(value)), tensor_bytes(value)
            except Exception:  # a lock, a file, a process group, a module inside: the driver's own stays
                continue
            if size <= MAX_CALLBACK_ATTRIBUTE_BYTES and tensors + held <= MAX_RESULT_TENSOR_BYTES // 2:
                attributes[name] = value
                tensors += held
            else:
                logger.info("%s.%s (%d bytes pickled) stays on the workers: the driver's copy keeps its "
                            "value from before the call", type(callback).__name__, name, size)
        states.append((type(callback).__qualname__, attributes))
    return states


def absorb_callback_states(callbacks, states: list[tuple[str, dict]] | None) -> None:
    """Update the driver's worker-side callbacks in place from rank 0's (``callback_states``); several
    instances of one class are matched in order, as transformers matches saved callback states."""
    if not states:
        return
    mine: dict[str, list] = {}
    for callback in callbacks:
        if not runs_on_driver(callback):
            mine.setdefault(type(callback).__qualname__, []).append(callback)
    for name, attributes in states:
        if mine.get(name):
            vars(mine[name].pop(0)).update(attributes)


def _split_callbacks(trainer, session: RankSession) -> None:
    """Display callbacks run on the driver; rank 0 relays the events they need."""
    from raytrainer.worker.relay import RelayCallback

    ctx, channel = session.ctx, session.channel
    driver_side = [cb for cb in trainer.callback_handler.callbacks if runs_on_driver(cb)]
    for cb in driver_side:
        trainer.callback_handler.remove_callback(cb)
    if ctx.is_world_zero:
        trainer.callback_handler.add_callback(RelayCallback(channel))
    if any(getattr(cb, "may_stop_training", False) for cb in driver_side):
        from raytrainer.worker.stop import DriverStopCallback

        # On every rank, after the relay: rank 0 sends an evaluation before waiting for its decision.
        trainer.callback_handler.add_callback(DriverStopCallback(channel, ctx, session.attempt))


def after_restart(trainer, session: RankSession, method: str, kwargs: dict) -> dict | None:
    """After a worker failure Ray Train starts a new worker group (max_failures): it resumes from the
    latest checkpoint this run committed, if any, callback states included -- unless the failure was
    deterministic (None: do not train; failures.py). For both hosts (worker/hosted.py)."""
    ctx = session.ctx
    attempt = ctx.broadcast_object(
        session.channel.begin_attempt(ctx.world_size) if ctx.is_world_zero else None)
    session.attempt = attempt.number
    if attempt.failed:
        return None
    if method == "train" and attempt.number > 0 and attempt.latest_checkpoint:
        trainer.args.restore_callback_states_from_checkpoint = True  # go on as if never interrupted
        return {**kwargs, "resume_from_checkpoint": attempt.latest_checkpoint}
    return kwargs
