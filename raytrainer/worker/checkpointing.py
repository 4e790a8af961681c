"""Saving checkpoints from the ranks and resuming from one.

A save is two phases, so the training loop only waits for an in-memory copy of the state:

1. ``CheckpointWriter.save`` (all ranks, blocking): each rank snapshots its part in memory -- rank 0 the
   weights and every piece of ``raytrainer.worker.pieces`` (optimizer, scheduler, scaler, trainer state);
   every rank its RNG state (a piece each rank writes). A strategy with a folder of its own
   (``save_sharded``) has every rank write its shards there first -- under FSDP's SHARDED_STATE_DICT the
   model's too (``pytorch_model_fsdp_0/``), when rank 0 gathers no weights and writes only the model's
   small files (config, generation config, arguments). A background
   thread then serialises the snapshot (safetensors, torch.save, JSON) straight into the checkpoint
   folder when storage is a local path, else into a local staging folder; hashes the files; and for a
   URI (s3://, gs://, file://, ...) uploads them through pyarrow and deletes the staging copy. The
   snapshot costs one extra copy of the weights and optimizer state in host memory while it is written.
2. ``CheckpointWriter.commit`` (all ranks, in the same step): once every rank's thread is done, rank 0
   writes ``manifest.json`` from all ranks' parts (the commit), the checkpoint is handed to Ray Train
   with ``ray.train.report(..., checkpoint_upload_mode=NO_UPLOAD)``, and the driver is told, so it can
   track best / latest and rotate. The loop commits as soon as every rank reports done (checked with
   the per-step control flags, no extra collective); the next save and the end of training wait for it.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
import threading

import torch

from raytrainer.callbacks import ExportableState, TrainerControl, TrainerState, state_from_dict
from raytrainer.checkpoint import (
    CheckpointReader,
    digest_files,
    holds_sharded_model,
    load_checkpoint_model,
    write_manifest,
    zero_model_tag,
)
from raytrainer.protocol import CheckpointCommitted
from raytrainer.saving import TRAINER_STATE_NAME, save_model_files, save_model_metadata
from raytrainer.storage import Storage
from raytrainer.worker import console
from raytrainer.worker.pieces import Piece, RngState, optimizer_pieces, rng_file, training_pieces

logger = logging.getLogger(__name__)


class _Snapshot:
    """What one rank saves, copied in memory on the training thread (so training may go on)."""

    def __init__(self):
        self.model_files = False  # this rank writes the model's files (rank 0; save_on_each_node)
        self.weights: dict | None = None  # consolidated weights; None: the model is in sharded_dirs
        self.pieces: list[tuple[Piece, object]] = []  # each piece with its state, copied
        self.sharded_dirs: list[str] = []  # the strategy's own folders, written or being written
        self.sharded_writes: list = []  # ... by these background writes (futures), if any
        self.own_writes = False  # ... each giving the path it wrote, this rank's writes alone
        self.share: tuple | None = None  # (rank, world size, shared folder): which of their files ...
        self.sharded: list[str] = []  # ... this rank hashes (and uploads), listed once they are written


def _copy_tensors(obj):
    """A deep copy of a state dict's tensors on the CPU (the optimizer keeps updating the originals)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _copy_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy_tensors(v) for v in obj)
    return copy.deepcopy(obj)


class _Writer(threading.Thread):
    """Serialises a rank's snapshot, hashes the files, and for remote storage uploads them and removes
    the staging folder -- all off the training thread."""

    def __init__(self, snapshot: _Snapshot, stage: str, storage: Storage, name: str, remote: bool,
                 model, args):
        super().__init__(daemon=True, name=f"raytrainer-save-{name}")
        self.snapshot, self.stage, self.storage, self.name = snapshot, stage, storage, name
        self.remote, self.model, self.args = remote, model, args
        self.files: list[str] = []
        self.part: dict = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        snap = self.snapshot
        try:
            # the strategy's background writes (DCP's async_save; DeepSpeed's engine files, each naming
            # the path it wrote)
            wrote = [write.result() for write in snap.sharded_writes]
            if snap.share is not None:  # every rank's sharded files are complete now (DCP), or this rank's
                snap.sharded = _my_share(self.stage, snap.sharded_dirs, *snap.share,
                                         own=wrote if snap.own_writes else None)
            self.files = self._write()
            self.part = digest_files(self.stage, self.files)
            if self.remote:
                self.storage.upload_dir(self.stage, self.storage.path(self.name))
        except BaseException as exc:  # reported by commit() in the training thread
            self.error = exc
        finally:
            self.snapshot = None  # free the in-memory copy
            if self.remote:
                shutil.rmtree(self.stage, ignore_errors=True)

    def _write(self) -> list[str]:
        snap, stage = self.snapshot, self.stage
        if snap.weights is not None:  # the folder is fresh: what is in it now is this checkpoint's
            save_model_files(self.model, stage, snap.weights, None, self.args)
        elif snap.model_files:  # the weights are every rank's shards: config, generation config, arguments
            save_model_metadata(self.model, stage, self.args)
        written = [piece for piece, state in snap.pieces if piece.write(state, stage)]
        files = [piece.file for piece in written if piece.every_rank] + snap.sharded
        if snap.model_files:  # the model's files and this rank's pieces; not another rank's
            own = tuple(f"{d}/" for d in snap.sharded_dirs)
            files += [n for n in _walk(stage) if not n.startswith("rng_state_")
                      and not (own and n.startswith(own))]
        return sorted(set(files))


class CheckpointWriter:
    def __init__(self, trainer, notify=None):
        self.trainer = trainer
        args = trainer.args
        self.storage = Storage.for_run(args)
        self.notify = notify  # called on rank 0 with each committed checkpoint
        self._pending: tuple[_Writer, int, dict] | None = None
        self._shared: bool | None = None  # save_on_each_node: does this node see rank 0's storage?

    def _probe_shared(self, stage: str) -> bool:
        """save_on_each_node: rank 0 leaves a marker in the checkpoint folder; a node that sees it shares the
        storage with rank 0, and writing its own copy of the same files there would only race with rank 0's
        (the same names, written and hashed at once). Checked once, at the first save (two barriers)."""
        ctx = self.trainer._ctx
        marker = os.path.join(stage, ".raytrainer-node-probe")
        if ctx.is_world_zero:
            open(marker, "w").close()
        ctx.barrier()
        seen = os.path.exists(marker)
        ctx.barrier()
        if ctx.is_world_zero:
            os.remove(marker)
        return seen

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def busy(self) -> bool:
        return self._pending is not None and self._pending[0].is_alive()

    # -- phase 1 ---------------------------------------------------------------------------------------
    def save(self, metrics: dict | None = None) -> str:
        self.commit()  # one save in flight at a time
        t, args = self.trainer, self.trainer.args
        ctx, state = t._ctx, t.state
        name = f"checkpoint-{state.global_step}"
        console.saving_checkpoint(self.storage.uri_of(name))
        remote = not self.storage.is_local
        stage = tempfile.mkdtemp(prefix=f"raytrainer-{name}-") if remote else self.storage.path(name)
        if not remote and ctx.is_world_zero and self.storage.exists(stage):
            self.storage.delete_dir(stage)  # a partial leftover, or an older run's: rewritten whole
        ctx.barrier()
        os.makedirs(stage, exist_ok=True)
        if args.save_on_each_node and not remote and self._shared is None:
            self._shared = self._probe_shared(stage)

        strategy = t._strategy
        sharded = strategy.sharded_state_dir is not None and not args.save_only_model
        # FSDP's SHARDED_STATE_DICT: every rank writes its shard of the model (save_sharded), none is gathered
        in_shards = sharded and strategy.saves_model_sharded(t.model_wrapped)
        weights = None if in_shards else strategy.full_state_dict(t.model_wrapped)  # a collective if sharded
        if state.best_global_step == state.global_step:
            state.best_model_checkpoint = self.storage.uri_of(name)
        state.stateful_callbacks = TrainerState(stateful_callbacks=[  # the control too, as transformers
            cb for cb in [*t.callback_handler.callbacks, t.control] if isinstance(cb, ExportableState)
        ]).stateful_callbacks
        pieces = training_pieces(strategy, t.model_wrapped, t.optimizer, t.lr_scheduler, state, ctx.rank,
                                 model_only=args.save_only_model)
        collected = {p.file: p.obj.state_dict() for p in pieces if p.collective}  # on every rank
        snap = _Snapshot()
        if sharded:  # started now by every rank (a collective); finished, hashed, uploaded in the background
            dirs = strategy.save_sharded(t.model_wrapped, t.optimizer, t.lr_scheduler, stage,
                                         state.global_step)
            snap.sharded_dirs = [dirs] if isinstance(dirs, str) else list(dirs)
            snap.sharded_writes = strategy.take_pending_writes()
            snap.own_writes = strategy.names_its_writes()
            ctx.barrier()
            snap.share = (ctx.rank, ctx.world_size, not remote)
        # save_on_each_node: a node's own copy, unless it would land in rank 0's folder (shared or remote)
        if ctx.is_world_zero or (args.save_on_each_node and ctx.is_local_zero and not remote
                                 and not self._shared):
            snap.model_files = True
            snap.weights = None if weights is None else _copy_tensors(weights)
            if t.processing_class is not None and hasattr(t.processing_class, "save_pretrained"):
                t.processing_class.save_pretrained(stage)  # rare and small: written right away
            writes = pieces
        else:
            writes = [p for p in pieces if p.every_rank]
        snap.pieces = [(p, _copy_tensors(collected[p.file] if p.collective else p.obj.state_dict()))
                       for p in writes]
        job = _Writer(snap, stage, self.storage, name, remote, t.model, args)
        job.start()
        self._pending = (job, state.global_step, dict(metrics or {}))
        return self.storage.uri_of(name)

    # -- phase 2 ---------------------------------------------------------------------------------------
    def commit(self) -> None:
        if self._pending is None:
            return
        job, step, metrics = self._pending
        self._pending = None
        job.join()
        ctx = self.trainer._ctx
        mine = f"{type(job.error).__name__}: {job.error}" if job.error else None
        failed = ctx.gather_object(mine)  # rank 0 names every rank's error; another rank its own
        seen = enumerate(failed) if ctx.is_world_zero else [(ctx.rank, mine)]
        errors = [f"rank {r}: {e}" for r, e in seen if e]
        if errors:
            files = f" (its files: {', '.join(job.files)})" if job.files else ""
            raise RuntimeError(
                f"writing checkpoint {self.storage.uri_of(job.name)}{files} failed, so it is not committed "
                f"(the checkpoints committed before it are intact): {'; '.join(errors)}") from job.error
        parts = ctx.gather_object(job.part)
        if ctx.is_world_zero:
            write_manifest(self.storage, job.name, parts, step)
        ctx.barrier()
        if ctx.reports_to_ray(self.storage.path(job.name)):
            import ray.train

            checkpoint = ray.train.Checkpoint(path=self.storage.path(job.name), filesystem=self.storage.fs)
            ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=job.name,
                             checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD)
        if ctx.is_world_zero and self.notify is not None:
            state = self.trainer.state
            self.notify(CheckpointCommitted(job.name, step, self.storage.uri_of(job.name),
                                            state.best_model_checkpoint, state.best_metric))


def _my_share(stage: str, subdirs: list[str], rank: int, world_size: int, shared: bool,
              own: list[str] | None = None) -> list[str]:
    """The strategy files this rank hashes: all of its private staging folder, or -- when every rank
    wrote into the same local folder -- the files it wrote itself where its writes name them (``own``:
    the other ranks' may still be being written), else every world_size-th file, so each file is hashed
    once."""
    if shared and own is not None:
        return sorted(os.path.relpath(path, stage) for path in own)
    prefixes = tuple(f"{d}/" for d in subdirs)
    names = sorted(n for n in _walk(stage) if n.startswith(prefixes))
    return names[rank::world_size] if shared else names


def _walk(folder: str) -> list[str]:
    out = []
    for root, _dirs, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return out


# -- resume ------------------------------------------------------------------------------------------
class Resume:
    """What a rank restores from a committed checkpoint, in the order the loop needs it."""

    def __init__(self, uri: str, rank: int, filesystem=None):
        self.reader = CheckpointReader(uri, filesystem)
        self.rank = rank
        self.state = state_from_dict(self.reader.json(TRAINER_STATE_NAME))

    @property
    def model_sharded(self) -> bool:
        """The checkpoint holds the model only as each rank's share, no consolidated weights: DCP shards
        (FSDP's ``pytorch_model_fsdp_0/``), loaded after the model is set up (``load_sharded_model``), or
        ZeRO-3 partitions, which the engine loads with its optimizer state
        (``load_optimizer_and_scheduler``)."""
        return holds_sharded_model(self.reader.files) or zero_model_tag(self.reader.files) is not None

    def load_model(self, model: torch.nn.Module) -> None:
        load_checkpoint_model(model, self.reader)

    def load_sharded_model(self, model: torch.nn.Module, ctx) -> None:
        """Every rank (a collective): the DCP model into the set-up ``model`` -- this rank's shards under
        FSDP, resharded from any number of writers; whole tensors under DDP or one worker. A ZeRO-3
        checkpoint's partitions come later, with the engine's optimizer state."""
        if not holds_sharded_model(self.reader.files):
            return
        from raytrainer.strategies.dcp import load_model

        load_model(model, self.reader, ctx)

    def load_optimizer_and_scheduler(self, strategy, model, optimizer, scheduler, ctx) -> None:
        """Each optimizer-side piece the checkpoint holds; the optimizer from the strategy's own folder where
        the checkpoint has no consolidated optimizer.pt (whatever this run would write)."""
        optimizer_piece, *others = optimizer_pieces(strategy, model, optimizer, scheduler, consolidated=True)
        if not optimizer_piece.load(self.reader) and self.sharded_files():
            strategy.load_sharded(model, optimizer, scheduler, self.reader, self.state.global_step)
        for piece in others:
            piece.load(self.reader)

    @property
    def world_size(self) -> int | None:
        """How many ranks wrote the checkpoint (one RNG state file each); None when it holds none."""
        ours = [n for n in self.reader.files if n.startswith("rng_state_") and n.endswith(".safetensors")]
        return len(ours) or None

    def sharded_files(self) -> list[str]:
        """A strategy's own training state: the files in sub-folders (optimizer_0/, global_step<N>/)."""
        from raytrainer.strategies.dcp import MODEL_DIR

        return sorted(n for n in self.reader.files if "/" in n and not n.startswith(f"{MODEL_DIR}/"))

    def restore_rng(self) -> None:
        name = rng_file(self.rank)
        if not self.reader.has(name):  # a different number of ranks than at save time
            name = rng_file(0)
        if Piece(name, RngState(), every_rank=True).load(self.reader):
            return
        pickled = sorted(n for n in self.reader.files if n.startswith("rng_state") and n.endswith(".pth"))
        if pickled and self.rank == 0:  # transformers.Trainer's: numpy and Python states, pickled
            logger.warning("%s: %s not restored: it is pickled (transformers.Trainer's format) and "
                           "raytrainer does not unpickle checkpoint files, so the random streams after the "
                           "resume differ from an uninterrupted run's.", self.reader.uri, ", ".join(pickled))


def restore_callbacks(stored: dict | None, handler, control, log=logger):
    """transformers' rule (``restore_callback_states_from_checkpoint``): each saved callback state whose
    class is among the Trainer's callbacks (or is the TrainerControl) is rebuilt from its saved constructor
    arguments and attributes and replaces those instances, in place; several instances of one class are
    matched in order. Returns the control to train with."""
    not_found = []
    for name, data in (stored or {}).items():
        data = data if isinstance(data, list) else [data]
        present = [cb for cb in [*handler.callbacks, control] if type(cb).__name__ == name]
        if not present:
            not_found.append(name)
            continue
        for callback, saved in zip(present, data):
            rebuilt = type(callback)(**saved.get("args", {}))
            for key, value in saved.get("attributes", {}).items():
                setattr(rebuilt, key, value)
            if isinstance(callback, TrainerControl):
                control = rebuilt
            else:
                handler.callbacks[handler.callbacks.index(callback)] = rebuilt
    if not_found:
        log.warning(f"Checkpoint included callbacks not included in current configuration. Ignoring. "
                    f"({', '.join(not_found)})")
    return control
