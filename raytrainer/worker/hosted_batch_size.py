"""``auto_find_batch_size`` on transformers' loop, one size agreed by every rank (worker/hosted.rank_layer).

transformers retries its inner training loop with x0.9 the batch size where memory ran out (accelerate's
``find_executable_batch_size``), on the rank that ran out only: the others go on into the step's gradient
all-reduce and wait there, or each rank ends up training with a size of its own. Here, at the start of each
try (``on_train_begin``: the model is prepared, nothing trained yet), every rank runs one forward and
backward of its first batch of the try's size without gradient synchronisation (no collective under DDP,
so a rank that runs out cannot leave the others waiting), and the ranks OR their out-of-memory flags in one
all-reduce. Where any ran out, every rank raises an out-of-memory error together, and each rank's retry
lowers the size alike. The probe's gradients are dropped and the random stream restored. Sharded models
gather inside the forward, which assumes ranks of equal shapes run out alike. In one process transformers'
own retry stands; the size settled on is said in both cases.
"""

from __future__ import annotations

import logging

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class AgreedBatchSize(TrainerCallback):
    same_on_every_rank = True  # sets no flag: its one decision is agreed by the ranks (worker/agreement.py)

    def __init__(self, trainer, ctx):
        self.trainer, self.ctx = trainer, ctx

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        if not args.auto_find_batch_size:
            return
        from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

        trainer = self.trainer
        size = trainer._train_batch_size // max(1, args.n_gpu)  # per device, as the try trains with it
        if self.ctx.distributed and train_dataloader is not None:
            failure = None
            try:
                _probe(trainer, train_dataloader)
            except Exception as exc:
                if not should_reduce_batch_size(exc):
                    raise
                failure = exc
            if self.ctx.any_flags([failure is not None])[0]:
                clear_device_cache(garbage_collection=True)
                logger.warning("auto_find_batch_size: batch size %d does not fit on %s; trying %d", size,
                               f"this worker ({failure})" if failure else "another worker", int(size * 0.9))
                # one arg, "out of memory.": accelerate's should_reduce_batch_size, so every rank retries
                raise RuntimeError(f"auto_find_batch_size: batch size {size} ran out of memory.")
        if size < args.per_device_train_batch_size:
            logger.warning("auto_find_batch_size: training with per_device_train_batch_size=%d", size)


def _probe(trainer, loader) -> None:
    """One forward and backward of this rank's first batch, without gradient synchronisation, on the
    prepared model; the batch read from the loader's own (accelerate's wrapper is not iterated: it would
    stay registered as the loop's active loader), the random streams as they were before."""
    model = trainer.model_wrapped
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices), trainer.accelerator.no_sync(model):
        try:
            batch = trainer._prepare_inputs(next(iter(getattr(loader, "base_dataloader", loader))))
            model.train()
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(model, batch)
            loss.backward()  # plain autograd: the probe never steps
        finally:
            model.zero_grad(set_to_none=True)
