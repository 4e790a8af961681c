"""NEFTune: uniform noise on the input embeddings while training (``neftune_noise_alpha``).

The noise is drawn from U(-m, m) with m = alpha / sqrt(seq_len * dim), added by a forward hook on the
input embedding module only in training mode; the hook is registered when training starts (before the
model is wrapped, so DDP and FSDP alike see it) and removed when it ends.
"""

from __future__ import annotations

import torch


def input_embeddings(model: torch.nn.Module) -> torch.nn.Module:
    """``get_input_embeddings()`` when the model has it, else its only ``nn.Embedding``."""
    if hasattr(model, "get_input_embeddings"):
        return model.get_input_embeddings()
    found = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    if len(found) != 1:
        raise ValueError(
            f"neftune_noise_alpha needs the model's input embeddings: {type(model).__name__} has "
            f"{len(found)} nn.Embedding modules and no get_input_embeddings(). Define get_input_embeddings() "
            "on the model, or unset neftune_noise_alpha."
        )
    return found[0]


