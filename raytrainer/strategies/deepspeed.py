"""DeepSpeed ZeRO checkpoints resumed on any number of workers, in transformers' loop.

transformers and accelerate run DeepSpeed on the ranks (``TrainingArguments(deepspeed=<path or dict>)``;
"auto" values filled by transformers; the driver checks the config first: deepspeed_config.check_config).
What raytrainer adds:

- Checkpoints are the engine's own format in ``checkpoint-<step>/global_step<step>/`` (every rank writes its
  ZeRO partition) written in the background: the step waits for a host copy, a thread writes it
  (``deepspeed_writes``, set by worker/hosted_saves.py).
- A ZeRO checkpoint resumes on the same number of workers as transformers resumes it; on another number
  rank 0 first converts it with DeepSpeed's ``ds_to_universal`` and every rank loads its new partition from
  the universal folder (``resuming_on_any_world_size``, around transformers' ``deepspeed_load_checkpoint``),
  where DeepSpeed's own loader refuses. DeepSpeed's loaders run under ``deepspeed_load.weights_only_loads``:
  nothing in the files is executed. The driver says beforehand that it will convert
  (strategies.check_resume, from ``partitions``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile

import torch

from raytrainer.strategies.deepspeed_load import weights_only_loads

logger = logging.getLogger(__name__)

_PARTITION = "_optim_states.pt"


@contextlib.contextmanager
def resuming_on_any_world_size(args, ctx):
    """Meanwhile transformers' DeepSpeed resume (``deepspeed_load_checkpoint``, called by its
    ``_inner_training_loop``) also takes a ZeRO checkpoint written by another number of ranks, which
    DeepSpeed's own loader refuses ("Automatic adjustment of ZeRO's optimizer state partitioning with a new
    world size is not currently supported"): rank 0 converts it with DeepSpeed's ``ds_to_universal`` and
    every rank loads its new partition from the universal folder (``_load_resharded``). A checkpoint of as
    many ranks loads as transformers loads it. ``args``: the run's arguments (its storage)."""
    from transformers import trainer as hf_trainer

    own = hf_trainer.deepspeed_load_checkpoint

    def load(engine, checkpoint_path, load_module_strict=True):
        tag = _latest_tag(checkpoint_path)
        if tag is None:  # transformers names what is missing
            return own(engine, checkpoint_path, load_module_strict=load_module_strict)
        saved = [n for n in os.listdir(os.path.join(checkpoint_path, tag)) if n.endswith(_PARTITION)]
        if not saved or len(saved) == ctx.world_size:
            return own(engine, checkpoint_path, load_module_strict=load_module_strict)
        logger.info("a ZeRO checkpoint of %d ranks on %d: converting it to DeepSpeed's universal format",
                    len(saved), ctx.world_size)
        return _load_resharded(engine, checkpoint_path, tag, args, ctx, load_module_strict)

    hf_trainer.deepspeed_load_checkpoint = load
    try:
        yield
    finally:
        hf_trainer.deepspeed_load_checkpoint = own


def _latest_tag(folder: str) -> str | None:
    """The tag DeepSpeed's ``load_checkpoint`` reads in ``folder`` (its ``latest`` file, else the one
    ``global_step*`` folder)."""
    latest = os.path.join(folder, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            return f.read().strip()
    tags = sorted(n for n in os.listdir(folder) if re.fullmatch(r"global_step\d+", n))
    return tags[-1] if tags else None


def _load_resharded(engine, folder: str, tag: str, args, ctx, strict: bool) -> tuple:
    """A ZeRO checkpoint (``folder/tag``) of another number of ranks into ``engine``: rank 0 reads every
    partition (the resume copied them all to its node, verified) and converts them into DeepSpeed's universal
    checkpoint (one folder per parameter, cut by no rank count) in the run's storage
    (``.raytrainer-universal-<step>/``); every rank then loads its new partition from it, and rank 0 removes
    it. At full size that is the whole optimizer state read and written once by one process: minutes, paid
    only when the number of workers changed."""
    from raytrainer.storage import Storage

    storage = Storage.for_run(args)
    dest = storage.path(f".raytrainer-universal-{tag.removeprefix('global_step')}")
    error = None
    if ctx.is_world_zero:
        try:
            with tempfile.TemporaryDirectory(prefix="raytrainer-universal-") as out:
                _convert_to_universal(os.path.join(folder, tag), os.path.join(out, f"{tag}_universal"))
                if storage.exists(dest):
                    storage.delete_dir(dest)
                storage.upload_dir(out, dest)
        except Exception as exc:  # shared below: no rank waits for a conversion that failed
            error = exc
    if ctx.any_flags([error is not None])[0]:
        raise error or RuntimeError("rank 0 could not convert the DeepSpeed checkpoint (see its log)")
    stage3 = engine.zero_optimization_partition_weights()
    if not stage3:  # ZeRO-1/2, bf16: a rank holding no parameter of a group (deepspeed_universal)
        from raytrainer.strategies.deepspeed_universal import repair

        repair(engine.optimizer)
    engine._config.load_universal_checkpoint = True  # read by its loads only (engine.py)
    try:
        with tempfile.TemporaryDirectory(prefix="raytrainer-universal-") as local:
            storage.download_dir(dest, local)
            with weights_only_loads():
                loaded = engine.load_checkpoint(local, tag=f"{tag}_universal", load_optimizer_states=True,
                                                load_lr_scheduler_states=True, load_module_strict=strict)
            if loaded[0] is not None and stage3:
                _repair_zero3_load(engine.optimizer, os.path.join(local, f"{tag}_universal"))
    finally:
        engine._config.load_universal_checkpoint = False
    if loaded[0] is None:
        raise RuntimeError(f"DeepSpeed could not load the universal checkpoint made from {folder}")
    ctx.barrier()
    if ctx.is_world_zero:
        storage.delete_dir(dest)
    return loaded


def partitions(files, step: int) -> list[str]:
    """The ZeRO optimizer partition files of a checkpoint's ``global_step<step>/`` (one per rank)."""
    prefix = f"global_step{step}/"
    return [f for f in files if f.startswith(prefix) and f.endswith(_PARTITION)]


def _repair_zero3_load(optimizer, folder: str) -> None:
    """Undo two slips of DeepSpeed's ZeRO-3 universal load (0.19, ``load_hp_checkpoint_state_from_checkpoint_
    dir_stage3``), which would make the resumed run drift from the uninterrupted one:

    - it gives every flat fp32 partition the same ``step`` tensor, and torch's Adam advances each
      parameter's step in place: with two parameter groups (transformers' decay / no-decay) the step went
      up by two per update, and the bias correction was wrong;
    - it gives every parameter group the hyperparameters of the checkpoint's first group: the no-decay
      group decayed.

    Each step becomes its own tensor, and each group takes its own saved hyperparameters (``folder``: the
    universal checkpoint, whose ``zero/optimizer_state.pt`` holds them)."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

    base = _base_optimizer(optimizer)
    seen: set[int] = set()
    for state in base.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(step))
    with weights_only_loads():
        saved = torch.load(os.path.join(folder, "zero", "optimizer_state.pt"), weights_only=False)
    groups = saved[OPTIMIZER_STATE_DICT]["param_groups"]
    if len(groups) == len(base.param_groups):
        for group, kept in zip(base.param_groups, groups):
            group.update({k: v for k, v in kept.items() if k != "params"})


def _convert_to_universal(folder: str, output: str) -> None:
    """DeepSpeed's own ds_to_universal, in this process (no worker pools), with the client state DeepSpeed's
    conversion expects of Megatron-style trainers injected (a plain engine's checkpoint lacks it)."""
    import argparse

    from deepspeed.checkpoint.ds_to_universal import main

    with weights_only_loads():
        main(argparse.Namespace(input_folder=folder, output_folder=output, num_extract_workers=1,
                                num_merge_workers=1, keep_temp_folder=False, strict=True,
                                inject_missing_state=True))


def _base_optimizer(optimizer):
    """The torch optimizer under DeepSpeed's ZeRO wrapper (whose param groups a scheduler drives)."""
    return getattr(optimizer, "optimizer", optimizer)
