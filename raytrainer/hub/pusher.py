"""The driver's background pusher: one worker thread per target, so training never waits for a push.

HF's rules: a checkpoint push is skipped while the previous push is still running, unless
``hub_always_push`` (then it queues behind it); ``train()`` waits for pending pushes at the end; an
explicit ``push_to_hub()`` waits for the current push, then pushes. A failed push is logged with what
failed (the token scrubbed) and kept in ``failures``; the checkpoint stays in storage.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor

from raytrainer.arg_types import HubStrategy, SaveStrategy
from raytrainer.storage import Storage

logger = logging.getLogger(__name__)

# Files of a checkpoint that are training state, not the model: not pushed to the repository's root.
_STATE_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "trainer_state.json", "manifest.json")


def _is_model_file(rel: str) -> bool:
    return rel not in _STATE_FILES and not rel.startswith("rng_state_")


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

    def on_checkpoint(self, info: dict) -> None:
        """A checkpoint was committed (the driver's registry, in commit order): push it in the background."""
        if self.args.hub_strategy == HubStrategy.END:
            return
        name = info["name"]
        if self.registry is not None:
            self.registry.pinned = self.registry.pinned | {name}  # a swap: rotation may read it meanwhile
        if self.trainer is not None:
            self.trainer.callback_handler.on_push_begin(self.args, self.trainer.state, self.trainer.control)
        if self.submit(name, self._push_checkpoint, info) is None:
            self._unpin(name)

    def _unpin(self, name: str) -> None:
        if self.registry is not None:
            self.registry.pinned = self.registry.pinned - {name}

    def _push_checkpoint(self, info: dict):
        name = info["name"]
        try:
            with tempfile.TemporaryDirectory(prefix="raytrainer-hub-") as tmp:
                whole = self.args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS)
                folder = _local_copy(info["uri"], os.path.join(tmp, name), self.args.storage_filesystem,
                                     None if whole else _needed_for_model)
                model_dir = os.path.join(tmp, "model")
                os.makedirs(model_dir)
                for rel in os.listdir(folder):
                    if os.path.isfile(os.path.join(folder, rel)) and _is_model_file(rel):
                        shutil.copy(os.path.join(folder, rel), os.path.join(model_dir, rel))
                message = self._message(folder, info)
                revision = self.args.hub_revision
                results = [self.target.upload(model_dir, "", message, revision)]
                if self.args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
                    path = "last-checkpoint" if self.args.hub_strategy == HubStrategy.CHECKPOINT else name
                    results.append(self.target.upload(folder, path, message + ", checkpoint", revision))
                return results
        finally:
            self._unpin(name)

    def _message(self, folder: str, info: dict) -> str:
        if self.args.save_strategy == SaveStrategy.STEPS:
            return f"Training in progress, step {info['step']}"
        import json

        with open(os.path.join(folder, "trainer_state.json")) as f:
            epoch = json.load(f).get("epoch") or 0
        return f"Training in progress, epoch {round(epoch)}"


def _needed_for_model(rel: str) -> bool:
    """The files a model-only push reads: the model's own, and the state for the commit message."""
    return "/" not in rel and (_is_model_file(rel) or rel == "trainer_state.json")


def _local_copy(uri: str, dest: str, filesystem=None, keep=None) -> str:
    """A local folder with the checkpoint's files (those ``keep`` accepts): the folder itself when local,
    else a streamed download -- of the model files alone for a model-only push, not the optimizer state."""
    storage = Storage.from_uri(uri, filesystem)
    if storage.is_local:
        return storage.root
    os.makedirs(dest)
    for rel in storage.list_files(storage.root):
        if keep is None or keep(rel):
            storage.download(storage.path(rel), os.path.join(dest, rel))
    return dest
