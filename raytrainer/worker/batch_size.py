"""auto_find_batch_size: the largest per-device batch size (from the one asked, x0.9 per try, as
accelerate's ``find_executable_batch_size``) whose training micro-step fits in memory on EVERY worker.

Each try runs one forward and backward of the first batch of that size on the set-up model, with gradient
synchronisation off (for DDP no collective at all, so a worker that runs out of memory cannot leave the
others waiting in an all-reduce), then all workers OR their "out of memory" flags in one all-reduce: one
worker short of memory makes every worker try the next size, so they all train with the same size. The
probe's gradients are dropped. Optimizer state is not allocated yet, so the probe measures weights,
gradients and activations; sharded strategies (FSDP, ZeRO-3 before partitioning) gather inside forward,
which assumes that workers with equal shapes run out of memory alike.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def find_batch_size(trainer, strategy, wrapped) -> int:
    from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

    args, ctx = trainer.args, trainer._ctx
    size = args.per_device_train_batch_size
    while size > 0:
        failure = None
        try:
            _probe(trainer, strategy, wrapped, size)
        except Exception as exc:
            if not should_reduce_batch_size(exc):
                raise
            failure = exc
        finally:
            wrapped.zero_grad(set_to_none=True)
        if not ctx.any_flags([failure is not None])[0]:
            if size != args.per_device_train_batch_size:
                logger.warning("auto_find_batch_size: training with per_device_train_batch_size=%d", size)
            return size
        clear_device_cache(garbage_collection=True)
        smaller = int(size * 0.9)
        logger.warning("auto_find_batch_size: batch size %d does not fit on %s; trying %d", size,
                       f"this worker ({failure})" if failure else "another worker", smaller)
        size = smaller
    raise RuntimeError("auto_find_batch_size: not even a batch of 1 example fits in memory on every "
                       "worker; use a sharding strategy (--fsdp, --deepspeed), gradient checkpointing or a "
                       "smaller model")


def retry_smaller(trainer, exc: Exception) -> bool:
    """Memory ran out during training with ``auto_find_batch_size`` in one process: lower the per-device
    batch size (x0.9) and say so; the caller runs the training loop again from the start, as transformers
    restarts its inner loop. False where that does not apply (another error, several workers -- where one
    worker alone may run out, so a restart would need every worker's agreement: the probe before training
    covers them -- or no smaller size left)."""
    from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

    args = trainer.args
    smaller = int(args.per_device_train_batch_size * 0.9)
    if not (args.auto_find_batch_size and should_reduce_batch_size(exc) and trainer._ctx.world_size == 1
            and smaller > 0):
        return False
    clear_device_cache(garbage_collection=True)
    logger.warning("auto_find_batch_size: memory ran out while training with batch size %d (%s); training "
                   "again from the start with %d", args.per_device_train_batch_size, exc, smaller)
    args.per_device_train_batch_size = smaller
    return True


def _probe(trainer, strategy, wrapped, size: int) -> None:
    loader = trainer._dataloader(trainer.train_dataset, size, train=True)
    batch = trainer._prepare_inputs(next(iter(loader)))
    wrapped.train()
    with strategy.no_sync(wrapped, sync=False), trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(wrapped, batch)
    loss.backward()  # plain autograd: the probe never steps (nor touches an engine's buffers)
