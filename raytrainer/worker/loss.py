"""Which label positions a loss counts (transformers' ``num_items_in_batch``). Label smoothing is
transformers' ``LabelSmoother``."""

from __future__ import annotations

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
