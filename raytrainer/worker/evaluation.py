"""Evaluation and prediction across ranks, returning what one process would have returned.

Each rank runs ``prediction_step`` over its blocks (see ``raytrainer.data``) and sends its predictions to
rank 0 every ``eval_accumulation_steps`` steps when set, else at the end (``_Gatherer``); rank 0
restores dataset order, cuts the padding, pads variable-length outputs with -100 and computes metrics.
The metrics are then broadcast, so every rank's callbacks see the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from raytrainer.data import batch_size_of, unshard
from raytrainer.trainer_utils import EvalLoopOutput, EvalPrediction, denumpify_detensorize
from raytrainer.worker import console
from raytrainer.worker.loss import adapt_mean_losses

PAD = -100


# -- nested structures of arrays -------------------------------------------------------------------
def _to_numpy(x):
    if x is None:
        return None
    if isinstance(x, (tuple, list)):
        return type(x)(_to_numpy(v) for v in x)
    if isinstance(x, Mapping):
        return {k: _to_numpy(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def _pad_to(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if a.shape == shape:
        return a
    out = np.full(shape, PAD, dtype=np.result_type(a.dtype, np.int64) if a.dtype.kind in "iub" else a.dtype)
    out[tuple(slice(0, s) for s in a.shape)] = a
    return out


def pad_concat(arrays: list[np.ndarray]) -> np.ndarray:
    """Concatenate along dim 0, padding the other dims with -100 to the largest size."""
    arrays = [np.atleast_1d(a) for a in arrays]
    if all(a.shape[1:] == arrays[0].shape[1:] for a in arrays):
        return np.concatenate(arrays)
    tail = tuple(max(s) for s in zip(*(a.shape[1:] for a in arrays)))
    return np.concatenate([_pad_to(a, (a.shape[0], *tail)) for a in arrays])


def nested_concat(parts: list):
    first = parts[0]
    if isinstance(first, (tuple, list)):
        return type(first)(nested_concat([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, Mapping):
        return {k: nested_concat([p[k] for p in parts]) for k in first}
    return pad_concat(parts)


def nested_unshard(per_rank: list, batch_size: int, num_examples: int):
    first = per_rank[0]
    if first is None:
        return None
    if isinstance(first, (tuple, list)):
        return type(first)(nested_unshard([p[i] for p in per_rank], batch_size, num_examples)
                           for i in range(len(first)))
    if isinstance(first, Mapping):
        return {k: nested_unshard([p[k] for p in per_rank], batch_size, num_examples) for k in first}
    # the ranks' arrays may differ past dim 0 (variable lengths): pad them to one shape first
    tail = tuple(max(s) for s in zip(*(a.shape[1:] for a in per_rank))) if first.ndim > 1 else ()
    padded = [_pad_to(a, (a.shape[0], *tail)) if tail else a for a in per_rank]
    return unshard(padded, batch_size, num_examples)


class _Accumulator:
    """One output's device-side parts, moved to host numpy when flushed."""

    def __init__(self):
        self.device_parts: list = []

    def add(self, value) -> None:
        if value is not None:
            self.device_parts.append(value)

    def take(self) -> list:
        """The parts so far, on the host; the accumulator is empty after."""
        parts, self.device_parts = self.device_parts, []
        return [_to_numpy(p) for p in parts]


class _Gatherer:
    """The outputs' parts go to rank 0 at every flush -- every ``eval_accumulation_steps`` steps when set and
    every rank runs the same steps (raytrainer's evaluation loader), else once at the end -- so a rank other
    than 0 holds at most one flush's predictions, and rank 0 receives them as the evaluation goes rather than
    in one object at the end. Rank 0 keeps each rank's parts in rank order for ``nested_unshard``."""

    def __init__(self, ctx, accumulators: list[_Accumulator], every: int | None):
        self.ctx, self.accumulators, self.every = ctx, accumulators, every
        # data-parallel rank -> output -> parts: the ranks of one tensor-parallel group read the same batches
        # and compute the same outputs, which its first rank alone sends
        self.per_rank = [[[] for _ in accumulators] for _ in range(ctx.dp_size)]

    def step_done(self, step: int) -> None:
        if self.every and (step + 1) % self.every == 0:
            self.flush()

    def flush(self) -> None:
        mine = [acc.take() for acc in self.accumulators]
        gathered = self.ctx.gather_object(mine if self.ctx.is_dp_leader else None)
        for rank, outputs in enumerate(gathered or []):
            if outputs is None:
                continue
            for parts, new in zip(self.per_rank[rank // self.ctx.model_parallel], outputs):
                parts.extend(new)

    def results(self) -> list[list] | None:
        """On rank 0: for each output, every rank's concatenated parts (None where it had none)."""
        self.flush()
        if not self.ctx.is_world_zero:
            return None
        return [[nested_concat(rank[i]) if rank[i] else None for rank in self.per_rank]
                for i in range(len(self.accumulators))]


def evaluation_loop(trainer, dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix):
    args, ctx = trainer.args, trainer._ctx
    prediction_loss_only = args.prediction_loss_only if prediction_loss_only is None else prediction_loss_only
    adapt_mean_losses(trainer)
    model = trainer._strategy.eval_model(trainer.model_wrapped)
    model.eval()
    if hasattr(trainer.optimizer, "eval") and callable(trainer.optimizer.eval):
        trainer.optimizer.eval()  # a schedule-free optimizer evaluates its averaged weights (transformers)
    handler = trainer.callback_handler
    handler.eval_dataloader = dataloader
    include = set(args.include_for_metrics or [])
    console.announce_evaluation(trainer, description, dataloader)

    # batch_eval_metrics: compute_metrics per batch (compute_result=True on the last), as transformers. In one
    # process it streams (evaluation keeps no predictions); across ranks it runs on rank 0, batch by batch
    # over the gathered predictions in dataset order.
    batched = args.batch_eval_metrics and trainer.compute_metrics is not None
    stream = batched and not ctx.distributed
    keep_preds = not (stream and description != "Prediction")
    n_batches = len(dataloader) if stream else None
    batch_metrics, seen = None, 0
    accumulators = [_Accumulator() for _ in range(4)]
    losses, preds, labels, inputs_acc = accumulators
    # a loader of the user's own (get_eval_dataloader overridden) may give ranks different step counts
    every = args.eval_accumulation_steps if _is_raytrainers_loader(dataloader) else None
    gatherer = _Gatherer(ctx, accumulators, every)
    for step, inputs in enumerate(dataloader):
        batch_inputs = inputs.get("input_ids") if "inputs" in include else None
        loss, logits, label_ids = trainer.prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        batch_size = batch_size_of(inputs)
        seen += batch_size
        batch_losses = loss.detach().reshape(1).repeat(batch_size) if loss is not None else None
        losses.add(batch_losses)
        if logits is not None and trainer.preprocess_logits_for_metrics is not None:
            logits = trainer.preprocess_logits_for_metrics(logits, label_ids)
        if stream and logits is not None and label_ids is not None:
            batch_metrics = trainer.compute_metrics(EvalPrediction(
                predictions=logits, label_ids=label_ids, inputs=batch_inputs,
                losses=batch_losses if "loss" in include else None), compute_result=step == n_batches - 1)
        if keep_preds:
            preds.add(logits)
            labels.add(label_ids)
            inputs_acc.add(batch_inputs)
        gatherer.step_done(step)
        trainer.control = handler.on_prediction_step(args, trainer.state, trainer.control)

    num_examples = _num_real_examples(dataloader)
    if num_examples is None:  # a loader of the user's own (get_eval_dataloader overridden): what it yielded
        num_examples = int(ctx.sum([float(seen)])[0]) // ctx.model_parallel
    gathered = gatherer.results()

    metrics = None
    if ctx.is_world_zero:
        batch_size = getattr(dataloader, "batch_size", None) or args.eval_batch_size
        all_losses, all_preds, all_labels, all_inputs = (
            nested_unshard(per_rank, batch_size, num_examples) for per_rank in gathered)
        mean_loss = _mean_loss(trainer, all_losses, batch_size)
        if not args.eval_do_concat_batches:  # transformers' lists, one entry per batch (of one process)
            all_losses, all_preds, all_labels, all_inputs = (
                _per_batch(x, batch_size) for x in (all_losses, all_preds, all_labels, all_inputs))
        metrics = {}
        if stream:
            metrics = dict(batch_metrics or {})
        elif batched and all_preds is not None and all_labels is not None:
            metrics = _metrics_by_batch(trainer, all_preds, all_labels, all_inputs, all_losses, include,
                                        getattr(dataloader, "batch_size", None) or args.eval_batch_size)
        elif (trainer.compute_metrics is not None and all_preds is not None and all_labels is not None):
            eval_pred = EvalPrediction(
                predictions=all_preds, label_ids=all_labels,
                inputs=all_inputs if "inputs" in include else None,
                losses=all_losses if "loss" in include else None,
            )
            metrics = dict(trainer.compute_metrics(eval_pred))
        metrics = denumpify_detensorize(metrics)
        if mean_loss is not None:
            metrics[f"{metric_key_prefix}_loss"] = mean_loss
        for key in list(metrics):
            if not key.startswith(f"{metric_key_prefix}_"):
                metrics[f"{metric_key_prefix}_{key}"] = metrics.pop(key)
    else:
        all_preds = all_labels = None
    metrics = ctx.broadcast_object(metrics)
    return EvalLoopOutput(predictions=all_preds, label_ids=all_labels, metrics=metrics,
                          num_samples=num_examples)


def _mean_loss(trainer, losses, batch_size: int) -> float | None:
    """``eval_loss`` as transformers computes it from one row per example: non-finite rows left out with
    ``logging_nan_inf_filter`` (unless all are); a ``Seq2SeqTrainer``'s (``loss_per_batch``) is the mean of
    its batches' losses, as transformers' Seq2SeqTrainer gathers without dropping rows: each batch counts
    ``eval_batch_size`` times there, the last, shorter one too."""
    if losses is None or not len(losses):
        return None
    if getattr(trainer, "loss_per_batch", False):
        losses = losses[::batch_size]  # the rows of a batch all hold its loss
    finite = np.isfinite(losses)
    if trainer.args.logging_nan_inf_filter and finite.any():
        losses = losses[finite]
    return float(np.mean(losses))


def _rows(x, sl):
    if x is None:
        return None
    if isinstance(x, (tuple, list)):
        return type(x)(_rows(v, sl) for v in x)
    if isinstance(x, Mapping):
        return {k: _rows(v, sl) for k, v in x.items()}
    return x[sl]


def _per_batch(x, batch_size: int) -> list | None:
    """Dataset-ordered outputs cut back into the batches one process would have seen."""
    if x is None:
        return None
    first = x
    while isinstance(first, (tuple, list, Mapping)):
        first = next(iter(first.values())) if isinstance(first, Mapping) else first[0]
    return [_rows(x, slice(i, i + batch_size)) for i in range(0, len(first), batch_size)]


def _slice(x, sl):
    if x is None:
        return None
    if isinstance(x, (tuple, list)):
        return type(x)(_slice(v, sl) for v in x)
    if isinstance(x, Mapping):
        return {k: _slice(v, sl) for k, v in x.items()}
    return torch.from_numpy(np.ascontiguousarray(x[sl]))


def _metrics_by_batch(trainer, preds, labels, inputs, losses, include, batch_size: int) -> dict:
    """batch_eval_metrics over gathered predictions: compute_metrics on consecutive batches (as tensors,
    as transformers passes them), compute_result=True on the last."""
    first = labels
    while isinstance(first, (tuple, list, Mapping)):
        first = next(iter(first.values())) if isinstance(first, Mapping) else first[0]
    n = len(first)
    result = {}
    for start in range(0, n, batch_size):
        sl = slice(start, start + batch_size)
        result = trainer.compute_metrics(EvalPrediction(
            predictions=_slice(preds, sl), label_ids=_slice(labels, sl),
            inputs=_slice(inputs, sl) if "inputs" in include else None,
            losses=_slice(losses, sl) if "loss" in include else None), compute_result=start + batch_size >= n)
    return dict(result or {})


def _is_raytrainers_loader(dataloader) -> bool:
    """Whether ``dataloader`` is raytrainer's evaluation loader (every rank runs the same number of steps)."""
    return hasattr(getattr(dataloader, "sampler", None), "num_examples") or hasattr(
        getattr(dataloader, "dataset", None), "num_real")


def _num_real_examples(dataloader) -> int | None:
    """The real examples of raytrainer's evaluation loader (a stream's are counted as it is read: known
    after the loop); None: a loader of the user's own."""
    sampler = getattr(dataloader, "sampler", None)
    if hasattr(sampler, "num_examples"):
        return sampler.num_examples
    dataset = getattr(dataloader, "dataset", None)
    return dataset.num_real if hasattr(dataset, "num_real") else None
