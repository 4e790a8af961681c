"""The driver's background pusher: one worker thread per target, so training never waits for a push.

HF's rules: a checkpoint push is skipped while the previous push is still running, unless
``hub_always_push`` (then it queues behind it); ``train()`` waits for pending pushes at the end; an
explicit ``push_to_hub()`` waits for the current push, then pushes. A failed push is logged with what
failed (the token scrubbed) and kept in ``failures``; the checkpoint stays in storage.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor

from raytrainer.arg_types import HubStrategy, SaveStrategy
from raytrainer.hub import staging
from raytrainer.protocol import CheckpointCommitted
from raytrainer.storage import Storage

logger = logging.getLogger(__name__)


class HubPusher:
    def __init__(self, target, args, trainer=None):
        self.target = target
        self.args = args
        self.trainer = trainer
        self.failures: list[str] = []
        self.results: list = []
        self.registry = None  # set by watch(): pins checkpoints while they are pushed
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raytrainer-hub")
        self._futures: list[Future] = []

    # -- scheduling --------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return any(not f.done() for f in self._futures)

    def submit(self, what: str, fn, *fn_args, force: bool = False) -> Future | None:
        """Run ``fn`` on the push thread; skipped (None) while a push runs, unless forced/hub_always_push."""
        if self.busy and not (force or self.args.hub_always_push):
            logger.info("hub: not pushing %s: the previous push to %s is still running "
                        "(hub_always_push=False)", what, self.target.name)
            return None
        future = self._executor.submit(self._run, what, fn, *fn_args)
        self._futures = [f for f in self._futures if not f.done()] + [future]
        return future

    def _run(self, what: str, fn, *fn_args):
        try:
            result = fn(*fn_args)
        except Exception as exc:
            message = self.target.scrub(f"{type(exc).__name__}: {exc}")
            self.failures.append(f"{what}: {message}")
            logger.error("hub: pushing %s to %s failed (%s); the local files are kept", what,
                         self.target.name, message)
            raise RuntimeError(f"pushing {what} to {self.target.name} failed: {message}") from None
        self.results.append(result)
        logger.info("hub: pushed %s to %s", what, self.target.name)
        return result

    def wait(self) -> list[str]:
        """Wait for every pending push; return the failures so far."""
        for future in list(self._futures):
            future.exception()  # waits; the error was logged where it happened
        return list(self.failures)

    def close(self) -> None:
        self.wait()
        self._executor.shutdown(wait=True)

    # -- checkpoints (hub_strategy every_save / checkpoint / all_checkpoints) -------------------------
    def watch(self, registry) -> None:
        self.registry = registry
        registry.listeners.append(self.on_checkpoint)

    def on_checkpoint(self, info: CheckpointCommitted) -> None:
        """A checkpoint was committed (the driver's registry, in commit order): push it in the background."""
        if self.args.hub_strategy == HubStrategy.END:
            return
        name = info.name
        if self.registry is not None:
            self.registry.pinned = self.registry.pinned | {name}  # a swap: rotation may read it meanwhile
        if self.trainer is not None:
            self.trainer.callback_handler.on_push_begin(self.args, self.trainer.state, self.trainer.control)
        if self.submit(name, self._push_checkpoint, info) is None:
            self._unpin(name)

    def _unpin(self, name: str) -> None:
        if self.registry is not None:
            self.registry.pinned = self.registry.pinned - {name}

    def _push_checkpoint(self, info: CheckpointCommitted):
        """The model's files at the repository's root (see ``staging``); with hub_strategy checkpoint /
        all_checkpoints also the whole checkpoint, optimizer state included, so it can be resumed from."""
        name = info.name
        try:
            storage = Storage.from_uri(info.uri, self.args.storage_filesystem)
            with tempfile.TemporaryDirectory(prefix="raytrainer-hub-") as tmp:
                whole = self.args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS)
                folder = staging.local_checkpoint(storage, os.path.join(tmp, name)) if whole else None
                source = Storage.from_uri(folder) if whole else storage  # not downloaded twice
                model_dir = staging.stage(source, staging.model_files(source), os.path.join(tmp, "model"))
                self._save_processing_class(model_dir)
                message = self._message(source, info)
                revision = self.args.hub_revision
                results = [self.target.upload(model_dir, "", message, revision)]
                if whole:
                    path = "last-checkpoint" if self.args.hub_strategy == HubStrategy.CHECKPOINT else name
                    results.append(self.target.upload(folder, path, message + ", checkpoint", revision))
                return results
        finally:
            self._unpin(name)

    def _save_processing_class(self, folder: str) -> None:
        """Saved again rather than picked from the checkpoint, as transformers does: its files have no
        fixed names (tokenizer.json, vocab.txt, spiece.model, preprocessor_config.json, ...)."""
        processing_class = getattr(self.trainer, "processing_class", None)
        if processing_class is not None and hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(folder)

    def _message(self, storage: Storage, info: CheckpointCommitted) -> str:
        if self.args.save_strategy == SaveStrategy.STEPS:
            return f"Training in progress, step {info.step}"
        epoch = json.loads(storage.read_bytes(storage.path("trainer_state.json"))).get("epoch") or 0
        return f"Training in progress, epoch {round(epoch)}"
