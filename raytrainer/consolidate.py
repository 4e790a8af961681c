"""``raytrainer consolidate CHECKPOINT [OUT]``: sharded model weights made into safetensors files that
``from_pretrained`` loads, tensor by tensor -- the whole model is never in memory.

Sharded strategies write the model as each rank's shard: FSDP through torch.distributed.checkpoint (DCP:
``.raytrainer/final-model/`` after ``train()``, a ``pytorch_model_fsdp_0/`` folder in accelerate's layout),
DeepSpeed ZeRO-3 as each rank's partition in ``global_step<N>/``. Consolidating them is what a user does to
publish or serve the model, once, on any machine that can read the files -- not what 64 ranks wait for at
every save.

- **DCP**: the tensors are grouped into output files of at most ``max_shard_size`` bytes
  (``huggingface_hub.split_torch_state_dict_into_shards``, on meta tensors shaped from DCP's metadata), and
  each file's tensors are loaded with DCP's own planner (only the byte ranges they need, from a local
  folder or, through raytrainer.dcp_storage, a bucket), written, and freed before the next: peak memory is
  one output file's tensors plus DCP's read buffer (measured: 113 MiB for a 512 MiB model in 64 MiB
  files, bench/bench_consolidate.py).
- **DeepSpeed**: DeepSpeed's own ``convert_zero_checkpoint_to_state_dict``, which reads the partitions
  lazily and writes the same kind of files.

One file is ``model.safetensors``; more are ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``, as ``save_pretrained`` writes them. A checkpoint's ``config.json``,
tokenizer and other small files are copied beside them, so the output folder loads with ``from_pretrained``.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import shutil
import tempfile

import torch

from raytrainer.checkpoint import SHARDED_MODEL_DIR, zero_tag
from raytrainer.storage import Storage

logger = logging.getLogger(__name__)

DCP_METADATA = ".metadata"
#: Where a DCP model may sit in a checkpoint folder: the folder itself (raytrainer's final weights) or
#: accelerate's sharded FSDP layout.
DCP_MODEL_DIRS = ("", SHARDED_MODEL_DIR)
#: Small files ``from_pretrained`` reads beside the weights.
_BESIDE = (".json", ".txt", ".model", ".py", ".tiktoken")
_NOT_BESIDE = {"trainer_state.json", "manifest.json", "model.safetensors.index.json", "training_args.json"}


def consolidate(source: str, out: str | None = None, max_shard_size: int | str = "5GB",
                filesystem=None) -> list[str]:
    """Write the model in ``source`` (a checkpoint or final-weights folder, a local path or a URI) as
    safetensors files into ``out`` (default: ``source`` itself, when it is local); returns the files
    written. Raises ``ValueError`` naming what ``source`` holds when it holds no sharded model."""
    if out is None and "://" in str(source):
        raise ValueError(f"consolidate {source}: give an output folder (OUT) for a checkpoint that is not "
                         f"on this machine's disk, e.g. `raytrainer consolidate {source} ./consolidated`.")
    storage = Storage.from_uri(source, filesystem)
    files = storage.list_files(storage.root)
    out = storage.root if out is None else out
    dcp_dir = next((d for d in DCP_MODEL_DIRS if posixpath.join(d, DCP_METADATA).lstrip("/") in files),
                   None)
    zero = zero_tag(files)
    if dcp_dir is not None:
        written = _from_dcp(storage, dcp_dir, out, max_shard_size)
    elif zero:
        written = _from_deepspeed(storage, zero, out, max_shard_size)
    else:
        held = "model.safetensors (already consolidated)" if "model.safetensors" in files else \
            f"{len(files)} files: {', '.join(sorted(files)[:6])}{', ...' if len(files) > 6 else ''}"
        raise ValueError(
            f"consolidate {source}: it holds no sharded model -- neither DCP shards (.metadata, as FSDP "
            f"writes them) nor a DeepSpeed ZeRO checkpoint (global_step<N>/*_model_states.pt); it holds "
            f"{held}. Give a checkpoint-<step> folder of a sharded run, or its .raytrainer/final-model.")
    _copy_beside(storage, files, out)
    logger.info("consolidated %s into %s: %s", source, out, ", ".join(written))
    return written


def _from_dcp(storage: Storage, dcp_dir: str, out: str, max_shard_size) -> list[str]:
    import torch.distributed.checkpoint as dcp
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    from raytrainer.dcp_storage import tensor_metadata

    shapes = tensor_metadata(_dcp_reader(storage, dcp_dir))
    prefix = "model." if shapes and all(k.startswith("model.") for k in shapes) else ""
    meta = {key[len(prefix):]: torch.empty(m.size, dtype=m.properties.dtype, device="meta")
            for key, m in shapes.items()}
    split = split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_size)
    target = Storage.from_uri(out)
    stage = tempfile.mkdtemp(prefix="raytrainer-consolidate-") if not target.is_local else None
    if target.is_local:
        os.makedirs(target.root, exist_ok=True)
    written = []
    for filename, names in split.filename_to_tensors.items():
        tensors = {name: torch.empty(meta[name].shape, dtype=meta[name].dtype) for name in names}
        loaded = {"model": tensors} if prefix else tensors
        dcp.load(loaded, storage_reader=_dcp_reader(storage, dcp_dir), no_dist=True)
        local = os.path.join(stage or target.root, filename)
        save_file(tensors, local, metadata={"format": "pt"})
        del tensors, loaded  # the next file's tensors replace these
        if stage:
            target.upload_file(local, target.path(filename))
            os.remove(local)
        written.append(filename)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        target.write_bytes(target.path("model.safetensors.index.json"),
                           json.dumps(index, indent=2, sort_keys=True).encode())
        written.append("model.safetensors.index.json")
    if stage:
        shutil.rmtree(stage, ignore_errors=True)
    return written


def _dcp_reader(storage: Storage, dcp_dir: str):
    """A fresh reader per load (DCP keeps per-load state in it)."""
    from raytrainer.dcp_storage import reader_at

    return reader_at(storage, storage.path(dcp_dir) if dcp_dir else storage.root)


def _from_deepspeed(storage: Storage, tag: str, out: str, max_shard_size) -> list[str]:
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

    if not storage.is_local or not Storage.from_uri(out).is_local:
        raise ValueError(f"consolidate {storage.uri}: DeepSpeed's converter reads and writes local folders; "
                         "download the checkpoint first (e.g. `aws s3 sync`) and give local paths.")
    from raytrainer.strategies.deepspeed_load import weights_only_loads

    before = set(os.listdir(out)) if os.path.isdir(out) else set()
    with weights_only_loads():  # DeepSpeed's converter unpickles the partitions: tensors only, nothing run
        convert_zero_checkpoint_to_state_dict(storage.root, out, max_shard_size=max_shard_size,
                                              safe_serialization=True, tag=tag)
    return sorted(set(os.listdir(out)) - before) or ["model.safetensors"]


def _copy_beside(storage: Storage, files: dict, out: str) -> None:
    """config.json, generation_config.json, the tokenizer's files: what from_pretrained reads beside the
    weights (top level only; not raytrainer's or the trainer's own records)."""
    target = Storage.from_uri(out)
    if target.uri.rstrip("/") == storage.uri.rstrip("/"):
        return
    for name in files:
        if "/" not in name and name.endswith(_BESIDE) and name not in _NOT_BESIDE \
                and not name.startswith("rng_state"):
            target.write_bytes(target.path(name), storage.read_bytes(storage.path(name)))
