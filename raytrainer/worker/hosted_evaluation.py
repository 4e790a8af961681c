"""A hosted trainer's evaluation returns what one process would, gathered on rank 0 only.

transformers' ``evaluation_loop`` all-gathers every batch's losses, logits and labels onto every rank
(``accelerator.gather_for_metrics``) and runs ``compute_metrics`` on every rank. At 64 ranks that is 64
copies of every prediction (a causal LM's logits: rows x length x vocabulary) and 64 runs of the metric.
raytrainer sends each rank's predictions to rank 0 alone, through two instance attributes for the
duration of each ``evaluation_loop`` call, with transformers' (or TRL's) loop otherwise as it is:

- ``accelerator.gather`` (which ``gather_for_metrics`` calls, then cutting the last batch's padding as it
  always does; transformers' Seq2SeqTrainer, which gathers without the cut, is given the cut too) sends
  each tensor to rank 0 (``torch.distributed.gather``: one copy of each rank's tensor
  crosses the network, to rank 0) and returns the concatenation there; every other rank keeps its own
  tensor, so it holds its share, not everything;
- ``compute_metrics`` runs on rank 0; the loop's metrics (``eval_loss`` included) are then rank 0's on
  every rank (one broadcast of a small dict), so each rank's callbacks see the same numbers.

``eval_use_gather_object`` (arbitrary objects) keeps accelerate's own all-gather of objects. Each batch's
loss is its own labels' mean, as in one process (``average_tokens_across_devices`` off inside
``prediction_step``): transformers counts every rank's labels there, so that a causal LM's eval_loss over
padded rows would move with the worker count. On the last round, whose batches accelerate fills with the
data set's first rows, a rank holding some of the data set's rows steps those alone, the batch one process
steps: its loss their mean, its generations made without other rows beside them (a beam search pads a
finished sequence by what else is in its batch), the rows given back for the gathering's shapes and cut
there; and the last round's losses count each rank's rows of the data set once (``_gather_losses_per_row``:
an ``IterableDataset``'s last rows are dealt out in equal slices, not in whole batches).
"""

from __future__ import annotations

import contextlib
import functools

import torch


def evaluate_as_one_process(trainer, ctx) -> None:
    """Install the rank-0 gathering and the per-batch losses on ``trainer`` (once; idempotent)."""
    if "evaluation_loop" in vars(trainer):
        return
    loop, step = trainer.evaluation_loop, trainer.prediction_step
    pending: dict = {}

    def prediction_step(model, inputs, prediction_loss_only, *args, **kwargs):
        targs = trainer.args
        counted_across = targs.average_tokens_across_devices
        targs.average_tokens_across_devices = False
        # this rank's own labels are its whole batch's: transformers divides the count by the tensor-parallel
        # ranks sharing the batch, right only for a count summed over every rank
        trainer.get_tp_size = _one
        try:
            last, real = _last_round_padded(trainer, ctx), None
            if last:
                remainder = trainer.accelerator.gradient_state.remainder
                real = _real_rows(ctx.rank // _replicas(trainer), remainder, _batch_rows(inputs))
            generating = getattr(targs, "predict_with_generate", False) and not prediction_loss_only
            if real is None:  # every row is the data set's, or none is (cut after the gathering)
                with _root_gathered(trainer.model, generating):
                    out = step(model, inputs, prediction_loss_only, *args, **kwargs)
            else:
                # the data set's rows alone, the batch one process steps (its loss their mean, its generations
                # made without the padding rows beside them); the padding rows back for the gathering's shapes
                with _root_gathered(trainer.model, generating):
                    loss, logits, labels = step(model, _first_rows(inputs, real), prediction_loss_only, *args,
                                                **kwargs)
                rows = _batch_rows(inputs)
                out = loss, _rows_again(logits, real, rows), _rows_again(labels, real, rows)
            # the loop's next gather is this loss's: the last round's, of batches of this many rows
            pending["last_loss"] = _batch_rows(inputs) if last and out[0] is not None else None
            return out
        finally:
            targs.average_tokens_across_devices = counted_across
            del trainer.get_tp_size  # the class's own again

    def evaluation_loop(*args, **kwargs):
        if not ctx.distributed:
            return loop(*args, **kwargs)
        accelerator, compute = trainer.accelerator, trainer.compute_metrics
        replicas = _replicas(trainer)
        if getattr(trainer.gather_function, "__func__", None) is type(accelerator).gather:
            # transformers' Seq2SeqTrainer gathers its generations with accelerate's plain gather: every rank
            # gets every rank's rows, the last round's padding rows kept (13 rows on 2 ranks of 3 return 18)
            trainer.gather_function = functools.partial(_gather_as_one_process, trainer, ctx, pending)
        accelerator.gather = functools.partial(_gather_losses_per_row, trainer, ctx, pending, replicas)
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


def _gather_as_one_process(trainer, ctx, pending: dict, data):
    """A Seq2SeqTrainer's gathering on workers: ``gather_for_metrics`` (rank 0's, the last round's padding
    rows cut), and the last round's losses counted as one process counts them. transformers'
    Seq2SeqTrainer gathers with accelerate's plain gather, which in one process cuts nothing, so each
    batch's loss -- repeated ``eval_batch_size`` times by the loop, the short last batch's too -- weighs as a
    full batch; here each rank holding rows of the data set on that round gives its batch's copies whole
    (the padding ranks none)."""
    accelerator, rows = trainer.accelerator, pending.pop("last_loss", None)
    if not rows:
        return accelerator.gather_for_metrics(data)
    gathered = accelerator.gather(data)  # rank 0: every reader's copies in rank order, nothing cut
    if not ctx.is_world_zero:
        return gathered
    readers = -(-accelerator.gradient_state.remainder // rows)  # the ranks holding rows of the data set
    return gathered[: readers * data.shape[0]]


@contextlib.contextmanager
def _root_gathered(model, generating: bool):
    """Under FSDP2, a generating step runs with the root unit's parameters gathered: ``generate()`` calls the
    encoder of an encoder-decoder on its own (``get_encoder()``), outside the root's forward, whose hook
    would gather them, and the encoder's embedding is the root's (T5's ``shared``, tied to the LM head).
    The blocks gather their own in their forwards, as in training; the root is sharded again after. A model
    that has not run forward yet (``predict`` before any training) is first made the root of its units, as
    its first forward would (FSDP2 takes the first unit to run forward for the root -- the encoder's
    embedding's, else -- and then refuses the real root's forward)."""
    from torch.distributed.fsdp import FSDPModule

    if not (generating and isinstance(model, FSDPModule)):
        yield
        return
    model._get_fsdp_state()._lazy_init()  # a no-op once the root has run forward
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def _gather_losses_per_row(trainer, ctx, pending: dict, replicas: int, data):
    """``gather_on_rank_zero``; for the last round's loss (transformers' loop gathers each batch's loss
    repeated ``eval_batch_size`` times, and ``gather_for_metrics`` keeps the first ``remainder`` of the
    concatenation), rank 0 keeps each rank's copies for that rank's rows of the data set only. accelerate
    deals the last rows of a map-style set in whole batches, padded (rank 0's batch first), and those of an
    ``IterableDataset`` in equal slices (``dispatch_batches``: 2 rows left on 2 ranks are one row each):
    there the cut kept rank 0's loss twice and never rank 1's (66 rows in batches of 8: eval_loss 0.4058
    where one process gives 0.4185)."""
    rows = pending.pop("last_loss", None)
    gathered = gather_on_rank_zero(data, ctx, replicas)
    if not rows or not ctx.is_world_zero or not isinstance(data, torch.Tensor) or data.ndim != 1:
        return gathered
    copies, remainder = data.shape[0], trainer.accelerator.gradient_state.remainder
    kept = torch.cat([part[: min(max(remainder - reader * rows, 0), rows)]  # this reader's real rows
                      for reader, part in enumerate(gathered.split(copies))])
    if not len(kept):
        return gathered
    return torch.cat([kept, kept[-1:].expand(gathered.shape[0] - kept.shape[0])])  # the shape accelerate cuts


def _one() -> int:
    return 1


def _replicas(trainer) -> int:
    """Consecutive ranks that read the same batches: a tensor- (and context-) parallel group under
    ``parallelism_config`` (accelerate deals each such group one batch), else 1."""
    config = getattr(trainer.accelerator.state, "parallelism_config", None)
    return config.tp_size * config.cp_size if config is not None else 1


def _last_round_padded(trainer, ctx) -> bool:
    """The evaluation's last batch, whose rows do not fill every rank's batch (the same answer on every
    rank). accelerate makes the ranks' last batches equal (``even_batches``) by appending the data set's
    first rows, and ``gather_for_metrics`` keeps the first ``remainder`` rows in rank order; transformers'
    per-batch loss (repeated once per row) is the mean over the padded batch, so ``eval_loss`` would count
    the appended rows too (one process has none)."""
    state = trainer.accelerator.gradient_state
    return (ctx.distributed and state.end_of_dataloader and (state.remainder or 0) > 0
            and not trainer.accelerator.split_batches)


def _real_rows(reader: int, remainder: int, rows: int | None) -> int | None:
    """How many of this rank's ``rows`` on the last round are the data set's (``reader``: the rank's place
    among the ranks that read different batches); None when all or none are (its loss stands, or is cut
    with its rows) or the batch has no row count."""
    if rows is None:
        return None
    real = min(max(remainder - reader * rows, 0), rows)
    return real if 0 < real < rows else None


def _batch_rows(inputs) -> int | None:
    """The batch's row count, when every tensor in ``inputs`` has it first."""
    sizes = {v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.ndim > 0}
    return sizes.pop() if len(sizes) == 1 else None


def _rows_again(outputs, real: int, rows: int):
    """``outputs`` of a batch's first ``real`` rows given ``rows`` rows again, the last one repeated: the
    shapes every rank gathers alike; the repeated rows are the padding rows ``gather_for_metrics`` cuts."""
    from accelerate.utils import recursively_apply

    def fill(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.ndim == 0 or tensor.shape[0] != real:
            return tensor
        return torch.cat([tensor, tensor[-1:].expand(rows - real, *tensor.shape[1:])])

    return None if outputs is None else recursively_apply(fill, outputs)


def _first_rows(inputs, n: int) -> dict:
    return {k: v[:n] if isinstance(v, torch.Tensor) and v.ndim > 0 else v for k, v in inputs.items()}


def gather_on_rank_zero(data, ctx, replicas: int = 1):
    """``data`` (a tensor, or a nested tuple / list / dict of tensors of the same shape on every rank, as
    accelerate's ``gather`` requires) concatenated over the ranks on rank 0, in rank order; this rank's own
    on the others. ``replicas``: consecutive ranks that read the same batch (a tensor-parallel group), whose
    first rank's part counts for all."""
    from accelerate.utils import recursively_apply

    def one(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()[None] if tensor.ndim == 0 else tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(ctx.world_size)] if ctx.is_world_zero else None
        torch.distributed.gather(tensor, parts, dst=0)
        return torch.cat(parts[::replicas]) if ctx.is_world_zero else tensor

    return recursively_apply(one, data, error_on_other_type=True)
