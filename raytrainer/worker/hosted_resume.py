"""A hosted trainer's resume (worker/hosted.py): transformers' loop reads a checkpoint by path, so each rank
is handed a local folder holding what it reads, verified against the checkpoint's manifest first.

- A folder this node sees is read in place; each rank first hashes its share of the files, by size (a
  damaged file stops every rank before transformers reads anything).
- A checkpoint in a bucket (or a folder this node does not see) is copied into
  ``<output_dir>/.raytrainer/resume/<name>/``, each file hashed as it streams -- but only what the node's
  ranks read: the files every rank reads (a DDP run's weights and optimizer, the scheduler, the trainer
  state) once per node, by its local rank 0; a rank's own files (``rng_state_<rank>.pth``, its ZeRO
  partitions) by that rank; another rank's ZeRO partitions only when the world size changed (DeepSpeed then
  reads them all). Of a DCP folder (FSDP's ``SHARDED_STATE_DICT``: ``pytorch_model_fsdp_0/``,
  ``optimizer_0/``) a rank copies the shards it wrote (dcp_storage.owned_files), and accelerate's loads read
  the rest through raytrainer's DCP reader (dcp_storage.PyArrowReader): only the slices this rank's load
  plan needs, as ranged reads, each verified by its blocks' hashes. At 70B on 64 ranks under FSDP that is
  a rank's 2.2 GB of weights and 8.8 GB of optimizer state, not the 1.1 TB checkpoint per node.

A damaged file raises ``DamagedCheckpointError`` on every rank; the driver then resumes from the committed
checkpoint before it, where the choice was its own (driver/runner.train_sequence). A folder without a
manifest (transformers' own) is read as it is, unverified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import posixpath
import re
import shutil

from transformers import TrainerCallback

from raytrainer.checkpoint import CheckpointError, CheckpointReader, damage_named
from raytrainer.dcp_storage import owned_files
from raytrainer.storage import uri_basename
from raytrainer.worker.hosted_adapter import reading_adapters

logger = logging.getLogger(__name__)

#: A file one rank wrote for itself: transformers' RNG state (``rng_state_<rank>.pth``), a ZeRO partition
#: (``global_step<n>/*zero_pp_rank_<rank>_*``). Group 1: the RNG state's rank; group 2: the partition's.
_RANK_FILE = re.compile(r"(?:^|/)(?:rng_state_(\d+)\.(?:pth|safetensors)|[^/]*zero_pp_rank_(\d+)_[^/]*)$")
#: The loads that read a checkpoint's DCP folders (accelerate's ``load_fsdp_model`` / ``_optimizer``).
_LOADS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler")


@dataclasses.dataclass
class Resume:
    """The folder transformers resumes from, the world size that saved it, and the DCP folders in it that are
    read in ranges from the storage (local path, which holds this node's copies -> the checkpoint's reader
    and the folder's name in it)."""

    folder: str | None
    saved_on: int | None = None
    ranged: dict = dataclasses.field(default_factory=dict)
    ctx: object = None  # the rank's context (rank_context.RankContext)

    @contextlib.contextmanager
    def reading(self, trainer):
        """Meanwhile ``trainer``'s loads read its DCP folders through the storage (``ranged``), under
        DeepSpeed a ZeRO checkpoint of another number of ranks is converted and resharded
        (strategies/deepspeed.resuming_on_any_world_size), and under FSDP a PEFT model's checkpoint is read
        from its adapter file (worker/hosted_adapter.py)."""
        with contextlib.ExitStack() as stack:
            if self.folder is not None and getattr(trainer, "is_deepspeed_enabled", False):
                from raytrainer.strategies.deepspeed import resuming_on_any_world_size

                given = getattr(trainer, "_raytrainer_given", trainer.args)  # with the run's storage
                stack.enter_context(resuming_on_any_world_size(given, self.ctx))
            stack.enter_context(reading_adapters(trainer))
            for name in _LOADS if self.ranged else ():
                load = getattr(trainer, name)
                setattr(trainer, name, functools.partial(_through_storage, load, self.ranged))
                stack.callback(trainer.__dict__.pop, name, None)
            yield


def localize(uri: str | None, args, ctx) -> Resume:
    """``uri`` (a committed checkpoint, or one transformers wrote) as a folder this rank can read (above)."""
    if uri is None:
        return Resume(None)
    try:
        reader = CheckpointReader(uri, getattr(args, "storage_filesystem", None))
    except CheckpointError:
        if "://" not in uri and os.path.isdir(uri):  # not a checkpoint raytrainer knows: transformers
            return Resume(uri, world_size_of(os.listdir(uri)), ctx=ctx)  # says what is wrong with it
        raise
    names = sorted(reader.files)
    saved_on = world_size_of(names)
    if reader.storage.is_local and os.path.isdir(reader.storage.root):
        reader.verify_share(names, ctx)
        return Resume(reader.storage.root, saved_on, ctx=ctx)
    dest = os.path.join(os.path.abspath(args.output_dir), ".raytrainer", "resume", uri_basename(uri))
    if ctx.is_local_zero:
        shutil.rmtree(dest, ignore_errors=True)  # what an earlier attempt left
    ctx.barrier()  # before any rank of the node copies into it
    mine = files_to_copy(names, ctx.rank, ctx.world_size, saved_on, ctx.is_local_zero)
    reader.download_all(mine, dest, ctx)
    logger.info("copied %d of the %d files of %s to %s to resume from it", len(mine), len(names), uri, dest)
    ranged = {os.path.join(dest, d): (reader, d) for d in dcp_folders(names)}
    return Resume(dest, saved_on, ranged, ctx)


def files_to_copy(names: list[str], rank: int, world_size: int, saved_on: int | None,
                  local_zero: bool) -> list[str]:
    """The files of a checkpoint that ``rank`` copies to its node (above)."""
    folders = dcp_folders(names)
    mine = []
    for folder in sorted(folders):
        mine += owned_files([n for n in names if n.startswith(f"{folder}/")], rank, world_size)
    for name in names:
        if posixpath.dirname(name) in folders:
            continue
        own = _RANK_FILE.search(name)
        if own is None:
            take = local_zero
        elif own.group(2) is not None and saved_on != world_size:
            take = local_zero  # DeepSpeed reads every partition to reshard (or names the mismatch itself)
        else:
            take = int(own.group(1) or own.group(2)) == rank
        if take:
            mine.append(name)
    return mine


def dcp_folders(names: list[str]) -> set[str]:
    """The folders of a checkpoint that hold a DCP checkpoint (a ``.metadata`` file)."""
    return {posixpath.dirname(n) for n in names if posixpath.basename(n) == ".metadata" and "/" in n}


def world_size_of(names: list[str]) -> int | None:
    """How many ranks saved a transformers checkpoint of these files: one ``rng_state_<rank>.pth`` each, or
    ``rng_state.pth`` alone from one process; None when it holds no RNG state."""
    ranks = {m.group(1) for m in map(_RANK_FILE.search, names) if m and m.group(1) is not None}
    return len(ranks) or (1 if "rng_state.pth" in names else None)


def _through_storage(load, ranged: dict, *args, **kwargs):
    """``load(*args, **kwargs)`` with each DCP reader accelerate makes for a folder in ``ranged`` reading
    from the storage instead (accelerate makes ``torch.distributed.checkpoint.FileSystemReader(folder)``;
    tests/unit/test_hosted_resume.py pins that)."""
    import torch.distributed.checkpoint as dcp

    local = dcp.FileSystemReader

    class Reader(local):
        def __new__(cls, path, *a, **k):
            folder = os.path.abspath(str(path))
            if folder not in ranged:
                return local(path, *a, **k)
            reader, subdir = ranged[folder]
            return reader.ranged_reader(subdir, cache=folder)

    dcp.FileSystemReader = Reader
    try:
        with damage_named():
            return load(*args, **kwargs)
    finally:
        dcp.FileSystemReader = local


class LoaderSeedOffTheStream(TrainerCallback):
    """A resumed run's first iterator of a training loader
    with persistent workers draws those workers' base seed from the global random stream, as torch's
    ``DataLoader`` does for each new iterator. The uninterrupted run drew it in its first epoch, before the
    checkpoint saved that stream, and never again; so a resume makes that one draw on a fork of the stream,
    and dropout (every later draw) goes on as in the uninterrupted run. raytrainer's own loop does the same
    (worker/loop.py)."""

    same_on_every_rank = True

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        persistent = getattr(train_dataloader, "persistent_workers", False)
        if state.global_step > 0 and persistent and getattr(train_dataloader, "num_workers", 0) > 0:
            _fork_first_iterator(train_dataloader)


def _fork_first_iterator(loader) -> None:
    """``loader``'s next iterator is made on a fork of the CPU random stream; later ones as before.
    accelerate's ``DataLoaderShard`` makes its iterators by calling ``base_dataloader.__iter__()`` (and
    answers ``__class__`` itself); a plain ``DataLoader`` through its class."""
    import torch

    target = getattr(loader, "base_dataloader", None)
    if target is not None:
        inner = target.__iter__

        def once():
            del target.__iter__
            with torch.random.fork_rng(devices=[]):
                return inner()

        target.__iter__ = once
        return
    cls = type(loader)

    def __iter__(self):
        self.__class__ = cls
        with torch.random.fork_rng(devices=[]):
            return cls.__iter__(self)

    loader.__class__ = type(cls.__name__, (cls,), {"__iter__": __iter__})


@contextlib.contextmanager
def new_hyperparameters(trainer, wanted: bool):
    """A PBT exploit (raytrainer/search): another trial's checkpoint resumed with this run's (mutated)
    ``learning_rate`` and ``weight_decay``, taken right after transformers' loop loads the checkpoint's
    optimizer and scheduler state (``_load_optimizer_and_scheduler``), the schedule keeping its position.
    The same for any hosted trainer, on a rank and in the driver's process."""
    if not wanted:
        yield
        return
    from raytrainer.optim import reapply_hyperparameters

    load = trainer._load_optimizer_and_scheduler

    def load_then_take_this_run_s(checkpoint):
        load(checkpoint)
        if checkpoint is not None:
            scheduler = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)  # a wrapper's
            reapply_hyperparameters(trainer.optimizer, scheduler, trainer.args)

    trainer._load_optimizer_and_scheduler = load_then_take_this_run_s
    try:
        yield
    finally:
        del trainer._load_optimizer_and_scheduler  # the class's own again
