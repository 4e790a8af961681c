"""Sharded model and optimizer state through ``torch.distributed.checkpoint`` (DCP), in the folder layout
accelerate uses for FSDP (``pytorch_model_fsdp_0/`` for the model, ``optimizer_0/`` for the optimizer): every
rank writes its own shards, and loading reshards them onto any number of ranks and any layout (FSDP on 2
workers -> FSDP or DDP on 1, or a plain module on the driver: raytrainer/one_loop.py). accelerate's saves in
a checkpoint go through ``save_state`` (worker/hosted_saves.py).

Saves are asynchronous where a process group is up (``pending`` given): DCP's ``async_save`` copies this
rank's shards into CPU memory on the calling (training) thread -- the snapshot, the one part a step waits
for -- and writes them from a thread of its own, whose collectives (the save plan, the ``.metadata`` commit)
run on a gloo group kept for checkpoints, never on the group the training step's collectives use. The
checkpoint writer waits for the returned futures off the training thread before it hashes the files."""

from __future__ import annotations

import math
import os

from raytrainer.checkpoint import SHARDED_MODEL_DIR

OPTIMIZER_DIR = "optimizer_0"
#: accelerate's (and transformers.Trainer's) folder for an FSDP model saved with SHARDED_STATE_DICT
MODEL_DIR = SHARDED_MODEL_DIR

def _checkpoint_group(folder: str):
    """The gloo group of one folder's background saves: the model's and the optimizer's writes run at once,
    each on its own thread, and two threads' collectives on one group could pair up differently on
    different ranks. Made at the first save: every rank reaches it at the same step."""
    from raytrainer.rank_context import side_group

    return side_group(f"checkpoint:{folder}")


def save_state(state: dict, folder: str, name: str, pending: list | None) -> None:
    """``state`` into the DCP folder ``folder/name``, small items last in each file; with ``pending`` and a
    process group up, in the background (the future appended to ``pending``; see above)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = os.path.join(folder, name)
    if pending is None or not dist.is_initialized():
        dcp.save(state, checkpoint_id=path, planner=_small_last())
    else:
        pending.append(dcp.async_save(state, checkpoint_id=path, process_group=_checkpoint_group(name),
                                      planner=_small_last()))


def _small_last():
    """DCP's own save planner, with each rank's items written largest first: the small ones (AdamW's
    scalar step counts, which DCP spreads over the ranks' files, replicated biases, pickled values) end up
    together at the end of the file. Another rank reads them from there as one or two verified blocks
    (``checkpoint.BLOCK``) rather than a block per item: at 70B, ~700 step counts would otherwise pull
    ~700 x 4 MiB per rank on every resume."""
    import dataclasses

    from torch.distributed.checkpoint import DefaultSavePlanner

    def size(item) -> int:
        data = item.tensor_data
        if data is None:  # a pickled value
            return 0
        return math.prod(data.chunk.sizes) * data.properties.dtype.itemsize

    class SmallLast(DefaultSavePlanner):
        def finish_plan(self, new_plan):
            plan = super().finish_plan(new_plan)
            return dataclasses.replace(plan, items=sorted(plan.items, key=size, reverse=True))

    return SmallLast()
