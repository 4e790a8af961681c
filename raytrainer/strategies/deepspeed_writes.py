"""DeepSpeed checkpoints written in the background: the step waits only for the copy into host memory.

DeepSpeed's ``save_checkpoint`` hands each file's state to its checkpoint engine (``save(state, path)``);
the default engine, ``TorchCheckpointEngine``, runs ``torch.save`` there, on the training thread: at ZeRO-3
each rank's partition of the fp32 weights and Adam's moments (~13 GB at 70B on 64 ranks). raytrainer's
engine copies the state's tensors to the host (``_host_copy``: compact copies, so a view into a flat buffer
saves only its elements, as DeepSpeed's ``clone_tensors_for_torch_save`` makes them -- which also turns the
``torch.Size`` shapes its loaders read into plain tuples) and gives ``torch.save`` of the copy to one
writer thread; the copies are the snapshot, so the next optimizer step may change the live tensors at
once. ``take_pending_writes`` hands the writes (futures, in order; each gives the path it wrote) to
raytrainer's checkpoint writer, which waits for them before it hashes and commits the folder -- a failed
write fails the run naming the checkpoint, as FSDP's DCP writes do. Each rank's writes end on their own
(DCP's end together), so where the ranks share a folder each rank hashes the files it wrote, not a share
of a listing that another rank's writes may still be filling. Memory: one checkpoint's state of this rank
on the host while it is written (DCP's ``async_save`` stages the same).

Only DeepSpeed's default engine is replaced: a config that chooses another (``checkpoint.writer``,
DataStates) keeps it, writing as it does.
"""

from __future__ import annotations

import concurrent.futures

import torch


def write_in_background(engine) -> None:
    """Give ``engine`` (a DeepSpeedEngine) raytrainer's background checkpoint engine, where it has
    DeepSpeed's default one."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    current = getattr(engine, "checkpoint_engine", None)
    if type(current) is TorchCheckpointEngine:
        engine.checkpoint_engine = _background_engine(current)


def in_background(engine) -> bool:
    """Whether ``engine`` writes its checkpoints through raytrainer's background engine."""
    return hasattr(getattr(engine, "checkpoint_engine", None), "take_pending")


def take_pending(engine) -> list:
    """The writes ``engine``'s checkpoint engine has started since the last call (futures, in order)."""
    current = getattr(engine, "checkpoint_engine", None)
    return current.take_pending() if hasattr(current, "take_pending") else []


def _background_engine(default):
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class BackgroundCheckpointEngine(TorchCheckpointEngine):
        """``TorchCheckpointEngine`` whose ``save`` snapshots the state on the host and writes it on a
        thread; ``load`` and ``commit`` are DeepSpeed's."""

        def __init__(self):  # the default engine's settings (its serialisation format), not a new config
            vars(self).update(vars(default))
            self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raytrainer-ds-save")
            self._pending: list[concurrent.futures.Future] = []

        def preserves_storage_sharing(self) -> bool:
            return False  # save() copies every tensor itself: DeepSpeed need not clone first

        def save(self, state_dict, path: str):
            snapshot = _host_copy(state_dict)
            self._pending.append(self._writer.submit(_write, snapshot, path, self.zipfile_serialization))

        def take_pending(self) -> list:
            pending, self._pending = self._pending, []
            return pending

    return BackgroundCheckpointEngine()


def _write(state, path: str, zipfile_serialization: bool) -> str:
    torch.save(state, path, _use_new_zipfile_serialization=zipfile_serialization)
    return path


def _host_copy(item):
    """``item`` with every tensor in it replaced by a compact copy on the host; containers keep their type
    (an OrderedDict, a ``torch.Size``, a named tuple), everything else is the same object."""
    if torch.is_tensor(item):
        return item.detach().to("cpu", copy=True)
    if isinstance(item, dict):
        out = item.copy()
        for key, value in item.items():
            out[key] = _host_copy(value)
        return out
    if isinstance(item, list):
        return [_host_copy(v) for v in item]
    if type(item) is tuple:
        return tuple(_host_copy(v) for v in item)
    if isinstance(item, tuple) and hasattr(item, "_fields"):
        return type(item)(*(_host_copy(v) for v in item))
    return item
