"""The model card (``README.md``) ``create_model_card`` and ``push_to_hub`` write: transformers' own
(``transformers.Trainer.create_model_card``: ``TrainingSummary.from_trainer``), from the driver's arguments
and log history.

The driver's ``args`` are rank 0's view of the run (``world_size`` is ``num_workers``), so the card's
``distributed_type`` / ``num_devices`` / total batch sizes are those of the same run under ``torchrun``.
The one difference: transformers reads ``trainer.model.config`` unguarded, so with a plain ``nn.Module``
(which its Trainer also accepts) it fails; here such a model is seen as one whose ``config`` is None (no
``base_model`` inferred from it, the task still from its class name).
"""

from __future__ import annotations

import os
import types

import transformers


def _as_transformers_sees_it(trainer):
    """``trainer``, or, for a model without ``config``, a view of it whose model has ``config = None``."""
    model = trainer.model
    if hasattr(model, "config"):
        return trainer
    stand_in = type(type(model).__name__, (), {"config": None})()
    return types.SimpleNamespace(
        model=stand_in, args=trainer.args, state=trainer.state, train_dataset=trainer.train_dataset,
        eval_dataset=trainer.eval_dataset, is_world_process_zero=trainer.is_world_process_zero)


def create_model_card(trainer, **kwargs) -> None:
    """transformers' ``Trainer.create_model_card`` for ``trainer`` (``output_dir`` is made first)."""
    if trainer.is_world_process_zero():
        os.makedirs(trainer.args.output_dir, exist_ok=True)
    transformers.Trainer.create_model_card(_as_transformers_sees_it(trainer), **kwargs)
