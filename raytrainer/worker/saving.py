"""Writing model files and ``checkpoint-<step>`` folders from a rank.

``save_model_files`` writes consolidated weights: through ``save_pretrained`` when the model has it,
else ``model.safetensors`` (shared tensors are written once each, so tied weights load back).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

WEIGHTS_NAME = "model.safetensors"
TRAINING_ARGS_NAME = "training_args.json"
TRAINER_STATE_NAME = "trainer_state.json"


def _dedupe_shared(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    seen: dict[tuple, str] = {}
    out = {}
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen[key] = name
        out[name] = tensor.contiguous()
    return out


def save_model_files(model, output_dir: str, state_dict, processing_class, args) -> None:
    os.makedirs(output_dir, exist_ok=True)
    if state_dict is None:
        state_dict = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
    else:
        path = os.path.join(output_dir, WEIGHTS_NAME)
        save_file(_dedupe_shared(state_dict), path, metadata={"format": "pt"})
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(output_dir)
    with open(os.path.join(output_dir, TRAINING_ARGS_NAME), "w") as f:
        f.write(args.to_json_string())


def save_checkpoint(trainer, trial=None) -> str:
    """Write ``output_dir/checkpoint-<global_step>``: weights, optimizer, scheduler, trainer state."""
    args, state = trainer.args, trainer.state
    folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
    trainer.save_model(folder, _internal_call=True)
    if trainer.is_world_process_zero():
        if not args.save_only_model:
            torch.save(trainer.optimizer.state_dict(), os.path.join(folder, "optimizer.pt"))
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(folder, "scheduler.pt"))
        state.save_to_json(os.path.join(folder, TRAINER_STATE_NAME))
        with open(os.path.join(folder, TRAINING_ARGS_NAME), "w") as f:
            json.dump(args.to_dict(), f, indent=2, sort_keys=True)
    return folder
