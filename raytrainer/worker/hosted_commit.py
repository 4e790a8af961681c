"""Checkpoints of a hosted trainer (raytrainer/hosted.py) committed to the run's storage, as raytrainer's own
Trainer commits its own.

transformers' loop writes ``<output_dir>/checkpoint-<step>`` on each rank as it always does (weights,
optimizer, scheduler, ``trainer_state.json`` from rank 0; ``rng_state_<rank>.pth`` and a strategy's shards
from every rank; each on its own node's disk), the weights, optimizer and scheduler in the background
(worker/hosted_saves.py). At ``on_save`` each rank starts a thread of its own, so training goes on: it waits
for this rank's writes, then for every rank's (a barrier on a gloo group beside the step's); the lowest
local rank of each node lists that node's copy of the folder, and each file goes to the first rank that
has it: on a shared file system rank 0 takes them all, on local disks each node takes what its ranks
wrote. Each such rank then hashes its files and, when the storage is not ``output_dir`` itself
(``storage_path``: ``s3://``, another folder), copies them there, and sends the driver its part. The
driver writes ``manifest.json`` when every part has arrived (the commit) and rotates (driver/registry.py).
In another storage, once every rank has sent its share, each node removes its local copy (at 70B a
checkpoint is ~1 TB with its optimizer: kept, each node's disk would fill beside the storage meant for it);
the best checkpoint's copy stays while it is the best, for ``load_best_model_at_end``, and the driver's
``state.best_model_checkpoint`` names the committed one (driver/runner.py).

As transformers' next save begins (it may rotate the local folders away: a save at a step, an epoch's
end or a new best metric) and at the end of training, each rank waits for its thread. A resume reads a
committed checkpoint verified against its manifest, each rank its share (worker/hosted_resume.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from transformers.trainer_callback import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from raytrainer.checkpoint import (
    MANIFEST,
    digest_files,
    read_manifest,
)
from raytrainer.protocol import CheckpointPart, Kind
from raytrainer.rank_context import side_group
from raytrainer.storage import Storage

logger = logging.getLogger(__name__)

#: How long ``CommitCallback.commit`` waits for the driver's manifest (its parts are urgent messages).
COMMIT_WAIT_S = 60.0


class CheckpointWriteError(RuntimeError):
    """A rank's background write of a checkpoint failed (every rank raises it, naming each rank's error)."""


def assign(listings: list[list[str] | None]) -> list[list[str]]:
    """Each file to the first rank whose listing has it (rank order): ``listings[r]`` is None for a rank that
    did not list (not its node's lowest local rank)."""
    owner: dict[str, int] = {}
    for rank, names in enumerate(listings):
        for name in names or ():
            owner.setdefault(name, rank)
    shares: list[list[str]] = [[] for _ in listings]
    for name, rank in sorted(owner.items()):
        shares[rank].append(name)
    return shares


class CommitCallback(TrainerCallback):
    """On every rank of a hosted trainer: each checkpoint transformers saves becomes a committed one.
    ``saves``: the trainer's background writes (worker/hosted_saves.py), which a commit waits for."""

    def __init__(self, ctx, channel, args, saves=None):
        self.ctx, self.channel, self.saves = ctx, channel, saves
        self.storage = Storage.for_run(args)
        self.in_place = self.storage.is_local and self.storage.root == os.path.abspath(args.output_dir)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._saved: str | None = None  # the last checkpoint's name, until commit()
        self._kept: str | None = None  # the local copy kept for load_best_model_at_end (another storage)
        if saves is not None:  # transformers' next save may rotate the folder this thread reads: it waits
            saves.before_each.append(self.wait)  # whatever asked for it (a step, an epoch, a new best metric)
            saves.driver_rotates = self.in_place  # the committed folders are the driver's to delete

    def on_save(self, args, state, control, **kwargs):
        self.wait()
        name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        best = state.best_model_checkpoint if self.ctx.is_world_zero else None
        info = dict(name=name, step=state.global_step, uri=self.storage.uri_of(name),
                    best_metric=state.best_metric,
                    best_model_checkpoint=os.path.basename(best) if best else None)
        writes = self.saves.take() if self.saves is not None else []
        group = side_group("hosted-commit") if self.ctx.distributed else None  # made here: a collective
        self._saved = name
        # transformers loads the best checkpoint from its local folder at the end
        keep = bool(args.load_best_model_at_end and state.best_model_checkpoint
                    and os.path.basename(state.best_model_checkpoint) == name)
        self._thread = threading.Thread(target=self._commit,
                                        args=(os.path.join(args.output_dir, name), writes, group, info, keep),
                                        daemon=True, name=f"raytrainer-commit-{name}")
        self._thread.start()

    def _commit(self, folder: str, writes: list, group, info: dict, keep: bool) -> None:
        """On a thread of this rank: its writes end; every rank's (a barrier on ``group``, beside the
        step's); each file goes to the first rank whose node lists it; this rank hashes (and uploads) its
        share and sends the driver its part. A rank whose write failed tells the others, so every rank
        fails the run at its next wait, naming it, rather than wait for it. In another storage than
        ``output_dir``, the node's local copy is then removed (``_drop_local``)."""
        try:
            failed = None
            try:
                for write in writes:
                    write.result()
            except BaseException as exc:
                failed = f"{type(exc).__name__}: {exc}"
            self.ctx.barrier(group)  # every rank's files of this save are written
            # [] where the node has none; never an earlier commit's manifest (a save into the same folder)
            listing = sorted(n for n in _walk(folder) if n != MANIFEST) if self.ctx.is_local_zero else None
            reports = self.ctx.all_gather_object((listing, failed), group)
            errors = [f"rank {rank}: {error}" for rank, (_, error) in enumerate(reports) if error]
            if errors:
                raise CheckpointWriteError(
                    f"writing checkpoint {info['uri']} failed, so it is not committed (the checkpoints "
                    f"committed before it are intact): {'; '.join(errors)}")
            shares = assign([listing for listing, _ in reports])
            mine, sent = shares[self.ctx.rank], None
            try:
                if mine:
                    self._send_share(folder, mine, info, sum(1 for share in shares if share))
            except Exception as exc:
                sent = exc
            if not self.in_place:
                self._drop_local(folder, keep, all_sent=self.ctx.all_gather_object(sent is None, group))
            if sent is not None:
                raise sent
        except BaseException as exc:  # raised on the training thread at the next wait()
            self._error = exc

    def _send_share(self, folder: str, mine: list[str], info: dict, parts: int) -> None:
        """This rank's files of the checkpoint: hashed, copied to the storage unless it is ``output_dir``,
        and its part sent to the driver."""
        files = digest_files(folder, mine)
        if not self.in_place:
            try:
                for rel in mine:
                    self.storage.upload_file(os.path.join(folder, rel), self.storage.path(info["name"], rel))
            except Exception as exc:
                raise CheckpointWriteError(
                    f"uploading checkpoint {info['uri']} (its files: {', '.join(mine)}) failed, so it is not "
                    f"committed (the checkpoints committed before it are intact): {type(exc).__name__}: "
                    f"{exc}") from exc
        self.channel.send(Kind.CHECKPOINT_PART, CheckpointPart(files=files, parts=parts, **info), urgent=True)

    def _drop_local(self, folder: str, keep: bool, all_sent: list[bool]) -> None:
        """Once every rank has read its share (``all_sent``: a collective, so no rank is still hashing or
        uploading), the node's local copy of a checkpoint committed to another storage is removed, as
        raytrainer's own loop never writes one: a run's checkpoints would otherwise fill each node's disk
        beside the storage meant for them. The copy of the best checkpoint stays while it is the best
        (transformers reads it for ``load_best_model_at_end``); a resume reads the storage's."""
        import shutil

        if not (all(all_sent) and self.ctx.is_local_zero):
            return
        drop = [self._kept] if keep and self._kept not in (None, folder) else []
        if keep:
            self._kept = folder
        else:
            drop.append(folder)
        for path in drop:
            shutil.rmtree(path, ignore_errors=True)

    def wait(self) -> None:
        """The last checkpoint's files are written, hashed and in storage (its part sent to the driver)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CheckpointWriteError):  # names the checkpoint and each rank's error
                raise error
            raise RuntimeError(f"committing a checkpoint to {self.storage.uri} failed: {error}") from error

    def commit(self) -> None:
        """The checkpoint last saved is committed when this returns on any rank: every rank's part is sent,
        and rank 0 has seen the driver's manifest in storage (at most ``COMMIT_WAIT_S``; else it says so)
        while the others wait at a barrier. A preemption's hold (worker/preemption.py) waits here before it
        says the checkpoint is committed. A collective: every rank calls it at the same step."""
        self.wait()
        name, self._saved = self._saved, None
        if name is not None and self.ctx.is_world_zero:
            folder, deadline = self.storage.path(name), time.monotonic() + COMMIT_WAIT_S
            while read_manifest(self.storage, folder) is None:
                if time.monotonic() > deadline:
                    logger.warning("%s: the driver has not written its manifest within %.0f s", name,
                                   COMMIT_WAIT_S)
                    break
                time.sleep(0.1)
        self.ctx.barrier()

    def on_train_end(self, args, state, control, **kwargs):
        self.wait()



def commit_jit_checkpoints(trainer, commit: CommitCallback) -> None:
    """``enable_jit_checkpoint``: transformers' JIT callback saves on a SIGTERM by calling
    ``_save_checkpoint`` itself, with no ``on_save`` event; each such checkpoint is committed as a saved one
    is (``commit``'s ``on_save`` once the JIT save returns). On a Ray worker's rank transformers' handler is
    off (raytrainer's own takes the SIGTERM: worker/signals.py); this is for the driver's process."""
    for callback in trainer.callback_handler.callbacks:
        manager = getattr(callback, "jit_manager", None)
        if manager is None:
            continue
        if getattr(manager, "_raytrainer_commit", None) is None:  # wrapped once; a later call's commit
            execute = manager.execute_jit_checkpoint

            def execute_and_commit(execute=execute, manager=manager):
                execute()
                manager._raytrainer_commit.on_save(trainer.args, trainer.state, trainer.control)

            manager.execute_jit_checkpoint = execute_and_commit
        manager._raytrainer_commit = commit


def _walk(folder: str) -> list[str]:
    """Every file under ``folder``, as paths relative to it."""
    out = []
    for root, _dirs, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return out
