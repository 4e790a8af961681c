"""raytrainer's Trainer: a ``transformers.Trainer``, running transformers' own loop.

``one_loop.Trainer`` is what ``raytrainer.Trainer`` becomes: a subclass of ``transformers.Trainer``, through
its twin (raytrainer/hosted.py), whose training, evaluation and prediction loops are transformers' own -- on
every rank of a Ray worker group with ``num_workers >= 1``, in this process with ``num_workers=0`` (where
``pdb`` works and the model given is trained in place). What raytrainer adds on top is attached around that
loop, never written into it:

- on the workers, by each rank's layer (worker/hosted.py), as for any hosted trainer: agreed flags, rank-0
  evaluation, committed background saves, verified and world-size resume, ``nonfinite_loss``, the
  straggler warning, per-shard construction, sharding on CPU;
- in this process, by the constructor: raytrainer's arguments as ``trainer.args`` (``args=None`` or
  transformers' own become ``raytrainer.TrainingArguments``), callbacks that return a mapping of control
  flags, the driver's checks of each call before the loop starts (driver/preflight.py), and at ``train()``
  the same rank's layer as on the workers (raytrainer/in_process.py: committed background saves, verified
  resume, the mean-loss handling, ``nonfinite_loss``), the search (raytrainer/search) and hub pushes by the
  driver's services;
- everywhere the class is built (here and on each rank), by the constructor: a plain ``torch.nn.Module``
  without a ``config`` trains with ``label_smoothing_factor`` (transformers reads ``model.config`` there).

``raytrainer.Trainer`` and ``raytrainer.Seq2SeqTrainer`` are these classes. raytrainer's own loop
(raytrainer/trainer.py, worker/loop.py) is still importable from its modules until it is deleted.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Mapping

import torch
import transformers

from raytrainer.args import RayArgumentsMixin, TrainingArguments
from raytrainer.hosted import on_ray, ray_data_read
from raytrainer.hosted_recipe import building_on_a_rank
from raytrainer.seq2seq import Seq2SeqTrainingArguments, _settled_generation_config

logger = logging.getLogger(__name__)


class DriverView:
    """What the driver's checks (driver/preflight.py) read of raytrainer's Trainer on workers, before any
    worker starts: the constructor's objects as given, and the model the driver holds (the script's module,
    or ``model_init``'s without weights when big: raytrainer.meta_model), as transformers' constructor
    would have set them. The checks of a call in one process, on the objects each rank builds from."""

    def __init__(self, trainer):
        from transformers.data.data_collator import DataCollatorWithPadding, default_data_collator
        from transformers.utils import find_labels

        given = trainer._given
        self.args, self.model = trainer.args, trainer._untrained_model()
        self.train_dataset, self.eval_dataset = given("train_dataset"), given("eval_dataset")
        self.compute_loss_func, self.model_init = given("compute_loss_func"), given("model_init")
        processing = given("processing_class")
        tokenizer = getattr(processing, "tokenizer", processing)  # a processor's, as transformers reads it
        padding = isinstance(tokenizer, transformers.PreTrainedTokenizerBase)
        self.data_collator = given("data_collator") or (
            DataCollatorWithPadding(tokenizer) if padding else default_data_collator)
        labels = find_labels(type(self.model)) if self.model is not None else []
        self.label_names = labels if self.args.label_names is None else self.args.label_names
        self._class = trainer.user_class

    def _overrides(self, name: str) -> bool:
        return getattr(self._class, name) is not getattr(transformers.Trainer, name)


class _Additions:
    """What raytrainer's trainers add to the twin of a transformers trainer class (see the module's
    docstring); first in their bases, before the twin."""

    _args_class = TrainingArguments  # what args=None and a transformers arguments object become
    _driver_view = DriverView  # on workers, the driver checks each call on it first (raytrainer/hosted.py)

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        args: transformers.TrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        model_init: Callable | None = None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        optimizer_cls_and_kwargs: tuple | None = None,
        preprocess_logits_for_metrics: Callable | None = None,
    ):
        here = not building_on_a_rank.get()
        vars(self).update(_runs_here=here, _hub=None)  # _hub: the driver's pusher (raytrainer/hub)
        init = super().__init__  # on a rank: the twin's, which gives transformers' loop the plain arguments
        if here:  # the driver's process: the trainer's arguments are raytrainer's, the object given
            args = self._ray_arguments(args)
            train_dataset, eval_dataset = ray_data_read(train_dataset, eval_dataset, args)
            init = functools.partial(self._twin_of.__init__, self)
            self._constructor = dict(  # what each trial of a search builds its trainer from (for_trial)
                model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                eval_dataset=eval_dataset, processing_class=processing_class, model_init=model_init,
                compute_loss_func=compute_loss_func, compute_metrics=compute_metrics, callbacks=callbacks,
                optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        if args.eval_on_start and eval_dataset is None and not self._overrides("get_eval_dataloader"):
            # transformers finds out at train()'s first evaluation
            raise ValueError("eval_on_start=True needs an eval_dataset: pass `eval_dataset=` to Trainer or "
                             "drop eval_on_start.")
        smoothing = args.label_smoothing_factor
        without_config = smoothing and getattr(model, "config", None) is None and model_init is None
        if without_config:  # transformers reads model.config.problem_type to decide; a plain module has none
            args.label_smoothing_factor = 0.0
        # transformers sets its verbosity to the run's log level here; in the driver's process raytrainer
        # applies it during each call only (worker/logs.py), so the script's own level stands in between
        with _transformers_level_kept() if here else contextlib.nullcontext():
            init(
                model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                eval_dataset=eval_dataset, processing_class=processing_class, model_init=model_init,
                compute_loss_func=compute_loss_func, compute_metrics=compute_metrics, callbacks=callbacks,
                optimizers=optimizers, preprocess_logits_for_metrics=preprocess_logits_for_metrics,
                # not a parameter of transformers.Seq2SeqTrainer's constructor
                **({} if optimizer_cls_and_kwargs is None else
                   {"optimizer_cls_and_kwargs": optimizer_cls_and_kwargs}))
        if without_config:
            args.label_smoothing_factor = smoothing
            self.label_smoother = transformers.trainer_pt_utils.LabelSmoother(epsilon=smoothing)
        self._sharded_checkpoints_by_default()
        if here:
            self._attach_in_process(args)

    def _sharded_checkpoints_by_default(self) -> None:
        """Under FSDP a checkpoint holds each rank's shard of the model and optimizer (accelerate's
        ``SHARDED_STATE_DICT``: nothing gathered, each rank resuming from its own share), raytrainer's default
        where ``fsdp_config`` does not name a ``state_dict_type`` (transformers' is ``FULL_STATE_DICT``: every
        save gathers the whole model and optimizer state onto rank 0, ~1 TB at 70B with AdamW).
        ``save_model`` still writes the whole model (below)."""
        if getattr(self, "is_fsdp_enabled", False) and "state_dict_type" not in (self.args.fsdp_config or {}):
            _state_dict_type(self.accelerator.state.fsdp_plugin, "SHARDED_STATE_DICT")
            self._raytrainer_sharded_by_default = True

    def _save_checkpoint(self, model, trial):
        """transformers' own; every checkpoint holds the arguments readable (``training_args.json``), a
        sharded FSDP one too (transformers writes its ``training_args.bin`` with the whole model only)."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        from raytrainer.saving import TRAINING_ARGS_NAME

        vars(self)["_raytrainer_checkpointing"] = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            vars(self)["_raytrainer_checkpointing"] = False
        step = self.state.global_step
        folder = os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if (self.args.should_save and os.path.isdir(folder)
                and not os.path.exists(os.path.join(folder, TRAINING_ARGS_NAME))):
            _write_arguments(folder, vars(self).get("_raytrainer_given", self.args))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """transformers' ``save_model``; with raytrainer's default sharded FSDP checkpoints, the model it
        writes is still the whole one (``model.safetensors``, gathered as transformers' ``FULL_STATE_DICT``
        does), which ``from_pretrained`` loads. A PEFT model's is PEFT's adapter files, its adapters alone
        gathered (a few MB; the frozen base, the size of the model, never), and a sharded checkpoint of it
        holds them too, for ``PeftModel.from_pretrained`` and a hub push: transformers writes none under
        ``SHARDED_STATE_DICT``."""
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if self.__dict__.get("_raytrainer_checkpointing") and plugin is not None:  # each rank's shard; a
            return super().save_model(output_dir, _internal_call)  # PEFT model's: worker/hosted_adapter.py
        if not self.__dict__.get("_raytrainer_sharded_by_default") or plugin is None:
            return super().save_model(output_dir, _internal_call)
        if self._save_adapter(output_dir):
            if self.args.push_to_hub and not _internal_call:  # as transformers' save_model ends
                self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
            return None
        _state_dict_type(plugin, "FULL_STATE_DICT")
        try:
            return super().save_model(output_dir, _internal_call)
        finally:
            _state_dict_type(plugin, "SHARDED_STATE_DICT")

    def _save_adapter(self, output_dir: str | None) -> bool:
        """A PEFT model's adapter files written (its adapters gathered: a collective); False for another
        model."""
        from raytrainer.saving import peft_state_gathered

        adapter = peft_state_gathered(self.accelerator.unwrap_model(self.model))
        if adapter is not None and self.args.should_save:
            self._save(output_dir, state_dict=adapter)
        return adapter is not None

    @classmethod
    def _ray_arguments(cls, args) -> RayArgumentsMixin:
        """``args`` with raytrainer's Ray fields: as given, or ``raytrainer.TrainingArguments`` made from
        transformers' (every value given carried over), or for ``None`` transformers' default."""
        if args is None:
            logger.info("No `TrainingArguments` passed, using `output_dir=trainer_output`.")
            return cls._args_class(output_dir="trainer_output")
        if isinstance(args, RayArgumentsMixin):
            return args
        return cls._args_class.from_transformers(args)

    def _attach_in_process(self, given) -> None:
        """raytrainer's callbacks may return a mapping of flags (raytrainer's ``CallbackHandler``, through the
        agreement, a no-op with one process); the rest of a rank's layer is added at the first ``train()``
        (raytrainer/in_process.py)."""
        from raytrainer.rank_context import local_context
        from raytrainer.worker.agreement import agree_on_flags

        agree_on_flags(self, local_context(given))

    # -- a call in this process: the driver's checks first, the run's log level meanwhile ----------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        if not self.__dict__.get("_runs_here"):  # on a rank, its layer commits and resumes (worker/hosted.py)
            with _batch_size_advice():
                return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        from raytrainer import in_process

        with self._in_this_process("train", {}, check=False), _batch_size_advice():
            # in_process.train checks, once it has resolved the checkpoint to resume
            return in_process.train(self, super().train, resume_from_checkpoint,
                                    dict(trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs))

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval", **kwargs):
        eval_dataset = _rows_if_ray_data(eval_dataset)
        with self._in_this_process("evaluate", {"eval_dataset": eval_dataset}):
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix, **kwargs)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test", **kwargs):
        test_dataset = _rows_if_ray_data(test_dataset)
        with self._in_this_process("predict", {"test_dataset": test_dataset}):
            return super().predict(test_dataset, ignore_keys, metric_key_prefix, **kwargs)

    @contextlib.contextmanager
    def _in_this_process(self, method: str, kwargs: dict, check: bool = True):
        """A call in the driver's process: refused before the loop starts where the driver would refuse it
        (driver/preflight.py), and run under the run's log level, as a rank's call is (worker/logs.py), the
        levels and handlers restored after. On a rank: nothing (the rank's layer does both)."""
        if not self.__dict__.get("_runs_here"):
            yield
            return
        from raytrainer.driver.preflight import check_in_process
        from raytrainer.worker.logs import driver_transformers_level, rank_logging

        if check:
            check_in_process(self, method, kwargs)
        with rank_logging(self.args, 0, None, driver_transformers_level()):
            yield

    def hyperparameter_search(self, hp_space: Callable | None = None,
                              compute_objective: Callable | None = None, n_trials: int = 20,
                              direction: str | list[str] = "minimize", backend=None,
                              hp_name: Callable | None = None, **kwargs):
        """transformers' hyperparameter search, by raytrainer's (raytrainer/search): Optuna or Ray Tune, each
        trial a trainer of its own (``for_trial``) whose model ``model_init(trial)`` builds."""
        if not self.__dict__.get("_runs_here"):
            return super().hyperparameter_search(hp_space, compute_objective, n_trials, direction, backend,
                                                 hp_name, **kwargs)
        from raytrainer.search import hyperparameter_search

        return hyperparameter_search(self, hp_space, compute_objective, n_trials, direction, backend, hp_name,
                                     **kwargs)

    def for_trial(self, args, callbacks: list):
        """A new trainer for one search trial: this one's constructor arguments with the trial's ``args`` (its
        own ``output_dir``) and ``callbacks`` added. It holds this trainer's model until
        ``train(trial=...)`` builds the trial's with ``model_init(trial)``, as transformers' search does."""
        given = self._constructor
        trainer = type(self)(**{**given, "args": args, "model": self.model, "model_init": None,
                                "callbacks": [*(given["callbacks"] or []), *callbacks]})
        trainer.model_init = self.model_init
        return trainer

    def __reduce_ex__(self, protocol):
        """A copy elsewhere (a Ray Tune trial's actor, with ``num_workers=0``) is this trainer built anew
        there from its constructor's arguments, as a hosted trainer's ranks build theirs: transformers'
        ``Accelerator`` and a tracker's open writer do not pickle, and the copy makes its own (its trackers
        from ``report_to``)."""
        if not self.__dict__.get("_runs_here"):
            return super().__reduce_ex__(protocol)
        return _built_anew, (type(self), self._constructor)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None,
                    **kwargs):
        """transformers' ``push_to_hub``, pushed by the driver's pusher (raytrainer/hub), which also pushes
        the committed checkpoints during ``train()``: the model and its card saved to ``output_dir``, then
        that folder uploaded (waiting for the checkpoint pushes under way first)."""
        if not self.__dict__.get("_runs_here"):
            return super().push_to_hub(commit_message, blocking, token, revision, private, **kwargs)
        from raytrainer import hub

        return hub.push_to_hub(self, commit_message, blocking, token, revision, private, **kwargs)

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """transformers' ``init_hf_repo``: the repository made (and checked) by the driver's pusher, which
        pushes the committed checkpoints (``_push_from_checkpoint`` leaves them to it)."""
        if not self.__dict__.get("_runs_here"):
            return super().init_hf_repo(token, private)
        from raytrainer import hub

        target = hub.pusher_for_call(self, token, private, None).target
        self.hub_model_id = getattr(target, "repo_id", None) or self.args.hub_model_id
        self.push_in_progress = None

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if not self.__dict__.get("_runs_here"):
            super()._push_from_checkpoint(checkpoint_folder)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """transformers' own; a checkpoint of FSDP's shards (``pytorch_model_fsdp_0/``) also resumes without
        FSDP (a plain module, DDP; transformers refuses it), each rank reading the whole tensors from them."""
        if not _shards_without_fsdp(self, resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        from raytrainer.strategies.dcp import MODEL_DIR

        model = self.model if model is None else model
        loaded = _dcp_load({"model": get_model_state_dict(model)}, resume_from_checkpoint, MODEL_DIR)
        set_model_state_dict(model, loaded["model"])

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        """transformers' own (or, for FSDP's shards without FSDP, the optimizer's from ``optimizer_0/``)."""
        if checkpoint is not None and _shards_without_fsdp(self, checkpoint):
            from torch.distributed.checkpoint.state_dict import (
                get_optimizer_state_dict,
                set_optimizer_state_dict,
            )
            from transformers.trainer import SCHEDULER_NAME

            from raytrainer.strategies.dcp import OPTIMIZER_DIR

            model, optimizer = self.model, getattr(self.optimizer, "optimizer", self.optimizer)
            loaded = _dcp_load({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint,
                               OPTIMIZER_DIR)
            set_optimizer_state_dict(model, optimizer, loaded["optimizer"])
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME),
                                                         weights_only=True))
        else:
            super()._load_optimizer_and_scheduler(checkpoint)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """transformers' own, given the optimizer inside accelerate's wrapper when that is a layer-wise one
        (``optim="*_layerwise"``): transformers makes the scheduler after wrapping the optimizer, and
        ``get_scheduler`` makes each parameter's own schedule only for the unwrapped
        ``LayerWiseDummyOptimizer`` (wrapped, the per-parameter learning rates never change); its
        ``LayerWiseDummyScheduler`` reports a rate per parameter, which torch's scheduler refuses
        (``optim.LayerWiseScheduler`` in its place)."""
        from transformers.trainer_pt_utils import LayerWiseDummyOptimizer

        from raytrainer.optim import layer_wise_schedules

        inner = getattr(self.optimizer, "optimizer", None)
        if optimizer is None and isinstance(inner, LayerWiseDummyOptimizer):
            with layer_wise_schedules():
                return super().create_scheduler(num_training_steps, inner)
        return super().create_scheduler(num_training_steps, optimizer)

    def _evaluate(self, trial, ignore_keys_for_eval, skip_scheduler: bool = False):
        """transformers' own; a scheduler that steps on a metric (``ReduceLROnPlateau``, ``GreedyLR``) given
        in ``optimizers`` without ``metric_for_best_model`` steps on ``eval_loss``, as with
        ``lr_scheduler_type="reduce_lr_on_plateau"`` (transformers reads ``None.startswith`` there)."""
        args = self.args
        unset = args.metric_for_best_model is None and _steps_on_a_metric(self.lr_scheduler)
        if unset:
            args.metric_for_best_model = "loss"
        try:
            return super()._evaluate(trial, ignore_keys_for_eval, skip_scheduler)
        finally:
            if unset:
                args.metric_for_best_model = None

    def _prepare_inputs(self, inputs):
        """transformers' own; under ``bf16_full_eval`` / ``fp16_full_eval`` an evaluation's floating inputs
        (not its labels) follow the model, which transformers casts to half precision for it: a plain module
        fed float32 features would otherwise fail on the dtype (transformers' models cast their own)."""
        inputs = super()._prepare_inputs(inputs)
        args = self.args
        if (not (args.bf16_full_eval or args.fp16_full_eval) or self.model is None or self.model.training
                or not isinstance(inputs, Mapping)):
            return inputs
        dtype = torch.bfloat16 if args.bf16_full_eval else torch.float16
        labels = set(self.label_names or ())
        return type(inputs)({k: v.to(dtype) if (isinstance(v, torch.Tensor) and v.is_floating_point()
                                               and k not in labels) else v
                             for k, v in inputs.items()})

    def _overrides(self, name: str) -> bool:
        """Whether a subclass replaced the method ``name`` (the driver asks about ``compute_loss``)."""
        return getattr(type(self), name) is not getattr(transformers.Trainer, name)

    def _save(self, output_dir: str | None = None, state_dict=None):
        """transformers' ``_save``; its ``training_args.bin`` holds no secret (the tokens, the storage's
        filesystem object) and is of a class ``pickle`` can name (``saving.without_secrets``): the
        arguments' own, else a base class, else raytrainer's arguments as given."""
        from raytrainer.saving import without_secrets

        args = self.args
        # a rank's arguments are its base class's; where that class cannot be named (a script replaced it
        # in transformers' modules), the arguments as the script gave them
        self.args = without_secrets(args, vars(self).get("_raytrainer_given"))
        try:
            super()._save(output_dir, state_dict)
        finally:
            self.args = args
        if self.args.should_save:  # and readable, as raytrainer's checkpoints hold them (saving.py)
            _write_arguments(output_dir or self.args.output_dir, args)

    def create_model_card(self, language: str | None = None, license: str | None = None, tags=None,
                          model_name: str | None = None, finetuned_from: str | None = None, tasks=None,
                          dataset_tags=None, dataset=None, dataset_args=None) -> None:
        """transformers' model card (README.md in ``output_dir``); a model without a ``config`` (a plain
        ``nn.Module``, which transformers reads unguarded here) is seen as one whose config is None."""
        from raytrainer.hub.model_card import create_model_card

        create_model_card(self, language=language, license=license, tags=tags, model_name=model_name,
                          finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags,
                          dataset=dataset, dataset_args=dataset_args)


def _rows_if_ray_data(dataset):
    """A Ray Dataset (or a mapping holding some) to evaluate on in this process: its rows, in order."""
    from raytrainer import data

    return data.ray_data_rows(dataset) if data.uses_ray_data(dataset) else dataset


def _built_anew(cls: type, constructor: dict):
    return cls(**constructor)


def _write_arguments(folder: str, args) -> None:
    """``args`` readable in ``folder`` (``training_args.json``, as raytrainer's checkpoints hold them), whole
    or not at all (``Storage.write_atomic``). A checkpoint's ``_save`` writes it on the save's writer thread
    (worker/hosted_saves.py) while ``_save_checkpoint`` may write it on the training thread; two writers of
    one open file left it with the tail of the longer text after the shorter one."""
    from raytrainer.saving import TRAINING_ARGS_NAME
    from raytrainer.storage import Storage

    storage = Storage.from_uri(folder)
    storage.write_atomic(storage.path(TRAINING_ARGS_NAME), args.to_json_string().encode())


@contextlib.contextmanager
def _batch_size_advice():
    """``auto_find_batch_size`` that found no size (accelerate: "No executable batch size found, reached
    zero."): said with what to do, as raytrainer's own loop says it."""
    try:
        yield
    except RuntimeError as exc:
        if "No executable batch size found" not in str(exc):
            raise
        raise RuntimeError(
            "auto_find_batch_size: not even a batch of 1 example fits in memory; use a sharding strategy "
            "(--fsdp, --deepspeed), gradient checkpointing or a smaller model") from exc


def _shards_without_fsdp(trainer, checkpoint) -> bool:
    from raytrainer.strategies.dcp import MODEL_DIR

    return (isinstance(checkpoint, str) and not getattr(trainer, "is_fsdp_enabled", False)
            and not getattr(trainer, "is_deepspeed_enabled", False)
            and os.path.isdir(os.path.join(checkpoint, MODEL_DIR)))


def _dcp_load(state: dict, checkpoint: str, folder: str) -> dict:
    """``state`` filled from the DCP folder ``checkpoint/folder`` (through ``dcp.FileSystemReader``, which a
    resume from other storage reads in ranges: worker/hosted_resume.py)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(os.path.join(checkpoint, folder))
    dcp.load(state, storage_reader=reader, no_dist=not dist.is_initialized())
    return state


def _state_dict_type(plugin, kind: str) -> None:
    """accelerate's FSDP plugin set to save ``kind`` with that kind's own default configs (its
    ``set_state_dict_type`` keeps the configs of the kind before)."""
    plugin.state_dict_config = plugin.optim_state_dict_config = None
    plugin.set_state_dict_type(kind)


def _steps_on_a_metric(scheduler) -> bool:
    from transformers.optimization import GreedyLR

    return isinstance(scheduler, (torch.optim.lr_scheduler.ReduceLROnPlateau, GreedyLR))


@contextlib.contextmanager
def _transformers_level_kept():
    hf_logger = logging.getLogger("transformers")
    level = hf_logger.level
    try:
        yield
    finally:
        hf_logger.setLevel(level)


class Trainer(_Additions, on_ray(transformers.Trainer)):
    """`transformers.Trainer` with raytrainer's Ray fields in its arguments: ``num_workers >= 1`` runs
    transformers' loop on that many Ray Train workers, ``num_workers=0`` in this process."""


class Seq2SeqTrainer(_Additions, on_ray(transformers.Seq2SeqTrainer)):
    """`transformers.Seq2SeqTrainer`, as ``Trainer`` is `transformers.Trainer`: its generating
    ``evaluate`` / ``predict`` run on every rank, the generated ids gathered by transformers' loop."""

    _args_class = Seq2SeqTrainingArguments

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        """transformers' own, with the model's generation config settled before the first ``generate``
        (``seq2seq._settled_generation_config``): transformers fills its defaults after the first batch,
        which alone may run a token longer -- on each rank's first batch, so that the ids would depend on
        the number of workers."""
        if self.args.predict_with_generate and not prediction_loss_only:
            _settled_generation_config(self.model)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys, **gen_kwargs)
