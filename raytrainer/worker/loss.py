"""Label-smoothed cross entropy over a model's logits (``label_smoothing_factor``), as HF computes it; which
label positions a loss counts (transformers' ``num_items_in_batch``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def label_smoothed_loss(outputs, labels: torch.Tensor, epsilon: float, ignore_index: int = -100):
    logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
    log_probs = -torch.nn.functional.log_softmax(logits, dim=-1)
    if labels.dim() == log_probs.dim() - 1:
        labels = labels.unsqueeze(-1)
    padding = labels.eq(ignore_index)
    labels = torch.clamp(labels, min=0)
    nll = log_probs.gather(dim=-1, index=labels).masked_fill(padding, 0.0)
    smoothed = log_probs.sum(dim=-1, keepdim=True, dtype=torch.float32).masked_fill(padding, 0.0)
    active = padding.numel() - padding.long().sum()
    nll = nll.sum() / active
    smoothed = smoothed.sum() / (active * log_probs.shape[-1])
    return (1 - epsilon) * nll + epsilon * smoothed


class LabelSmoother:
    """``trainer.label_smoother`` (transformers' name and call), for a subclass's own ``compute_loss``:
    ``smoother(outputs, labels, shift_labels=False)``."""

    def __init__(self, epsilon: float = 0.1, ignore_index: int = -100):
        self.epsilon, self.ignore_index = epsilon, ignore_index

    def __call__(self, model_output, labels: torch.Tensor, shift_labels: bool = False) -> torch.Tensor:
        logits = model_output["logits"] if isinstance(model_output, Mapping) else model_output[0]
        if shift_labels:
            logits, labels = logits[..., :-1, :].contiguous(), labels[..., 1:].contiguous()
        return label_smoothed_loss((logits,), labels, self.epsilon, self.ignore_index)


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
