"""The loss a model returned, and which label positions a loss counts (transformers'
``num_items_in_batch``). Label smoothing is transformers' ``LabelSmoother``."""

from __future__ import annotations

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
