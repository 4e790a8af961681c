"""Writing a model's files: what ``save_model()`` and every checkpoint hold.

``save_model_files`` writes consolidated weights: through ``save_pretrained`` when the model has it,
else ``model.safetensors`` (shared tensors are written once each, so tied weights load back).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file

WEIGHTS_NAME = "model.safetensors"
TRAINING_ARGS_NAME = "training_args.json"
TRAINER_STATE_NAME = "trainer_state.json"


def dedupe_shared(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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
        save_file(dedupe_shared(state_dict), path, metadata={"format": "pt"})
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(output_dir)
    with open(os.path.join(output_dir, TRAINING_ARGS_NAME), "w") as f:
        f.write(args.to_json_string())
