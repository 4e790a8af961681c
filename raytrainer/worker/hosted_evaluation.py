"""A hosted trainer's evaluation returns what one process would, gathered on rank 0 only.

transformers' ``evaluation_loop`` all-gathers every batch's losses, logits and labels onto every rank
(``accelerator.gather_for_metrics``) and runs ``compute_metrics`` on every rank. At 64 ranks that is 64
copies of every prediction (a causal LM's logits: rows x length x vocabulary) and 64 runs of the metric.
raytrainer's loop sends each rank's predictions to rank 0 alone; a hosted trainer gets the same here,
through two instance attributes for the duration of each ``evaluation_loop`` call, with transformers' (or
TRL's) loop otherwise as it is:

- ``accelerator.gather`` (which ``gather_for_metrics`` calls, then cutting the last batch's padding as it
  always does) sends each tensor to rank 0 (``torch.distributed.gather``: one copy of each rank's tensor
  crosses the network, to rank 0) and returns the concatenation there; every other rank keeps its own
  tensor, so it holds its share, not everything;
- ``compute_metrics`` runs on rank 0; the loop's metrics (``eval_loss`` included) are then rank 0's on
  every rank (one broadcast of a small dict), so each rank's callbacks see the same numbers.

``eval_use_gather_object`` (arbitrary objects) keeps accelerate's own all-gather of objects. Each batch's
loss is its own labels' mean, as in one process (``average_tokens_across_devices`` off inside
``prediction_step``): transformers counts every rank's labels there, so that a causal LM's eval_loss over
padded rows would move with the worker count.
"""

from __future__ import annotations

import torch


def evaluate_as_one_process(trainer, ctx) -> None:
    """Install the rank-0 gathering and the per-batch losses on ``trainer`` (once; idempotent)."""
    if "evaluation_loop" in vars(trainer):
        return
    loop, step = trainer.evaluation_loop, trainer.prediction_step

    def prediction_step(*args, **kwargs):
        targs = trainer.args
        counted_across = targs.average_tokens_across_devices
        targs.average_tokens_across_devices = False
        try:
            return step(*args, **kwargs)
        finally:
            targs.average_tokens_across_devices = counted_across

    def evaluation_loop(*args, **kwargs):
        if not ctx.distributed:
            return loop(*args, **kwargs)
        accelerator, compute = trainer.accelerator, trainer.compute_metrics
        accelerator.gather = lambda data: gather_on_rank_zero(data, ctx)
        if compute is not None and not ctx.is_world_zero:
            trainer.compute_metrics = lambda *a, **k: {}
        try:
            output = loop(*args, **kwargs)
        finally:
            del accelerator.gather
            trainer.compute_metrics = compute
        metrics = ctx.broadcast_object(output.metrics if ctx.is_world_zero else None)
        return output._replace(metrics=metrics)  # transformers' EvalLoopOutput, a NamedTuple

    trainer.prediction_step = prediction_step
    trainer.evaluation_loop = evaluation_loop


def gather_on_rank_zero(data, ctx):
    """``data`` (a tensor, or a nested tuple / list / dict of tensors of the same shape on every rank, as
    accelerate's ``gather`` requires) concatenated over the ranks on rank 0, in rank order; this rank's own
    on the others."""
    from accelerate.utils import recursively_apply

    def one(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()[None] if tensor.ndim == 0 else tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(ctx.world_size)] if ctx.is_world_zero else None
        torch.distributed.gather(tensor, parts, dst=0)
        return torch.cat(parts) if ctx.is_world_zero else tensor

    return recursively_apply(one, data, error_on_other_type=True)
