"""Sharded optimizer state through ``torch.distributed.checkpoint`` (DCP), in the folder layout accelerate
uses for FSDP (``optimizer_0/``): every rank writes its own shards, and loading reshards them onto any
number of ranks and any layout (FSDP on 2 workers -> FSDP or DDP on 1)."""

from __future__ import annotations

import os

OPTIMIZER_DIR = "optimizer_0"


def save_optimizer(model, optimizer, folder: str) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer)  # this rank's shards (DTensors under FSDP)
    dcp.save({"optimizer": state}, checkpoint_id=os.path.join(folder, OPTIMIZER_DIR))
    return OPTIMIZER_DIR


def load_optimizer(model, optimizer, reader, ctx) -> None:
    """Load the optimizer state through ``reader``, a CheckpointReader of a committed checkpoint: each rank
    reads (verified) only the shards its plan needs, from a local folder or straight from a bucket."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    if not any(name.startswith(f"{OPTIMIZER_DIR}/") for name in reader.files):
        raise ValueError(
            f"{reader.uri} holds no {OPTIMIZER_DIR}/ (sharded optimizer state): it was saved by another "
            "strategy (e.g. DeepSpeed, whose engine alone reads its format). Resume it with the strategy "
            "that saved it, or set save_only_model/load only the weights.")
    state = get_optimizer_state_dict(model, optimizer)  # the layout to fill (state initialised by torch)
    loaded = {"optimizer": state}
    with reader.dcp_reader(OPTIMIZER_DIR, ctx) as storage_reader:
        dcp.load(loaded, storage_reader=storage_reader)
    set_optimizer_state_dict(model, optimizer, loaded["optimizer"])
