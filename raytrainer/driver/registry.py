"""The driver's record of committed checkpoints: latest, best, and rotation. Only the driver deletes.

Rotation is transformers' (``trainer_utils.rotate_checkpoints``): the oldest committed checkpoints are
deleted until ``save_total_limit`` are left, never the newest (the one a resume would use) nor the best
(``best_model_checkpoint``), which count among the limit (so a limit of 1 keeps both). One rule, whether
transformers' loop also rotates (the storage is ``output_dir``) or only the driver does (other storage).
Partial folders (no manifest) are never deleted here: they are skipped, with a warning, by whoever reads
checkpoints.
"""

from __future__ import annotations

import logging
import os

from raytrainer.checkpoint import committed_checkpoints, write_manifest
from raytrainer.protocol import CheckpointCommitted, CheckpointPart
from raytrainer.storage import Storage, uri_basename

logger = logging.getLogger(__name__)


class CheckpointRegistry:
    def __init__(self, args):
        self.storage = Storage.for_run(args)
        self.limit = args.save_total_limit
        self.latest: str | None = None
        self.best: str | None = None
        self.listeners: list = []  # called with each committed checkpoint's info (e.g. the hub pusher)
        self.pinned: set[str] = set()  # checkpoint names rotation keeps for now (a push is reading them)
        self._parts: dict[str, list[CheckpointPart]] = {}  # a hosted trainer's checkpoints, being committed

    def add_part(self, part: CheckpointPart) -> None:
        """One rank's share of a hosted trainer's checkpoint is in storage; with the last share the driver
        writes the manifest (the commit) and records the checkpoint as ``add`` does."""
        parts = self._parts.setdefault(part.name, [])
        parts.append(part)
        if len(parts) < part.parts:
            return
        del self._parts[part.name]
        write_manifest(self.storage, part.name, [p.files for p in parts], part.step)
        best = next((p for p in parts if p.best_model_checkpoint), None)
        self.add(CheckpointCommitted(
            part.name, part.step, part.uri,
            self.storage.uri_of(best.best_model_checkpoint) if best else None, best and best.best_metric))

    def add(self, info: CheckpointCommitted) -> None:
        """A checkpoint was committed (called with rank 0's report, in commit order)."""
        self.latest = info.uri
        if info.best_model_checkpoint:
            self.best = info.best_model_checkpoint
        logger.info("checkpoint committed: %s", info.uri)
        for listener in self.listeners:
            listener(info)
        self.rotate()

    def end_of_training(self) -> list[str]:
        """transformers' last deletion (``Trainer._finalize_training``), once the call's checkpoints are
        committed: with ``save_total_limit=1`` and a best checkpoint, every other committed checkpoint goes,
        the latest too (the run is over; a push still reading one keeps it)."""
        if self.limit != 1 or not self.best:
            return []
        return self.rotate(keep_newest=False)

    def rotate(self, keep_newest: bool = True) -> list[str]:
        """Delete the oldest committed checkpoints until ``save_total_limit`` are left, never the best, one a
        push is reading, nor (``keep_newest``) the newest."""
        if not self.limit:
            return []
        names = [os.path.basename(path) for _, path in committed_checkpoints(self.storage, warn=False)]
        newest = (self.latest, *names[-1:]) if keep_newest else ()
        protected = {uri_basename(u) for u in (self.best, *newest) if u} | self.pinned
        keep = max(self.limit, len(protected.intersection(names)))
        deleted = []
        for name in names:  # oldest first
            if len(names) - len(deleted) <= keep:
                break
            if name not in protected:
                self.storage.delete_dir(self.storage.path(name))
                deleted.append(name)
                logger.info("deleted %s (save_total_limit=%d)", self.storage.uri_of(name), self.limit)
        return deleted
