"""Label-smoothed cross entropy over a model's logits (``label_smoothing_factor``), as HF computes it."""

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
