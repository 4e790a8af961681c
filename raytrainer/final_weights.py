"""The trained weights go from the workers to the driver through storage, never through Ray.

At the end of ``train()`` on Ray workers every rank takes part in writing the final weights into
``<storage root>/.raytrainer/final-model/``, in the layout of what accelerate made of the model
(``write_hosted``): one consolidated ``model.safetensors`` written by rank 0 for a replicated model, one
torch.distributed.checkpoint (DCP) file per rank under FSDP2, each rank writing only its own shard.
Rank 0's answer through the event channel carries the folder's URI, a few bytes.

The driver's ``trainer.model`` is filled from that folder lazily, on first access (``load_into``): a
hyperparameter search's trials, or a job that only saves checkpoints, never pull a large model onto a
CPU-only head node. The load goes into the driver's own module in place -- each safetensors tensor read
from the file straight into the module's tensor, DCP's planner for shards -- so the driver holds one copy of
the model, where pickled state dicts through Ray's object store cost four or five.
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import tempfile
import warnings

import torch

from raytrainer.storage import STATE_FOLDER, Storage

logger = logging.getLogger(__name__)

FOLDER = posixpath.join(STATE_FOLDER, "final-model")  # hidden; never pushed to the Hub (hub.IGNORE_PATTERNS)
DCP_METADATA = ".metadata"


def write_hosted(trainer, ctx, args) -> str:
    """On every rank after ``train()`` of transformers' loop, the final weights written (a collective;
    returns the folder URI): the layout
    follows what accelerate made of the model -- each rank's DCP shard under FSDP2, DeepSpeed's ZeRO-3
    partitions gathered module by module onto rank 0, else rank 0's ``model.safetensors``. ``args``: the
    arguments with the Ray fields (the run's storage)."""
    return write_with(args, ctx, lambda folder: _save_hosted(trainer, ctx, folder))


def _save_hosted(trainer, ctx, folder: str) -> None:
    from raytrainer.saving import WEIGHTS_NAME, dedupe_shared

    model, engine = trainer.model, trainer.model_wrapped
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):  # FSDP2: nothing gathered
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=folder)
        return
    if (hasattr(engine, "_zero3_consolidated_16bit_state_dict")
            and engine.zero_optimization_partition_weights()):
        weights = engine._zero3_consolidated_16bit_state_dict()  # every rank takes part; rank 0 gets them
    else:
        weights = trainer.accelerator.unwrap_model(model).state_dict() if ctx.is_world_zero else None
    if ctx.is_world_zero:
        from safetensors.torch import save_file

        weights = {k: v.detach().to("cpu") for k, v in dedupe_shared(weights).items()}  # a tied weight once
        save_file(weights, os.path.join(folder, WEIGHTS_NAME), metadata={"format": "pt"})


def write_with(args, ctx, save) -> str:
    """Every rank calls ``save(folder)`` into the run's ``final-model`` folder (staged and uploaded for
    remote storage, each rank its own files); returns the folder URI."""
    storage = Storage.for_run(args)
    dest = storage.path(FOLDER)
    if ctx.is_world_zero and storage.exists(dest):
        storage.delete_dir(dest)  # an earlier train()'s files (another world size's shards, say)
    ctx.barrier()
    if storage.is_local:
        os.makedirs(dest, exist_ok=True)
        save(dest)
    else:
        stage = tempfile.mkdtemp(prefix="raytrainer-final-")
        try:
            save(stage)
            if os.listdir(stage):
                storage.upload_dir(stage, dest)  # this rank's files only
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    ctx.barrier()  # every rank's files are in place before rank 0 hands the URI to the driver
    return storage.uri_of(FOLDER)


def load_into(model: torch.nn.Module, uri: str, filesystem=None) -> None:
    """Fill ``model`` (on the driver) in place from the final weights at ``uri``."""
    storage = Storage.from_uri(uri, filesystem)
    files = storage.list_files(storage.root)
    if DCP_METADATA in files:
        _load_dcp(model, storage)
    elif "model.safetensors" in files:
        _load_safetensors(model, storage)
    else:
        raise FileNotFoundError(
            f"{uri} holds no final weights (model.safetensors or DCP shards): was it deleted while the "
            "Trainer was alive? The last checkpoint's weights load with load_best_model_at_end or "
            "resume_from_checkpoint.")
    logger.debug("driver model filled from %s (%d files)", uri, len(files))


def load_on_ranks(model: torch.nn.Module, uri: str, filesystem=None) -> None:
    """Fill a rank's ``model`` from the final weights at ``uri``, every rank at once: a trainer the ranks
    built again for a driver's trainer that had trained (a new group after ``close()``, a group Ray Train
    restarted) goes on from its trained weights, as the trainer of one process would. Each rank reads its
    own share of DCP's shards (a collective), or the whole ``model.safetensors``."""
    storage = Storage.from_uri(uri, filesystem)
    if DCP_METADATA not in storage.list_files(storage.root):
        _load_safetensors(model, storage)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    dcp.load(state, storage_reader=_dcp_reader(storage))
    set_model_state_dict(model, state["model"])


def _dcp_reader(storage: Storage):
    import torch.distributed.checkpoint as dcp

    if storage.is_local:
        return dcp.FileSystemReader(storage.root)
    from raytrainer.dcp_storage import PyArrowReader

    return PyArrowReader(storage.fs, storage.root, cache=None)


# safetensors' dtype names -> torch dtypes (the ones a model's weights come in)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _load_safetensors(model: torch.nn.Module, storage: Storage) -> None:
    """Tensor by tensor into the model's own, read from the file straight into each tensor's memory: no
    second copy of the model, and no memory map (whose file pages would count in the driver's resident
    memory while the model is read, doubling its peak). A tensor whose dtype or layout differs from the
    model's is read through safetensors and copied (cast)."""
    import json

    from safetensors import safe_open

    from raytrainer.checkpoint import check_fits

    own = model.state_dict()
    with _local_file(storage, "model.safetensors") as path:
        with open(path, "rb", buffering=0) as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            start = f.tell()
            header.pop("__metadata__", None)
            check_fits(own, {name: tuple(meta["shape"]) for name, meta in header.items()}, storage.uri)
            other = []
            for name, meta in header.items():
                target = own[name]
                begin, end = meta["data_offsets"]
                if (_DTYPES.get(meta["dtype"]) != target.dtype or not target.is_contiguous()
                        or target.device.type != "cpu" or target.nbytes != end - begin):
                    other.append(name)
                    continue
                f.seek(start + begin)
                _read_exactly(f, target, storage.uri, name)
        if other:
            with safe_open(path, framework="pt") as f, torch.no_grad():
                for name in other:  # a tied weight stored once fills its twin: they share storage
                    own[name].copy_(f.get_tensor(name))


def _read_exactly(f, tensor: torch.Tensor, uri: str, name: str) -> None:
    if tensor.numel() == 0:
        return
    view = memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise OSError(f"{uri}: model.safetensors ends inside tensor {name!r}: the file is truncated")
        done += got


def _load_dcp(model: torch.nn.Module, storage: Storage) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}  # the driver's tensors, filled in place
    reader = _dcp_reader(storage)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)


class _local_file:
    """A local path for one file of ``storage``: the file itself, or a streamed temporary copy."""

    def __init__(self, storage: Storage, name: str):
        self.storage, self.name, self.tmp = storage, name, None

    def __enter__(self) -> str:
        if self.storage.is_local:
            return self.storage.path(self.name)
        self.tmp = tempfile.mkdtemp(prefix="raytrainer-final-")
        dest = os.path.join(self.tmp, self.name)
        self.storage.download(self.storage.path(self.name), dest)
        return dest

    def __exit__(self, *exc) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
