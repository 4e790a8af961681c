"""``train()`` on the driver, for every trainer on Ray workers and in this process (raytrainer/hosted.py,
raytrainer/in_process.py): the hub's pusher follows the committed checkpoints, a damaged checkpoint that
raytrainer chose falls back to the committed one before it, and the run's final state is kept for
``raytrainer plot``."""

from __future__ import annotations

import logging
import os
import posixpath

from raytrainer import hub
from raytrainer.checkpoint import DamagedCheckpointError, committed_checkpoints, step_of
from raytrainer.driver.registry import CheckpointRegistry
from raytrainer.logging_utils import say
from raytrainer.storage import Storage, uri_basename

logger = logging.getLogger(__name__)


def keep_final_state(trainer) -> None:
    """After a ``train()`` on Ray workers, the run's final ``TrainerState`` in the driver's
    ``output_dir/.raytrainer/trainer_state.json``: what ``raytrainer plot`` draws from a run that saved no
    checkpoint (a run in this process leaves ``output_dir`` as transformers does: ``save_state()`` writes
    it there)."""
    if trainer.args.num_workers > 0:
        from raytrainer.plot import FINAL_STATE  # the path the plot command reads (plot.py: stdlib only)

        path = os.path.join(trainer.args.output_dir, FINAL_STATE)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        trainer.state.save_to_json(path)


def train_sequence(trainer, kwargs: dict, asked, registry: CheckpointRegistry, once, check_target=None):
    """``train()`` on the driver, for every host: the hub's pusher follows the registry's commits (checked
    before any worker starts; its pending pushes end before this returns), and a resume that meets a
    damaged checkpoint it chose itself goes on from the committed one before it (``_earlier_checkpoint``;
    ``check_target``: can this run resume that one). ``once(kwargs)`` runs ``train`` on every rank."""
    pusher = hub.for_training(trainer, registry)
    try:
        while True:
            if kwargs.get("resume_from_checkpoint"):
                target = kwargs["resume_from_checkpoint"]
                step = step_of(target)
                after = "" if step is None else f": training continues after step {step}"
                say(f"resuming from {target}{after}")
            try:
                output = once(kwargs)
                _best_as_committed(trainer.state, registry)
                registry.end_of_training()
                return output
            except DamagedCheckpointError as exc:
                instead = _earlier_checkpoint(trainer, exc, asked)
                if check_target is not None:
                    check_target(trainer, instead)
                kwargs = {**kwargs, "resume_from_checkpoint": instead}
    finally:
        hub.finish_training(pusher, registry)


def _best_as_committed(state, registry: CheckpointRegistry) -> None:
    """transformers' loop names the best checkpoint by its folder in ``output_dir``; where the run's
    storage is elsewhere (``storage_path``), the state names it where it is committed, as every other
    checkpoint of the run is named (the local copy is gone: worker/hosted_commit.py)."""
    best, committed = state.best_model_checkpoint, registry.best
    if (best and committed and os.path.basename(best) == uri_basename(committed)
            and os.path.abspath(best) != os.path.abspath(committed)):
        state.best_model_checkpoint = committed


def _earlier_checkpoint(trainer, exc: DamagedCheckpointError, asked) -> str:
    """The checkpoint to resume from instead of the damaged one ``exc`` names: the latest committed one
    before it. Only where the choice was raytrainer's (``resume_from_checkpoint=True``, or a restart
    resuming the run's own latest checkpoint); a checkpoint the user named is theirs to replace (raised)."""
    damaged, storage = exc.checkpoint, Storage.for_run(trainer.args)
    if storage.uri_of(posixpath.basename(damaged)) != damaged:  # not one of this run's checkpoints
        raise exc
    if asked not in (None, False, True) and storage.at(str(asked)).uri == damaged:
        raise exc
    bad = step_of(damaged)
    earlier = [path for step, path in committed_checkpoints(storage, warn=False) if bad is None or step < bad]
    if not earlier:
        exc.add_note(f"no committed checkpoint earlier than {damaged} to resume from instead")
        raise exc
    instead = storage.uri_of(posixpath.basename(earlier[-1]))
    logger.warning("%s is damaged (%s); resuming from %s, the latest committed checkpoint before it.",
                   damaged, exc, instead)
    return instead
