"""A PEFT model's checkpoints under FSDP hold its adapter once: PEFT's files, which every rank resumes from.

transformers' ``_save_checkpoint`` under FSDP writes the model twice: ``save_model`` (PEFT's
``adapter_model.safetensors`` under ``FULL_STATE_DICT``; nothing under ``SHARDED_STATE_DICT``) and, for the
resume, accelerate's ``save_fsdp_model`` (``pytorch_model_fsdp_0/`` or ``pytorch_model_fsdp.bin``: the
adapter again, ``adapter_only``). A hosted rank (worker/hosted.py) writes it once:

- inside a checkpoint save, ``save_fsdp_model`` of a model with one PEFT adapter writes nothing more where
  ``save_model`` wrote PEFT's files, and under ``SHARDED_STATE_DICT`` writes them itself (the adapters alone
  gathered: saving.peft_state_gathered, a few MB; the frozen base, the size of the model, never);
- a resume (``_load_from_checkpoint``) or ``load_best_model_at_end`` (``_load_best_model``) of such a folder
  under FSDP reads ``adapter_model.safetensors`` on every rank and hands each its shards of the adapter
  (torch's ``set_model_state_dict`` of the whole tensors, the base left as it is), on any world size.
  PEFT's own ``load_adapter``, which transformers calls for a folder without FSDP's files, copies whole
  tensors into FSDP2's DTensors and fails.

A folder with FSDP's files (another adapter count, a model PEFT's selection must read whole, a checkpoint
transformers wrote) is read by transformers' own load. tests/unit/test_hosted_adapter.py pins how
transformers calls accelerate's save and load.
"""

from __future__ import annotations

import contextlib
import functools
import os

_LOADS = ("_load_from_checkpoint", "_load_best_model")


def _single_adapter(model) -> bool:
    """``model`` (unwrapped) is a PEFT model with one adapter: its checkpoint folder's PEFT files are it."""
    return len(getattr(model, "peft_config", None) or {}) == 1


@contextlib.contextmanager
def adapter_once(trainer):
    """Meanwhile (a checkpoint save under FSDP) accelerate's ``save_fsdp_model``, as transformers'
    ``_save_optimizer_and_scheduler`` calls it, writes a single-adapter PEFT model's files only (above)."""
    import transformers.trainer as hf_trainer

    save_fsdp_model = hf_trainer.save_fsdp_model

    def save_adapter_once(fsdp_plugin, accelerator, model, output_dir, *args, **kwargs):
        from raytrainer.saving import peft_state_gathered

        unwrapped = accelerator.unwrap_model(model)
        if not _single_adapter(unwrapped):
            return save_fsdp_model(fsdp_plugin, accelerator, model, output_dir, *args, **kwargs)
        if "FULL_STATE_DICT" in str(fsdp_plugin.state_dict_type):
            return None  # transformers' save_model has written PEFT's files, gathered as this would
        adapter = peft_state_gathered(unwrapped)  # a collective: every rank
        if adapter is None:
            return save_fsdp_model(fsdp_plugin, accelerator, model, output_dir, *args, **kwargs)
        if trainer.args.should_save:
            trainer._save(output_dir, state_dict=adapter)
        return None

    hf_trainer.save_fsdp_model = save_adapter_once
    try:
        yield
    finally:
        hf_trainer.save_fsdp_model = save_fsdp_model


@contextlib.contextmanager
def reading_adapters(trainer):
    """Meanwhile (a ``train()`` call under FSDP) ``trainer`` resumes a single-adapter PEFT model from PEFT's
    files, and loads the best one from them at the end (above)."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        yield
        return
    previous = {name: trainer.__dict__.get(name) for name in _LOADS}  # the layer's own wrappers, if any
    for name in _LOADS:
        setattr(trainer, name, functools.partial(_adapter_or, getattr(trainer, name), trainer, name))
    try:
        yield
    finally:
        for name, method in previous.items():
            if method is None:
                trainer.__dict__.pop(name, None)
            else:
                setattr(trainer, name, method)


def _adapter_or(load, trainer, name: str, *args, **kwargs):
    folder = (args[0] if args else kwargs.get("resume_from_checkpoint")) if name == "_load_from_checkpoint" \
        else trainer.state.best_model_checkpoint
    model = trainer.model if name != "_load_from_checkpoint" or len(args) < 2 else (args[1] or trainer.model)
    if not _has_adapter_only(folder) or not _single_adapter(trainer.accelerator.unwrap_model(model)):
        return load(*args, **kwargs)
    load_adapter(model, folder)
    return None


def _has_adapter_only(folder) -> bool:
    """``folder`` holds PEFT's adapter file and none of FSDP's model files."""
    from accelerate.utils.constants import FSDP_MODEL_NAME
    from transformers.utils import ADAPTER_SAFE_WEIGHTS_NAME

    if folder is None or not os.path.isfile(os.path.join(folder, ADAPTER_SAFE_WEIGHTS_NAME)):
        return False
    return not any(entry.startswith(FSDP_MODEL_NAME) for entry in os.listdir(folder))


def load_adapter(model, folder: str) -> None:
    """The adapter of PEFT's ``adapter_model.safetensors`` in ``folder`` loaded into ``model`` (an FSDP2
    module around a PEFT model, or a plain one): every rank reads the file, each keeps its shards."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers.utils import ADAPTER_SAFE_WEIGHTS_NAME

    from raytrainer.saving import peft_saved_names

    saved = load_file(os.path.join(folder, ADAPTER_SAFE_WEIGHTS_NAME))
    state = model.state_dict()  # DTensors under FSDP2: nothing gathered
    names = peft_saved_names(model, state)
    if names is None or set(saved) - set(names):
        unknown = sorted(set(saved) - set(names or {}))[:3]
        raise ValueError(f"{folder}: the adapter file's tensors {unknown} are not this model's adapter; "
                         "resume it with the model and LoRA configuration that saved it.")
    loaded = {names[k]: tensor.to(state[names[k]].dtype) for k, tensor in saved.items()}
    set_model_state_dict(model, loaded, options=StateDictOptions(full_state_dict=True, strict=False))
