"""What every rank hands the driver about a call besides its answer, for every trainer on Ray workers
(worker/hosted.py): the state rank 0's copies of the script's callbacks recorded, and where a restarted
group resumes from."""

from __future__ import annotations

import io
import logging

import torch
import transformers

from raytrainer.callbacks import runs_on_driver
from raytrainer.worker.session import RankSession

logger = logging.getLogger(__name__)


#: Never travels with a callback's state: weights, optimizers, open files, and a trainer (a callback that
#: keeps its trainer, as transformers' JIT callback does; on the driver, pickling one would pickle the
#: recipe's payload, the model with it, at every call)
_STAYS = (torch.nn.Module, torch.optim.Optimizer, io.IOBase, transformers.Trainer)

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
                logger.info("%s.%s (%d bytes pickled) does not travel between the driver and the workers: "
                            "each side keeps its own value", type(callback).__name__, name, size)
        states.append((type(callback).__qualname__, attributes))
    return states


def absorb_callback_states(callbacks, states: list[tuple[str, dict]] | None) -> None:
    """Update the driver's worker-side callbacks in place from rank 0's (``callback_states``), or a rank's
    just built from the driver's; several instances of one class are matched in order, as transformers
    matches saved callback states."""
    if not states:
        return
    mine: dict[str, list] = {}
    for callback in callbacks:
        if not runs_on_driver(callback):
            mine.setdefault(type(callback).__qualname__, []).append(callback)
    for name, attributes in states:
        if mine.get(name):
            vars(mine[name].pop(0)).update(attributes)


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
