"""``train()`` of a raytrainer trainer in the driver's own process (``num_workers=0``, raytrainer/one_loop):
transformers' loop with the driver's and one rank's services around it, as on Ray workers.

The driver's side is the hosted trainer's (raytrainer/hosted.py, driver/runner.py): the checkpoint to resume
chosen and checked (``True``: the latest one committed to the run's storage), a damaged one the run chose
replaced by the committed one before it, the committed checkpoints pushed to the hub and rotated. The rank's
side is a hosted rank's layer (worker/hosted.rank_layer): each checkpoint transformers saves is written in
the background and committed to the storage with a manifest (worker/hosted_commit.py); a resume reads a
committed checkpoint verified against that manifest, or copies it from remote storage first
(worker/hosted_resume.py); a loss that is a mean is taken as one (worker/loss.py); ``nonfinite_loss``; a
resume on another world size is recorded. Only the transport differs: the
rank's checkpoint parts go to the driver's registry by a call, not over Ray.
"""

from __future__ import annotations

from collections.abc import Callable

from raytrainer.protocol import Kind


class _ToTheRegistry:
    """A rank's channel in the driver's own process: its checkpoint parts go straight to the registry."""

    def __init__(self, registry):
        self.registry = registry

    def send(self, kind: Kind, payload=None, urgent: bool = False) -> None:
        if kind is Kind.CHECKPOINT_PART:
            self.registry.add_part(payload)


def train(trainer, run: Callable, resume_from_checkpoint, kwargs: dict):
    """``run(resume_from_checkpoint=folder, **kwargs)`` (transformers' ``train``) for ``trainer``, whose
    arguments have the Ray fields, resuming ``resume_from_checkpoint`` as raytrainer resolves it."""
    from raytrainer.driver import preflight
    from raytrainer.driver.registry import CheckpointRegistry
    from raytrainer.driver.runner import train_sequence
    from raytrainer.hosted import resume_target
    from raytrainer.rank_context import local_context
    from raytrainer.worker.hosted_resume import localize, new_hyperparameters

    given = trainer.args
    registry = CheckpointRegistry(given)
    ctx = local_context(given)
    _act_as_a_rank(trainer, ctx, _ToTheRegistry(registry), given)

    def once(kw: dict):
        target = kw["resume_from_checkpoint"]
        resume = localize(target, given, ctx) if isinstance(target, str) else None
        if resume is None:
            return run(resume_from_checkpoint=target, **kwargs)
        trainer._raytrainer_saved_on = resume.saved_on  # worker/hosted.WorldSizeRecord's
        exploit = trainer.__dict__.get("_resume_with_new_hyperparameters", False)  # a PBT exploit's
        with resume.reading(trainer), new_hyperparameters(trainer, exploit):
            return run(resume_from_checkpoint=resume.folder, **kwargs)

    target = resume_target(given, resume_from_checkpoint)
    preflight.check_in_process(trainer, "train", {"resume_from_checkpoint": target})
    return train_sequence(trainer, {"resume_from_checkpoint": target}, resume_from_checkpoint, registry, once,
                          preflight.check_resume_target)


def _act_as_a_rank(trainer, ctx, channel, given) -> None:
    """A hosted rank's layer for ``trainer`` (worker/hosted.rank_layer), its checkpoints committed through
    ``channel``. Added once; the channel is replaced at each call (each ``train()`` has a registry of its
    own)."""
    from raytrainer.worker.agreement import layer_callback
    from raytrainer.worker.hosted import rank_layer
    from raytrainer.worker.hosted_commit import CommitCallback

    commit = layer_callback(trainer, CommitCallback)
    if commit is None:
        rank_layer(trainer, ctx, channel, given)
    else:
        commit.channel = channel
