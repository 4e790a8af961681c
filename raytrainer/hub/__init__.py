"""Hub pushes, run by the driver only: committed checkpoints (``hub_strategy``) and ``Trainer.push_to_hub``.

- ``targets``: the Hugging Face Hub through ``huggingface_hub.HfApi``, or any pyarrow filesystem URI
  given as ``hub_model_id`` (a plain model repository, one folder per revision).
- ``pusher``: the background thread that pushes, with HF's skip / wait rules.
- ``staging``: which files of a checkpoint a push takes (transformers' selection), streamed to local disk.
- ``model_card``: the README.md pushed with the final model.

The token (``hub_token``, ``HF_TOKEN`` or a stored login) stays in the driver: it is withheld from the
Trainer the workers receive, hidden in ``training_args.json`` (``to_dict``), and scrubbed from errors.
"""

from __future__ import annotations

import logging
import os

from raytrainer.args import token_withheld
from raytrainer.hub.pusher import HubPusher
from raytrainer.hub.targets import FilesystemTarget, HuggingFaceTarget, target_for

__all__ = ["FilesystemTarget", "HubPusher", "HuggingFaceTarget", "push_to_hub", "pusher_for",
           "target_for", "token_withheld"]

logger = logging.getLogger(__name__)

# What a final push leaves out of output_dir (HF's patterns, plus the per-rank log files).
IGNORE_PATTERNS = ["_*", "checkpoint-*", "logs/*", ".raytrainer*"]


def pusher_for(trainer) -> HubPusher:
    """The Trainer's pusher, made (and its target created and checked) on first use, on the driver."""
    if trainer._hub is None:
        target = target_for(trainer.args)
        target.create(trainer.args.hub_revision)
        trainer._hub = HubPusher(target, trainer.args, trainer)
    return trainer._hub


def for_training(trainer, registry) -> HubPusher | None:
    """With ``push_to_hub``: the pusher, watching the registry's committed checkpoints. Raises before any
    worker starts when the target cannot be used (no token, a folder that cannot be written, ...)."""
    if not trainer.args.push_to_hub:
        return None
    pusher = pusher_for(trainer)
    pusher.watch(registry)
    return pusher


def finish_training(pusher: HubPusher | None, registry) -> None:
    """End of train(): wait for pending pushes, say what failed, let rotation delete what they held."""
    if pusher is None:
        return
    failures = pusher.wait()
    registry.listeners.remove(pusher.on_checkpoint)
    registry.rotate()
    if failures:
        logger.warning("hub: %d push(es) to %s failed; the checkpoints are kept in storage:\n  %s",
                       len(failures), pusher.target.name, "\n  ".join(failures))


def push_to_hub(trainer, commit_message: str | None = "End of training", blocking: bool = True,
                token: str | None = None, revision: str | None = None, private: bool | None = None, **kwargs):
    """``Trainer.push_to_hub``: save the model and its card to ``output_dir``, then push that folder.

    Returns the target's commit (a ``huggingface_hub.CommitInfo``, or the revision URI of a filesystem
    repository), or a ``Future`` of it with ``blocking=False``."""
    from raytrainer.hub.model_card import create_model_card

    args = trainer.args
    trainer.callback_handler.on_push_begin(args, trainer.state, trainer.control)
    model_name = kwargs.pop("model_name", None)
    if model_name is None:
        model_name = (args.hub_model_id or os.path.abspath(args.output_dir)).rstrip("/").split("/")[-1]
    pusher = pusher_for_call(trainer, token, private, revision)
    trainer.save_model(_internal_call=True)
    model_tags = getattr(trainer.model, "model_tags", None)  # as transformers' push_to_hub adds them
    if model_tags is not None:
        tags = kwargs.get("tags") or []
        tags = kwargs["tags"] = [tags] if isinstance(tags, str) else tags
        tags.extend(t for t in model_tags if t not in tags)
    create_model_card(trainer, model_name=model_name, **kwargs)
    return upload_output_dir(pusher, args, commit_message, revision, blocking)


def pusher_for_call(trainer, token: str | None, private: bool | None, revision: str | None) -> HubPusher:
    """The Trainer's pusher, or a one-off one with the caller's token / privacy."""
    if token is None and private is None:
        return pusher_for(trainer)
    target = target_for(trainer.args, token)
    if private is not None and isinstance(target, HuggingFaceTarget):
        target.private = private
    target.create(revision or trainer.args.hub_revision)
    if trainer._hub is not None:
        trainer._hub.wait()
    return HubPusher(target, trainer.args, trainer)


def upload_output_dir(pusher: HubPusher, args, commit_message: str | None, revision: str | None,
                      blocking: bool):
    """Push ``output_dir`` (the saved model and its card) after the pushes already under way."""
    pusher.wait()
    future = pusher.submit("the model in " + args.output_dir, pusher.target.upload, args.output_dir, "",
                           commit_message or "End of training", revision or args.hub_revision,
                           IGNORE_PATTERNS, force=True)
    return future.result() if blocking else future
