"""Writing a model's files: what ``save_model()`` and every checkpoint hold.

``save_model_files`` writes consolidated weights: through ``save_pretrained`` when the model has it,
else ``model.safetensors`` (shared tensors are written once each, so tied weights load back), and the
arguments twice: ``training_args.json`` (readable) and transformers' ``training_args.bin`` (``torch.save``
of the arguments, what scripts and tools built for transformers.Trainer load). Neither holds a secret:
tokens are hidden and the storage filesystem object, whose options may hold credentials, is left out.
raytrainer never unpickles the ``.bin`` itself.
"""

from __future__ import annotations

import copy
from dataclasses import fields

import torch

WEIGHTS_NAME = "model.safetensors"
TRAINING_ARGS_NAME = "training_args.json"
TRAINING_ARGS_BIN = "training_args.bin"  # transformers' TRAINING_ARGS_NAME
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


def peft_saved_keys(model, state_dict: dict) -> list[str] | None:
    """The keys of ``state_dict`` that ``model.save_pretrained`` keeps for a PEFT model (every adapter's, and
    its ``modules_to_save``), found by PEFT's own selection without reading a value: a sharded state's base
    need not be gathered to save an adapter. None where PEFT's selection makes tensors of its own (then it
    needs the whole state)."""
    kept = set()
    for adapter in model.peft_config:
        names = peft_saved_names(model, state_dict, adapter)
        if names is None:
            return None
        kept.update(names.values())
    return [k for k in state_dict if k in kept]


def peft_saved_names(model, state_dict: dict, adapter: str | None = None) -> dict[str, str] | None:
    """The name each tensor of ``adapter`` (the first when None) has in the file PEFT saves
    (``adapter_model.safetensors``) -> its key in ``state_dict``, by PEFT's own selection without reading a
    value; None where that selection makes tensors of its own."""
    import warnings

    from peft import get_peft_model_state_dict

    key_of = {id(v): k for k, v in state_dict.items()}
    with warnings.catch_warnings():  # PEFT warns again when it saves
        warnings.simplefilter("ignore")
        selected = get_peft_model_state_dict(model, state_dict=state_dict,
                                             adapter_name=adapter or next(iter(model.peft_config)))
    if any(id(tensor) not in key_of for tensor in selected.values()):
        return None
    return {name: key_of[id(tensor)] for name, tensor in selected.items()}


def peft_state_gathered(model) -> dict[str, torch.Tensor] | None:
    """What ``model.save_pretrained`` saves of a PEFT model whose weights are sharded (FSDP2's DTensors):
    its adapters alone gathered to a CPU copy on every rank (a collective; a few MB), the frozen base, the
    size of the model, never. None for a model that is not PEFT's, or where PEFT's selection needs the
    whole state (``peft_saved_keys``)."""
    if not hasattr(model, "peft_config"):
        return None
    from torch.distributed.tensor import DTensor

    sharded = model.state_dict()  # DTensors: nothing gathered
    keys = peft_saved_keys(model, sharded)
    if keys is None:
        return None
    return {k: (sharded[k].full_tensor() if isinstance(sharded[k], DTensor) else sharded[k]).detach().cpu()
            for k in keys}


def without_secrets(args, fallback=None):
    """A shallow copy of ``args`` without its tokens and storage filesystem object (set back to None), of
    a class ``pickle`` can name: the arguments' own, else the nearest base class that is (an arguments
    class made inside a function, or one whose name is not where it was defined, would otherwise fail
    every save)."""
    clone = copy.copy(args)
    for f in fields(args):
        if f.name == "storage_filesystem" or f.name.endswith("_token"):
            object.__setattr__(clone, f.name, None)
    for cls in type(args).__mro__[:-1]:  # not object: an instance of it holds no field
        if _importable(cls):
            clone.__class__ = cls
            return clone
    return clone if fallback is None else without_secrets(fallback)


def _importable(cls) -> bool:
    """``pickle`` finds ``cls`` again by its module and qualified name."""
    import importlib

    try:
        found = importlib.import_module(cls.__module__)
        for part in cls.__qualname__.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return False
    return found is cls
