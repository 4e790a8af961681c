"""What a checkpoint push takes from a checkpoint, and how it gets onto the driver's disk.

The repository's root gets what transformers' ``Trainer._push_from_checkpoint`` copies from a checkpoint
folder, nothing else: the model's config and weights (sharded weights through their index), a PEFT
adapter's, and the training arguments (``training_args.bin`` as transformers, and our readable
``training_args.json``; neither holds a token); the processing class is saved again by the pusher, as
transformers does. Training state -- ``optimizer.pt``, ``scheduler.pt``, ``rng_state_*``,
``trainer_state.json``, DCP optimizer folders, DeepSpeed ``global_step*`` folders and its ``latest`` -- is
never read, so a model-only push of a large model's checkpoint moves the model's bytes, not the several
times larger optimizer state. An FSDP checkpoint whose model is each rank's DCP shard
(``pytorch_model_fsdp_0/``, no consolidated weights) pushes that folder as it is.

Files are streamed from the storage filesystem to the staging folder (``pyarrow.fs.copy_files``, in
chunks): a file never sits whole in the driver's memory. Only a sharded model's index is read whole.
"""

from __future__ import annotations

import json
import os

from raytrainer.checkpoint import SHARDED_MODEL_DIR
from raytrainer.storage import Storage

# transformers' CONFIG_NAME, GENERATION_CONFIG_NAME, WEIGHTS_NAME, SAFE_WEIGHTS_NAME and PEFT's
# ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, ADAPTER_SAFE_WEIGHTS_NAME
MODEL_FILES = ("config.json", "generation_config.json", "pytorch_model.bin", "model.safetensors",
               "adapter_config.json", "adapter_model.bin", "adapter_model.safetensors")
# WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_INDEX_NAME: each names the shards of a sharded save_pretrained
INDEX_FILES = ("pytorch_model.bin.index.json", "model.safetensors.index.json")
TRAINING_ARGS = ("training_args.bin", "training_args.json")


def model_files(storage: Storage) -> list[str]:
    """The checkpoint's files (paths relative to its folder) that a push puts at the repository's root."""
    present = set(storage.list_files(storage.root))
    wanted = [*MODEL_FILES, *TRAINING_ARGS]
    for index in INDEX_FILES:
        if index in present:
            weight_map = json.loads(storage.read_bytes(storage.path(index)))["weight_map"]
            wanted += [index, *sorted(set(weight_map.values()))]
    if not any(name in present for name in ("model.safetensors", "pytorch_model.bin", *INDEX_FILES)):
        # FSDP's SHARDED_STATE_DICT checkpoint: the model is its DCP shards, pushed as they are (accelerate's
        # pytorch_model_fsdp_0/; `raytrainer consolidate` makes safetensors of them)
        wanted += sorted(rel for rel in present if rel.startswith(f"{SHARDED_MODEL_DIR}/"))
    return [rel for rel in dict.fromkeys(wanted) if rel in present]


def stage(storage: Storage, files: list[str], dest: str) -> str:
    """Copy ``files`` of ``storage`` into the local folder ``dest``, streamed; returns ``dest``."""
    os.makedirs(dest, exist_ok=True)
    for rel in files:
        storage.download(storage.path(rel), os.path.join(dest, rel))
    return dest


def local_checkpoint(storage: Storage, dest: str) -> str:
    """A local folder holding the whole checkpoint (a resumable ``last-checkpoint`` push): the folder
    itself on local storage, else a streamed copy in ``dest``."""
    if storage.is_local:
        return storage.root
    storage.download_dir(storage.root, dest)
    return dest
