"""Runs a Trainer method where the arguments say: in this process (``num_workers=0``) or on Ray workers.

Either way the same code path runs on each rank (``run_rank``); only the transport differs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import posixpath

from raytrainer import final_weights, hub
from raytrainer.callbacks import state_from_dict
from raytrainer.checkpoint import (
    CheckpointReader,
    DamagedCheckpointError,
    committed_checkpoints,
    load_checkpoint_model,
    load_weights_into,
    resolve_resume,
    step_of,
    zero_model_tag,
)
from raytrainer.data import is_ray_dataset
from raytrainer.driver import preflight
from raytrainer.driver.registry import CheckpointRegistry
from raytrainer.driver.spec import build as build_spec
from raytrainer.logging_utils import say
from raytrainer.protocol import RankResult, Spec
from raytrainer.rank_context import local_context
from raytrainer.storage import Storage, uri_basename
from raytrainer.worker.rank import run_rank
from raytrainer.worker.session import RankSession

logger = logging.getLogger(__name__)


def run(trainer, method: str, kwargs: dict):
    """Validate on the driver, run ``method`` on every rank, return rank 0's answer."""
    asked = kwargs.get("resume_from_checkpoint")
    if any(is_ray_dataset(d) for d in (trainer.train_dataset, trainer.eval_dataset, *kwargs.values())):
        # Ray Data would start Ray on its own (with no spare CPUs) on first use: start it our way first.
        from raytrainer.driver.ray_runtime import ensure_ray

        ensure_ray(trainer.args)
    if method == "train":  # True / a path / a checkpoint's name -> a committed checkpoint's URI, or None
        kwargs = {**kwargs, "resume_from_checkpoint": resolve_resume(Storage.for_run(trainer.args), asked)}
    preflight.check(trainer, method, kwargs)
    with hub.token_withheld(trainer.args):  # the Trainer the workers get never holds the hub token
        spec = build_spec(trainer, method, kwargs) if trainer.args.num_workers > 0 else None
    registry = CheckpointRegistry(trainer.args)

    if method != "train":
        return _run_once(trainer, spec, method, kwargs, registry)

    def once(kwargs: dict):  # the same Trainer, resuming from the checkpoint given (maybe the one before)
        resume = {"resume_from_checkpoint": kwargs["resume_from_checkpoint"]}
        run_spec = spec and dataclasses.replace(spec, kwargs={**spec.kwargs, **resume})
        return _run_once(trainer, run_spec, method, kwargs, registry)

    output = train_sequence(trainer, kwargs, asked, registry, once, preflight.check_resume_target)
    trainer.__dict__.pop("_init_mem_metrics", None)  # reported by this run (a worker's copy on Ray)
    keep_final_state(trainer)
    if trainer.args.load_best_model_at_end:
        _load_best_model(trainer)
    return output


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


def _run_once(trainer, spec: Spec | None, method: str, kwargs: dict, registry: CheckpointRegistry):
    if spec is None:
        return _run_local(trainer, method, kwargs, registry)
    from raytrainer.driver.launch import launch

    return _absorb(trainer, method, launch(trainer, spec, method, registry))


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


def _run_local(trainer, method: str, kwargs: dict, registry: CheckpointRegistry):
    session = RankSession(local_context(trainer.args), checkpoint_sink=registry.add)
    try:
        return run_rank(trainer, session, method, kwargs).output
    finally:
        trainer.model_wrapped = trainer.model


def _load_best_model(trainer) -> None:
    """load_best_model_at_end: the best committed checkpoint's weights go into ``trainer.model``."""
    best = trainer.state.best_model_checkpoint
    if not best:
        logger.warning("load_best_model_at_end: no best checkpoint was saved; keeping the final weights.")
        return
    reader = CheckpointReader(best, trainer.args.storage_filesystem)  # a committed checkpoint: checked now
    trainer._weights_pending(functools.partial(_load_checkpoint_weights, reader=reader))
    logger.info("the best model is %s (%s = %s): trainer.model loads it on first use", best,
                trainer.args.metric_for_best_model, trainer.state.best_metric)


def _load_checkpoint_weights(model, reader: CheckpointReader) -> None:
    tag = zero_model_tag(reader.files)
    if tag is None:
        load_checkpoint_model(model, reader)
        return
    from raytrainer.strategies.deepspeed_load import zero_weights

    load_weights_into(model, zero_weights(reader, tag), reader.uri)  # ZeRO-3: only the engine's partitions


def _absorb(trainer, method: str, result: RankResult):
    """Take rank 0's answer into the driver's Trainer: after train() the final state and where the trained
    weights are (``trainer.model`` loads them on first access); after every call the state its worker-side
    callbacks recorded."""
    from raytrainer.worker.rank import absorb_callback_states

    if method == "train":
        trainer._weights_pending(functools.partial(final_weights.load_into, uri=result.weights_at,
                                                   filesystem=trainer.args.storage_filesystem))
        trainer.state = state_from_dict(result.state)
    absorb_callback_states(trainer.callback_handler.callbacks, result.callbacks)
    return result.output
