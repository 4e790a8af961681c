"""A rank's side of a hosted trainer (raytrainer/hosted.py): build the `transformers.Trainer` subclass from
its recipe once, keep it for the group's next calls, run each call on it with transformers' own loop.

Each rank runs in the driver's working directory and imports from its import path (worker/place.py), so a
model folder, a data file, ``output_dir`` or a reward module beside the script mean what they mean there.
Display callbacks (transformers' progress bar and printer) run on the
driver: rank 0 relays the events they need (worker/relay.py). Each checkpoint transformers saves is
committed to the run's storage (worker/hosted_commit.py). On CPU workers ``fsdp`` shards as it does on GPUs
(worker/hosted_sharding.py). After a lost worker Ray Train restarts the group
and ``train`` resumes from the latest committed checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging

from transformers import TrainerCallback

from raytrainer.hosted_callbacks import apply_edits
from raytrainer.protocol import RankResult
from raytrainer.worker.hosted_evaluation import evaluate_as_one_process
from raytrainer.worker.hosted_resume import LoaderSeedOffTheStream, Resume, localize, new_hyperparameters
from raytrainer.worker.hosted_sharding import build_trainer
from raytrainer.worker.logs import rank_logging
from raytrainer.worker.loss import adapt_mean_losses
from raytrainer.worker.rank import absorb_callback_states, after_restart, callback_states
from raytrainer.worker.session import RankSession

logger = logging.getLogger(__name__)

#: This worker's trainers, by recipe key: those of the driver's hosted trainers that may call again (the
#: command's ``keep``), as the script's process would hold them; any other is freed at the next command.
_LIVE: dict = {}


def run_hosted(recipe, session: RankSession, method: str, kwargs: dict, payload: list = (),
               keep: tuple = ()) -> RankResult:
    """``method`` of this rank's trainer for ``recipe`` (built now, from the ``payload`` fetched from the
    object store, if this worker has not got it); the trainers of recipes not in ``keep`` are freed first."""
    ctx, channel = session.ctx, session.channel
    kwargs = dict(kwargs)
    trained = kwargs.pop("trained_weights", None)  # where the driver's trainer's last train() left them
    trained_state = kwargs.pop("trained_state", None)  # and the driver's state after it
    driver_callbacks = kwargs.pop("callback_states", None)  # the state of the driver's callbacks
    for key in [key for key in _LIVE if key != recipe.key and key not in keep]:
        del _LIVE[key]
    trainer = _LIVE.get(recipe.key)
    if trainer is None:
        fetched = recipe.fetched(payload)
        trainer_cls, args, kwargs_init, targs, given = fetched.unpack(ctx.world_size)
        with rank_logging(targs, ctx.rank, channel, session.transformers_log_level):
            trainer = build_trainer(trainer_cls, args, kwargs_init, targs,
                                    again=lambda: fetched.unpack(ctx.world_size)[1:3])
            trainer._raytrainer_elastic = getattr(given, "elastic", False)
            trainer._raytrainer_given = given  # the arguments with their Ray fields (the run's storage)
            apply_edits(trainer, fetched.callback_edits())  # the driver's add_callback, remove_callback...
            absorb_callback_states(trainer.callback_handler.callbacks, driver_callbacks)
            _split_callbacks(trainer, session, given)
            if trained is not None:  # built anew after a train(): a new group's, a restarted group's
                from raytrainer import final_weights

                final_weights.load_on_ranks(trainer.model, trained,
                                            getattr(given, "storage_filesystem", None))
                if trained_state is not None:  # an evaluation logs at the trained step and epoch
                    from raytrainer.callbacks import state_from_dict

                    trainer.state = state_from_dict(trained_state)
        _LIVE[recipe.key] = trainer
    with rank_logging(trainer.args, ctx.rank, channel, session.transformers_log_level):
        kwargs = after_restart(trainer, session, method, kwargs)
        if kwargs is None:  # an earlier attempt failed deterministically: the driver raises its error
            return RankResult(global_step=0)
        final = kwargs.pop("final_weights", None) if method == "train" else None
        exploit = kwargs.pop("new_hyperparameters", False) if method == "train" else False  # PBT's
        if method == "train":
            _follow_the_driver(trainer, session, kwargs.pop("stop_from_driver", False))
            _save_on_preemption(trainer, session)
        resume = Resume(None)
        if method == "train" and isinstance(kwargs.get("resume_from_checkpoint"), str):
            resume = localize(kwargs["resume_from_checkpoint"], trainer.args, ctx)
            kwargs = {**kwargs, "resume_from_checkpoint": resume.folder}
            trainer._raytrainer_saved_on = resume.saved_on  # WorldSizeRecord's
        if method in ("evaluate", "predict"):  # train: at on_train_begin, on the model it trains
            adapt_mean_losses(trainer)
        if method in ("train", "evaluate", "predict"):
            evaluate_as_one_process(trainer, ctx)
        logged = len(trainer.state.log_history)
        if method == "call":
            found = functools.reduce(getattr, kwargs["name"].split("."), trainer)
            with _loaders_of_one_process(trainer, kwargs["name"]):
                output = found(*kwargs["args"], **kwargs["kwargs"]) if kwargs["call"] else found
        else:
            if method == "train":
                wrap_after_evaluation(trainer)
            with resume.reading(trainer), new_hyperparameters(trainer, exploit), _config_kept(trainer):
                output = getattr(trainer, method)(**kwargs)
        weights_at = _write_final_weights(trainer, ctx, final)
    if not ctx.is_world_zero:
        return RankResult(trainer.state.global_step)
    from raytrainer.callbacks import state_to_dict

    return RankResult(trainer.state.global_step, output, state_to_dict(trainer.state), weights_at,
                      callback_states(trainer.callback_handler.callbacks),
                      None if method in ("train", "call") else trainer.state.log_history[logged:])


@contextlib.contextmanager
def _loaders_of_one_process(trainer, name: str):
    """A loader the driver's script asks for (``trainer.get_train_dataloader()`` between calls) is what one
    process gets, every example once per epoch, as from transformers in one process, not rank 0's share:
    accelerate's ``prepare`` for one process; the rank's own cached evaluation loaders kept as they were."""
    if name not in ("get_train_dataloader", "get_eval_dataloader", "get_test_dataloader"):
        yield
        return
    from accelerate.data_loader import prepare_data_loader

    accelerator, cached = trainer.accelerator, dict(vars(trainer).get("_eval_dataloaders", {}))
    config = accelerator.dataloader_config
    accelerator.prepare = functools.partial(
        prepare_data_loader, num_processes=1, process_index=0, put_on_device=False,
        use_seedable_sampler=config.use_seedable_sampler, data_seed=config.data_seed)
    try:
        yield
    finally:
        del accelerator.prepare  # the class's own again
        vars(trainer).pop("_eval_dataloaders", None)
        if cached:
            trainer._eval_dataloaders = cached


def _write_final_weights(trainer, ctx, wanted: str | None) -> str | None:
    """After ``train()``, the trained weights into the run's storage (raytrainer/final_weights.py, every
    rank its share), when the driver holds a module to read them into: ``wanted`` is its class's name, or
    ``"model_init"`` (the driver builds one when ``trainer.model`` is used). A PEFT model's adapter goes the
    way of ``save_model`` (hosted.HostedTrainer.model)."""
    from transformers.trainer_utils import _is_peft_model

    from raytrainer import final_weights

    if wanted is None:
        return None
    trained = trainer.accelerator.unwrap_model(trainer.model)
    classes = {cls.__qualname__ for cls in type(trained).__mro__}  # FSDP2 makes FSDP<class> of it
    if _is_peft_model(trained) or (wanted != "model_init" and wanted not in classes):
        return None
    return final_weights.write_hosted(trainer, ctx, trainer._raytrainer_given)


def _split_callbacks(trainer, session: RankSession, given) -> None:
    """transformers' progress bar and printer run on the driver; rank 0 relays what they need. The ranks
    agree on every control flag a callback sets (worker/agreement.py) and run with the rank's layer
    (``rank_layer``), each its pace reported for the driver's straggler warning."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from raytrainer.callbacks import explicitly_on_driver
    from raytrainer.worker.agreement import add_to_layer, agree_on_flags
    from raytrainer.worker.relay import RelayCallback

    agree_on_flags(trainer, session.ctx)
    for cls in (ProgressCallback, PrinterCallback):
        trainer.remove_callback(cls)
    for callback in [cb for cb in trainer.callback_handler.callbacks if explicitly_on_driver(cb)]:
        trainer.callback_handler.remove_callback(callback)  # the driver's (raytrainer/hosted.py)
    rank_layer(trainer, session.ctx, session.channel, given)
    if session.ctx.distributed:  # each rank's pace, for the driver's straggler warning
        from raytrainer.protocol import Kind
        from raytrainer.worker.pace import PaceCallback

        report = functools.partial(session.channel.send, Kind.PACE)
        add_to_layer(trainer, PaceCallback(trainer, session.ctx, report))
    if session.ctx.is_world_zero:
        add_to_layer(trainer, RelayCallback(session.channel))


@contextlib.contextmanager
def _config_kept(trainer):
    """Meanwhile (a call) the DeepSpeed config transformers fills stays as it was after the call: an
    ``evaluate()`` before any ``train()`` under ZeRO-3 runs transformers' inference ``deepspeed_init``, which
    fills the config's "auto" ``scheduler.params.total_num_steps`` with 0 and drops its ``optimizer``, in the
    accelerator's shared config: the ``train()`` after it failed with "ds scheduler.params.total_num_steps=0
    vs hf num_training_steps" (transformers' own, in one process too), and then found the inference engine
    wrapped already and built none to train. Both are put back; the config a ``train()`` filled is kept."""
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "deepspeed_plugin", None)
    config = getattr(getattr(plugin, "hf_ds_config", None), "config", None)
    if config is None or getattr(trainer, "deepspeed", None) is not None:
        yield
        return
    kept = copy.deepcopy(config)
    try:
        yield
    finally:
        if getattr(trainer, "optimizer", None) is None:  # no train() built its engine: as before the call
            config.clear()
            config.update(kept)
            # and the inference engine is not the model train() wraps (transformers would skip its
            # prepare: no engine to step, "'NoneType' object has no attribute 'backward'")
            trainer.deepspeed, trainer.model_wrapped = None, trainer.model


def wrap_after_evaluation(trainer) -> None:
    """The model an ``evaluate()`` or ``predict()`` before any ``train()`` prepared is wrapped for training
    by the ``train()`` after it. transformers' evaluation prepares the bare model with accelerate's
    ``evaluation_mode`` (no DDP wrapper) and accelerate marks it prepared, so the ``train()`` after it took
    it as it was: on several processes each rank trained its own replica, its gradients never averaged,
    and rank 0's weights were saved (transformers' own under torchrun, 5.25 with accelerate 1.16). The
    mark goes, with the autocast wrapper of the evaluation's ``forward``, and ``train()`` prepares the
    model as for a first call. FSDP and DeepSpeed prepare for training in evaluation too (the model
    transformers then holds is sharded or an engine), and tensor parallelism never wraps: left as they
    are."""
    model = getattr(trainer, "model", None)
    if (trainer.args.world_size > 1 and getattr(model, "_is_accelerate_prepared", False)
            and trainer.model_wrapped is model and not trainer.is_fsdp_enabled
            and not trainer.is_deepspeed_enabled
            and not getattr(trainer, "is_distributed_loading_by_transformers", False)):
        from accelerate.utils import extract_model_from_parallel

        del model._is_accelerate_prepared
        extract_model_from_parallel(model, keep_fp32_wrapper=False)  # the evaluation's autocast wrapper


def rank_layer(trainer, ctx, channel, given) -> None:
    """The callbacks transformers' loop runs with on every rank, on Ray workers and in the driver's process
    (raytrainer/in_process.py), after the trainer's own and outside its list (worker/agreement.py): each
    checkpoint committed through ``channel``, its files written in the background (worker/hosted_saves.py),
    a loss that is a mean taken as one (worker/loss.py), ``nonfinite_loss``, a resume on another world size
    recorded, a resumed loader's seed drawn off the random stream (worker/hosted_resume.py), one
    ``auto_find_batch_size`` for every rank (worker/hosted_batch_size.py), a Ray Data training set read
    from the rank's shard. ``given``: the arguments with their Ray fields."""
    from raytrainer.data import RayTrainingSet, ray_data_loader
    from raytrainer.worker.agreement import add_to_layer
    from raytrainer.worker.hosted_batch_size import AgreedBatchSize
    from raytrainer.worker.hosted_commit import CommitCallback, commit_jit_checkpoints
    from raytrainer.worker.hosted_saves import write_in_background
    from raytrainer.worker.nonfinite import NonFiniteCallback

    commit = CommitCallback(ctx, channel, given, write_in_background(trainer))
    add_to_layer(trainer, commit)
    commit_jit_checkpoints(trainer, commit)
    add_to_layer(trainer, MeanLossCallback(trainer))
    if given.nonfinite_loss != "ignore":
        add_to_layer(trainer, NonFiniteCallback(trainer, given.nonfinite_loss, ctx))
    add_to_layer(trainer, WorldSizeRecord(trainer))
    add_to_layer(trainer, LoaderSeedOffTheStream())
    add_to_layer(trainer, AgreedBatchSize(trainer, ctx))
    if isinstance(trainer.train_dataset, RayTrainingSet):  # each rank reads its shard (raytrainer/data.py)
        trainer.get_train_dataloader = functools.partial(ray_data_loader, trainer, ctx)


def _follow_the_driver(trainer, session: RankSession, stops: bool) -> None:
    """While a driver-side callback may stop the run (a search trial's pruner), every rank follows its
    decisions (worker/stop.py); one stop callback per call, for this attempt."""
    from raytrainer.worker.agreement import add_to_layer, remove_from_layer
    from raytrainer.worker.stop import DriverStopCallback

    remove_from_layer(trainer, DriverStopCallback)
    if stops:
        add_to_layer(trainer, DriverStopCallback(session.channel, session.ctx, session.attempt))


def _save_on_preemption(trainer, session: RankSession) -> None:
    """A checkpoint at the step the ranks agree on after Ray's preemption notice (worker/preemption.py),
    committed (``CommitCallback.commit``: the driver's manifest written) before the hold says so."""
    from raytrainer.worker.agreement import add_to_layer, layer_callback
    from raytrainer.worker.hosted_commit import CommitCallback
    from raytrainer.worker.preemption import PreemptionCallback

    session.writer = layer_callback(trainer, CommitCallback)
    elastic = getattr(trainer, "_raytrainer_elastic", False)  # an elastic run grows at such a checkpoint too
    add_to_layer(trainer, PreemptionCallback(session, growth=session.channel if elastic else None))


class MeanLossCallback(TrainerCallback):
    """The model ``train()`` trains (built from ``model_init`` there, maybe) gets the mean-loss handling
    (worker/loss.py)."""

    same_on_every_rank = True

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        adapt_mean_losses(self.trainer)


class WorldSizeRecord(TrainerCallback):
    """A resume on another number of workers than the checkpoint's (an elastic run's resize, a checkpoint of
    2 workers resumed on 1) is recorded in the run's history, as raytrainer's own loop records it:
    ``{"world_size", "previous_world_size", "epoch", "step"}`` in ``state.log_history``."""

    same_on_every_rank = True

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        before, self.trainer._raytrainer_saved_on = getattr(self.trainer, "_raytrainer_saved_on", None), None
        if before not in (None, args.world_size):
            state.log_history.append({"world_size": args.world_size, "previous_world_size": before,
                                      "epoch": state.epoch, "step": state.global_step})
