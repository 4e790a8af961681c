"""The loss a model returned, and which label positions a loss counts (transformers'
``num_items_in_batch``). Label smoothing is transformers' ``LabelSmoother``."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch


def loss_shifts_labels(model) -> bool:
    """transformers' rule: a causal-LM loss (``ForCausalLMLoss``, not an encoder-decoder) predicts label i+1
    at position i, so position 0 of each row is never a target and is not counted."""
    loss_type = getattr(model, "loss_type", None)
    if loss_type is None or getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return False
    return LOSS_MAPPING.get(loss_type) is ForCausalLMLoss


def label_targets(batch, shifted: bool) -> torch.Tensor:
    """The label positions transformers counts: ``shift_labels`` when the batch has them, else
    ``labels[..., 1:]`` for a loss that shifts, else ``labels``."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    return batch["labels"][..., 1:] if shifted else batch["labels"]


def loss_from_outputs(outputs, model) -> torch.Tensor:
    """The loss a model returned, where transformers' ``compute_loss`` takes it: first element of a tuple,
    ``loss`` of a dict."""
    loss = None
    if isinstance(outputs, Mapping) or hasattr(outputs, "keys"):
        loss = outputs.get("loss") if hasattr(outputs, "get") else None
        found = list(outputs.keys())
    elif isinstance(outputs, (tuple, list)):
        loss = outputs[0] if outputs else None
        found = f"a {type(outputs).__name__} of {len(outputs)}"
    else:  # a bare tensor too: transformers.Trainer takes the loss from a dict or a tuple only
        found = type(outputs).__name__
    if not isinstance(loss, torch.Tensor) or loss.ndim > 1 or (loss.ndim == 1 and loss.numel() != 1):
        raise ValueError(
            f"{type(model).__name__} returned no loss (it returned {found}). Return the loss first in a "
            "tuple or under 'loss' in a dict when labels are given, or override Trainer.compute_loss / "
            "pass compute_loss_func."
        )
    return loss


# -- losses that are a mean --------------------------------------------------------------------------------
# transformers' accounting assumes that a model which accepts loss kwargs (or a ``compute_loss_func``)
# divides its summed loss by ``num_items_in_batch``, the label count of the whole step (all micro-batches of
# the accumulation window and, with ``average_tokens_across_devices``, all data-parallel ranks): it then
# neither divides the loss by the accumulation steps nor leaves it per rank (``compute_loss`` multiplies it by
# the ranks, which the gradient all-reduce averages away). A loss that is a mean over its batch's labels
# (BERT's sequence or token classification, a user's ``compute_loss_func`` that ignores the count) is then
# multiplied by the ranks and by the accumulation steps. Which kind a loss is, is found by asking it: the
# same batch with the count and with twice the count (once per model, under ``no_grad``, in eval mode, on
# the first batch that carries labels and a count); a mean is then given the form transformers assumes,
# ``mean x (this batch's labels / num_items_in_batch)``, its share of the step's sum. The step's loss and
# gradient are then the mean over the global batch's labels, as in one process, on any number of workers
# and with any accumulation.

UNDECIDED, MEAN, NORMALISED = 0, 1, 2


def _loss_value(outputs) -> torch.Tensor | None:
    if isinstance(outputs, Mapping) or hasattr(outputs, "keys"):
        loss = outputs.get("loss") if hasattr(outputs, "get") else None
    elif isinstance(outputs, (tuple, list)) and outputs:
        loss = outputs[0]
    else:
        loss = outputs
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def _kind(first: torch.Tensor | None, doubled: torch.Tensor | None) -> int:
    """A loss given the count n (``first``) and 2n (``doubled``): the same value for a mean, another for a
    loss divided by the count; undecided when there is nothing to compare (no loss, 0, not finite)."""
    if first is None or doubled is None:
        return UNDECIDED
    a, b = float(first.detach().float()), float(doubled.detach().float())
    if not (math.isfinite(a) and math.isfinite(b)) or a == b == 0:
        return UNDECIDED
    return MEAN if abs(a - b) <= 1e-6 * max(abs(a), abs(b)) else NORMALISED


def _as_share(loss: torch.Tensor, counted: torch.Tensor, num_items) -> torch.Tensor:
    """A mean over ``counted`` labels as its share of a sum divided by ``num_items``."""
    if torch.is_tensor(num_items):
        num_items = num_items.to(loss.device)
    return loss * (counted.to(loss.device) / num_items)


def _agree(kind: int, device) -> int:
    """The kind every rank uses: a rank that found a normalised loss wins, then a mean (the ranks run the
    same model; only a batch with nothing to compare leaves a rank undecided). One all-reduce of one
    integer, at the first training forward."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return kind
    found = torch.tensor([kind], dtype=torch.int64, device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return int(found.item())


class MeanLossForward:
    """A model's ``forward`` (set on the instance; ``__wrapped__`` is the one it replaces, so signatures
    read through it) that turns a loss found to be a mean into its share of the step's sum. Pickles and
    deep-copies with its model."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.__wrapped__ = module.forward  # the class's forward, or an instance wrapper already there
        self.shifted = loss_shifts_labels(module)
        self.kind: int | None = None  # None: not asked yet
        self.agreed = False

    def __call__(self, *args, **kwargs):
        num_items = kwargs.get("num_items_in_batch")
        if num_items is None or (self.kind == NORMALISED and self.agreed) or not _has_labels(kwargs):
            return self.__wrapped__(*args, **kwargs)
        if self.kind is None:
            self.kind = self._ask(args, kwargs, num_items)
        if not self.agreed and torch.is_grad_enabled():
            # training: every rank runs this forward (also a rank that answered in an evaluation before)
            labels = kwargs["labels"] if torch.is_tensor(kwargs.get("labels")) else kwargs["shift_labels"]
            self.kind, self.agreed = _agree(self.kind, labels.device), True
        outputs = self.__wrapped__(*args, **kwargs)
        loss = _loss_value(outputs)
        if self.kind != MEAN or loss is None:
            return outputs
        counted = label_targets(kwargs, self.shifted).ne(-100).sum()
        return _with_loss(outputs, _as_share(loss, counted, num_items))

    def _ask(self, args, kwargs, num_items) -> int:
        """The loss of this batch with the count and with twice it: no gradient, dropout off, the random
        state left as it was (the training forward that follows draws what it would have)."""
        modes = [(m, m.training) for m in self.module.modules()]
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else []
        try:
            self.module.eval()
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                first = _loss_value(self.__wrapped__(*args, **kwargs))
                doubled = {**kwargs, "num_items_in_batch": num_items * 2}
                doubled = _loss_value(self.__wrapped__(*args, **doubled))
        finally:
            for m, training in modes:
                m.training = training
        return _kind(first, doubled)


class MeanLossFunc:
    """A ``compute_loss_func`` that turns a loss found to be a mean into its share of the step's sum (asked
    as ``MeanLossForward`` asks a model, without a forward: the function alone is called twice more, without
    gradient, on the first batch that has labels and a count; once per trainer)."""

    def __init__(self, func, shifted: bool):
        self.__wrapped__, self.shifted = func, shifted
        self.kind: int | None = None

    def __call__(self, outputs, labels, num_items_in_batch=None, **kwargs):
        func = self.__wrapped__
        if num_items_in_batch is None or labels is None or self.kind == NORMALISED:
            return func(outputs, labels, num_items_in_batch=num_items_in_batch, **kwargs)
        if self.kind is None:
            with torch.no_grad():
                self.kind = _kind(_loss_value(func(outputs, labels, num_items_in_batch=num_items_in_batch,
                                                   **kwargs)),
                                  _loss_value(func(outputs, labels, num_items_in_batch=num_items_in_batch * 2,
                                                   **kwargs)))
        loss = func(outputs, labels, num_items_in_batch=num_items_in_batch, **kwargs)
        if self.kind != MEAN or not isinstance(loss, torch.Tensor) or not torch.is_tensor(labels):
            return loss
        counted = label_targets({"labels": labels}, self.shifted).ne(-100).sum()
        return _as_share(loss, counted, num_items_in_batch)


def _has_labels(kwargs) -> bool:
    return torch.is_tensor(kwargs.get("labels")) or torch.is_tensor(kwargs.get("shift_labels"))


def _with_loss(outputs, loss: torch.Tensor):
    if isinstance(outputs, tuple) and not hasattr(outputs, "_fields"):
        return (loss, *outputs[1:])
    if isinstance(outputs, list):
        return [loss, *outputs[1:]]
    if type(outputs) is dict:
        return {**outputs, "loss": loss}
    outputs["loss"] = loss  # a ModelOutput (or another mapping): sets the attribute too
    return outputs


def adapt_mean_losses(trainer) -> None:
    """Give the model a trainer trains (and its ``compute_loss_func``) the mean-loss handling above, once
    per model: where transformers passes ``num_items_in_batch`` (the model accepts loss kwargs; a
    ``compute_loss_func``). Any ``transformers.Trainer`` on a rank, and raytrainer's own."""
    model = getattr(trainer, "model", None)
    if isinstance(model, torch.nn.Module) and trainer.model_accepts_loss_kwargs \
            and not isinstance(vars(model).get("forward"), MeanLossForward):
        model.forward = MeanLossForward(model)
    func = getattr(trainer, "compute_loss_func", None)
    if func is not None and not isinstance(func, MeanLossFunc):
        trainer.compute_loss_func = MeanLossFunc(func, isinstance(model, torch.nn.Module)
                                                 and loss_shifts_labels(model))
