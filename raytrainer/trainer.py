"""``Trainer``: the HF Trainer's API; the work runs on Ray Train workers (or in-process with 0 workers).

The driver-side entry points (``train``, ``evaluate``, ``predict``) validate everything first, then
ship this very object to every rank, where the same method runs again with a rank context set. That is
why HF's overridable methods (``compute_loss``, ``training_step``, ``get_train_dataloader``, ...) are
plain methods here: a subclass's override is what runs on the workers.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import trainer as hf_trainer
from transformers import trainer_pt_utils as hf_pt_utils

from raytrainer import data as rdata
from raytrainer import meta_model
from raytrainer.args import TrainingArguments
from raytrainer.callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    PrinterCallback,
    ProgressCallback,
    TrainerControl,
    TrainerState,
)
from raytrainer.trainer_data import DataLoadersMixin
from raytrainer.trainer_utils import (
    EvalLoopOutput,
    MemoryTracker,
    PredictionOutput,
    TrainOutput,
    enable_full_determinism,
    set_seed,
    speed_metrics,
)
from raytrainer.worker import console

logger = logging.getLogger(__name__)


class Trainer(DataLoadersMixin):
    _args_class = TrainingArguments  # what args=None and a transformers arguments object become

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        args: TrainingArguments | None = None,
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
        *,
        tokenizer=None,
        callback: list | None = None,
    ):
        if args is None:
            args = self._args_class(output_dir="trainer_output")
            logger.info("No `TrainingArguments` passed, using `output_dir=trainer_output`.")
        elif not isinstance(args, TrainingArguments) and type(args).__module__.startswith("transformers."):
            args = self._args_class.from_transformers(args)  # a script's transformers.TrainingArguments
        self.args = args
        init_memory = MemoryTracker(args.skip_memory_metrics)  # transformers' init_mem_* metrics
        init_memory.start("init")
        if model is None and model_init is None:
            raise ValueError("Trainer needs a `model` or a `model_init` function that returns one.")
        if model is not None and model_init is not None:
            logger.warning("Trainer got both `model` and `model_init`; `model_init` replaces the model.")
        if model_init is not None and optimizers != (None, None):
            raise ValueError(
                "Passing `optimizers` is not allowed with `model_init`: the optimizer would point at the "
                "parameters of a model that model_init replaces. Override `create_optimizer_and_scheduler`."
            )
        if callbacks is not None and callback is not None:
            raise ValueError("Pass callbacks once, as `callbacks=[...]` (`callback=` is its alias).")
        self.model_init = model_init
        if model_init is None:
            self.model = model
        elif args.num_workers > 0:  # a big model stays a weightless skeleton here: the workers build it
            self.model = meta_model.driver_model(self.call_model_init)
        else:
            self.model = self.call_model_init()
        self.model_wrapped = self.model
        self.data_collator = data_collator if data_collator is not None else rdata.default_data_collator
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.processing_class = processing_class if processing_class is not None else tokenizer
        self.compute_loss_func = compute_loss_func
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        if getattr(self.model, "config", None) is not None and hasattr(self.model.config, "use_cache"):
            self.model.config.use_cache = args.use_cache  # as transformers.Trainer
        self.label_names = args.label_names or rdata.default_label_names(self.model)
        self.can_return_loss = self.label_names == [] or "return_loss" in _forward_params(self.model)

        eval_strategy = getattr(args.eval_strategy, "value", args.eval_strategy)
        if args.eval_on_start and eval_dataset is None:
            raise ValueError("eval_on_start=True needs an eval_dataset: pass `eval_dataset=` to Trainer or "
                             "drop eval_on_start.")
        if eval_strategy != "no" and eval_dataset is None:
            raise ValueError(
                f"eval_strategy={eval_strategy!r} needs an eval_dataset: pass `eval_dataset=` to Trainer "
                "or set eval_strategy='no'."
            )

        if args.max_steps > 0 and args.num_train_epochs > 0:
            console.logger.info("max_steps is given, it will override any value given in num_train_epochs")

        user_callbacks = callbacks if callbacks is not None else (callback or [])
        display = PrinterCallback if args.disable_tqdm else ProgressCallback
        from raytrainer.integrations import reporting_callbacks

        reporting = reporting_callbacks(args)  # transformers' trackers; they run on the driver
        self.callback_handler = CallbackHandler(
            [DefaultFlowCallback, *reporting, *user_callbacks, display], self.model, self.processing_class,
            self.optimizer, self.lr_scheduler,
        )
        self.state = TrainerState(is_local_process_zero=True, is_world_process_zero=True)
        self.control = TrainerControl()
        self._session = None  # the rank's RankSession while a command runs on it (worker/session.py)
        self._hub = None  # the driver's hub pusher (raytrainer.hub), when pushing
        # transformers' own callback, a SIGTERM handler in the training process; with Ray workers every run
        # saves on Ray's preemption notice instead (worker/preemption.py)
        if args.enable_jit_checkpoint and args.num_workers == 0:
            from raytrainer.deps import require

            module = require("transformers.trainer_jit_checkpoint", "enable_jit_checkpoint")
            jit = module.JITCheckpointCallback()
            self.callback_handler.add_callback(jit)
            jit.set_trainer(self)
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)
        smoothing = self._label_smoothing()
        self.label_smoother = None  # transformers' attribute, for subclasses' own compute_loss
        if smoothing:
            self.label_smoother = hf_pt_utils.LabelSmoother(epsilon=smoothing)
        if args.label_smoothing_factor and not smoothing:
            warnings.warn("Label smoothing is not compatible with multi-label classification. Disabling "
                          "label smoothing for this training run.", UserWarning, stacklevel=2)
        self._init_mem_metrics = init_memory.stop("init")  # reported with the first train()'s metrics

    @property
    def _ctx(self):
        """This rank's RankContext while a command runs on it, else None (on the driver)."""
        return self._session.ctx if self._session is not None else None

    @property
    def _strategy(self):
        """This rank's strategy once its model is set up, else None."""
        return self._session.strategy if self._session is not None else None

    @property
    def _view(self):
        """This rank's context in a run; outside one (a user calling get_train_dataloader, say), the view of
        a one-process run: the whole dataset, this process's device."""
        if self._ctx is not None:
            return self._ctx
        from raytrainer.rank_context import local_context

        return local_context(self.args)

    @property
    def accelerator(self):
        """accelerate's ``Accelerator`` API as Trainer subclasses use it (``backward``,
        ``gather_for_metrics``, ``unwrap_model``, ``is_main_process``...), from this rank's context and
        strategy."""
        facade = self.__dict__.get("_accelerator")
        if facade is None:
            from raytrainer.rank_accelerator import RankAccelerator

            facade = self._accelerator = RankAccelerator(self)
        return facade

    # -- the model; after a run on Ray workers its trained weights come from storage on first use ------
    @property
    def model(self):
        pending = self.__dict__.pop("_pending_weights", None)
        model = self.__dict__.get("_model")
        if pending is not None and model is not None:
            if meta_model.is_skeleton(model):
                meta_model.materialise(model, self.call_model_init)
            pending(model)  # fills the module in place: model_wrapped and the callbacks hold the same one
        return model

    @model.setter
    def model(self, value) -> None:
        self.__dict__.pop("_pending_weights", None)  # weights meant for the module being replaced
        self.__dict__["_model"] = value

    def _weights_pending(self, load: Callable) -> None:
        """``load(model)`` fills ``self.model`` when it is next used (see raytrainer.final_weights): the
        driver never pulls a trained model it does not use -- a search trial's, say -- onto the head node."""
        self.__dict__["_pending_weights"] = load

    # -- picklable for the workers ----------------------------------------------------------------
    def __getstate__(self):
        from raytrainer.integrations import shipped_handler

        state = self.__dict__.copy()
        state["callback_handler"] = shipped_handler(self.callback_handler)  # trackers stay on the driver
        state["_session"] = state["_hub"] = None  # a rank's own; the driver's hub pusher
        for name in ("_loss_kwargs_cache", "_compute_loss_num_items", "_num_params", "_model_attrs",
                     "_eval_dataloaders", "_group"):
            state.pop(name, None)  # caches: recomputed where the object lands; the driver's worker group
        return state

    # -- the live worker group (num_workers > 0) ---------------------------------------------------------
    def close(self) -> None:
        """End this Trainer's worker group: its Ray Train workers stop and release their resources. The
        group otherwise stays up between calls -- ``train``, ``evaluate``, ``predict`` run on the same
        workers -- and passes to another Trainer of this process with the same shape while it is idle (a
        garbage-collected Trainer leaves it idle for the next one); idle groups end after
        ``driver.group.IDLE_TIMEOUT_S``, with ``raytrainer.shutdown()``, or at exit. A later call takes an
        idle group again or starts a new one. Nothing to do with ``num_workers=0``."""
        group = self.__dict__.pop("_group", None)
        if group is not None:
            group.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- where we run ------------------------------------------------------------------------------
    @property
    def _on_rank(self) -> bool:
        return self._ctx is not None

    def _dispatch(self, method: str, **kwargs):
        """On the driver: validate, then run ``method`` on every rank and return rank 0's answer."""
        from raytrainer.driver import runner

        return runner.run(self, method, kwargs)

    # -- public entry points ---------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs) -> TrainOutput:
        if kwargs:
            raise TypeError(f"train() got unexpected keyword arguments: {sorted(kwargs)}")
        if not self._on_rank:
            self._align_special_tokens()  # the driver's model: its saved config.json as transformers'
            return self._dispatch("train", resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                  ignore_keys_for_eval=ignore_keys_for_eval)
        from raytrainer.worker.batch_size import retry_smaller
        from raytrainer.worker.loop import training_loop

        asked = self.args.per_device_train_batch_size
        try:
            while True:
                try:
                    return training_loop(self, self._session, resume_from_checkpoint, trial,
                                         ignore_keys_for_eval)
                except Exception as exc:
                    if resume_from_checkpoint or not retry_smaller(self, exc):  # resumed: the saved size
                        raise
        finally:  # as transformers: the size trained with is the state's (_train_batch_size), not the args'
            self.args.per_device_train_batch_size = asked

    @property
    def _train_batch_size(self) -> int:
        """transformers' attribute: the batch size of the run (after ``auto_find_batch_size``, the one found,
        or the one a resumed checkpoint trained with), else the arguments' ``train_batch_size``."""
        return self.state.train_batch_size or self.args.train_batch_size

    def evaluate(self, eval_dataset=None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        if not self._on_rank:
            return self._dispatch("evaluate", eval_dataset=eval_dataset, ignore_keys=ignore_keys,
                                  metric_key_prefix=metric_key_prefix)
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, Mapping):
            metrics = {}
            for name, ds in dataset.items():  # by name for the Trainer's own (a cached loader each)
                target = name if eval_dataset is None else ds
                metrics.update(self.evaluate(target, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        memory = self._memory_tracker("eval")
        self._prepare_model_for_inference()
        dataloader = self.get_eval_dataloader(dataset)
        start = time.time()
        output = self.evaluation_loop(
            dataloader, description="Evaluation",
            prediction_loss_only=True if self.compute_metrics is None else None,
            ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix,
        )
        output.metrics.update(speed_metrics(metric_key_prefix, start, output.num_samples,
                                            _ceil_div(output.num_samples, self.args.eval_batch_size)))
        self.log(output.metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control,
                                                         metrics=output.metrics)
        output.metrics.update(memory.stop("eval"))  # returned, not logged (as transformers)
        return output.metrics

    def predict(self, test_dataset, ignore_keys: list[str] | None = None,
                metric_key_prefix: str = "test") -> PredictionOutput:
        if not self._on_rank:
            return self._dispatch("predict", test_dataset=test_dataset, ignore_keys=ignore_keys,
                                  metric_key_prefix=metric_key_prefix)
        memory = self._memory_tracker("test")
        self._prepare_model_for_inference()
        dataloader = self.get_test_dataloader(test_dataset)
        start = time.time()
        output = self.evaluation_loop(dataloader, description="Prediction", ignore_keys=ignore_keys,
                                      metric_key_prefix=metric_key_prefix)
        output.metrics.update(speed_metrics(metric_key_prefix, start, output.num_samples,
                                            _ceil_div(output.num_samples, self.args.eval_batch_size)))
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control,
                                                        metrics=output.metrics)
        output.metrics.update(memory.stop("test"))
        return PredictionOutput(predictions=output.predictions, label_ids=output.label_ids,
                                metrics=output.metrics)

    def _memory_tracker(self, stage: str) -> MemoryTracker:
        """``<stage>_mem_*`` metrics with skip_memory_metrics=False; not inside train(), whose own cover it
        (as transformers)."""
        tracker = MemoryTracker(self.args.skip_memory_metrics
                                or (self._session is not None and self._session.writer is not None))
        tracker.start(stage)
        return tracker

    def evaluation_loop(self, dataloader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None,
                        metric_key_prefix: str = "eval") -> EvalLoopOutput:
        from raytrainer.worker.evaluation import evaluation_loop

        return evaluation_loop(self, dataloader, description, prediction_loss_only, ignore_keys,
                               metric_key_prefix)

    def hyperparameter_search(self, hp_space: Callable | None = None,
                              compute_objective: Callable | None = None, n_trials: int = 20,
                              direction: str | list[str] = "minimize", backend=None,
                              hp_name: Callable | None = None, **kwargs):
        """HF's hyperparameter search; each trial is a full run on its own Ray workers (raytrainer/search)."""
        from raytrainer.search import hyperparameter_search

        return hyperparameter_search(self, hp_space, compute_objective, n_trials, direction, backend,
                                     hp_name, **kwargs)

    # -- model -------------------------------------------------------------------------------------
    def _load_callback_state(self) -> None:
        """On resume, with ``restore_callback_states_from_checkpoint``: the saved states of the callbacks
        (and the TrainerControl) in ``self.state.stateful_callbacks`` replace those passed in."""
        if not self.args.restore_callback_states_from_checkpoint:
            return
        from raytrainer.worker.checkpointing import restore_callbacks
        from raytrainer.worker.console import logger as hf_logger  # transformers' own warning and logger

        self.control = restore_callbacks(self.state.stateful_callbacks, self.callback_handler, self.control,
                                         hf_logger)

    call_model_init = hf_trainer.Trainer.call_model_init  # transformers': model_init() or model_init(trial)

    def _align_special_tokens(self) -> None:
        """As transformers 5's ``train()``: the model's config and generation config take the PAD/BOS/EOS
        ids of the tokenizer (``processing_class``) where they differ (transformers warns which)."""
        transformers = sys.modules.get("transformers")  # a transformers tokenizer means it is imported
        model = self.__dict__.get("_model")  # not the lazy load of trained weights: the config is enough
        if transformers is None or not hasattr(model, "config"):
            return
        try:
            from transformers import PreTrainedTokenizerBase, ProcessorMixin
            from transformers.trainer_utils import align_special_tokens
        except ImportError:  # a transformers without it
            return
        if isinstance(self.processing_class, (PreTrainedTokenizerBase, ProcessorMixin)):
            align_special_tokens(model, self.processing_class)

    def _prepare_model_for_inference(self) -> None:
        """Place the model for evaluate()/predict() called on their own (outside train())."""
        if self._strategy is None:
            from raytrainer.strategies import select_strategy
            from raytrainer.strategies.precision import CastPrecision, full_eval_dtype

            self._session.strategy = select_strategy(self.args, self._ctx)
            if self.model is None and self.model_init is not None:  # the driver kept a skeleton
                seed = self.args.seed
                enable_full_determinism(seed) if self.args.full_determinism else set_seed(seed)
                self.model = self.callback_handler.model = self.call_model_init()
            self.model_wrapped = self._strategy.setup_model(self.model)
            self.model = self._strategy.unwrap(self.model_wrapped)
            dtype = full_eval_dtype(self.args)
            if dtype is not None:  # fp16/bf16_full_eval: the model itself in half precision (as HF)
                self.model_wrapped = self.model_wrapped.to(dtype)
                self.model = self._strategy.unwrap(self.model_wrapped)
                self._strategy.precision = CastPrecision(dtype)

    # -- optimisation ----------------------------------------------------------------------------------
    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self.create_optimizer()
        self.create_scheduler(num_training_steps=num_training_steps, optimizer=self.optimizer)

    # transformers.Trainer's own: the decayed / not-decayed parameter groups, ``optimizer_cls_and_kwargs``
    # or the optimizer ``args.optim`` names (with ``optim_args``; GaLore, optimizer factories), and the
    # schedule (``transformers.get_scheduler`` with ``args.get_warmup_steps``; a scheduler per parameter for
    # layer-wise GaLore). They read ``args``, ``model``, ``optimizer``, ``lr_scheduler`` and
    # ``optimizer_cls_and_kwargs``, which this Trainer has; a subclass may override each.
    # (bound here, once: a test harness may later put this class in place of transformers.Trainer)
    create_optimizer = hf_trainer.Trainer.create_optimizer
    _hf_create_scheduler = hf_trainer.Trainer.create_scheduler

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """transformers.Trainer.create_scheduler (for a layer-wise optimizer, with
        ``optim.LayerWiseScheduler`` in place of transformers' ``LayerWiseDummyScheduler``, whose rates torch
        refuses)."""
        from raytrainer.optim import layer_wise_schedules

        target = optimizer if optimizer is not None else self.optimizer
        if isinstance(target, hf_pt_utils.LayerWiseDummyOptimizer):
            with layer_wise_schedules():
                return self._hf_create_scheduler(num_training_steps, optimizer)
        return self._hf_create_scheduler(num_training_steps, optimizer)

    get_optimizer_cls_and_kwargs = staticmethod(hf_trainer.Trainer.get_optimizer_cls_and_kwargs)
    get_decay_parameter_names = hf_trainer.Trainer.get_decay_parameter_names

    def _get_learning_rate(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # transformers' own (as its Trainer binds them)
    get_num_trainable_parameters = hf_pt_utils.get_num_trainable_parameters
    get_learning_rates = hf_pt_utils.get_learning_rates

    # -- one step --------------------------------------------------------------------------------------
    def _prepare_inputs(self, inputs):
        if self._ctx is not None:
            device = self._ctx.device
        else:  # outside a run (a user's own call): where the model is
            device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        inputs = _to_device(inputs, device)
        return self._strategy.precision.convert_input(inputs) if self._strategy is not None else inputs

    # transformers.Trainer's own: the labels taken out for label smoothing (shifted for a causal LM) or
    # ``compute_loss_func``, ``num_items_in_batch`` to a model that takes loss kwargs, and the loss times the
    # data-parallel ranks with ``average_tokens_across_devices``. It reads ``label_smoother``,
    # ``compute_loss_func``, ``model_accepts_loss_kwargs``, ``accelerator`` and ``get_tp_size``, which this
    # Trainer has. A model's output is a dict with "loss" or a tuple with the loss first, as there (the
    # driver checks it before training starts: driver/preflight.py).
    compute_loss = hf_trainer.Trainer.compute_loss
    #: transformers': whether a ``compute_loss`` override's loss is already scaled for gradient accumulation
    #: (True: used as is; False: divided by the micro-batches of the step; None: scaled when it was
    #: normalised by ``num_items_in_batch`` or comes from ``compute_loss_func``).
    loss_is_scaled_for_ga: bool | None = None

    @property
    def model_accepts_loss_kwargs(self) -> bool:
        """transformers' attribute: whether the model's forward normalises its loss by ``num_items_in_batch``
        (its ``accepts_loss_kwargs``, else a ``**kwargs`` in its forward; a PEFT model's base model's). Worked
        out per model, as model_init may replace it; a value set on the Trainer (TRL does) wins."""
        if "_accepts_loss_kwargs" in self.__dict__:
            return self.__dict__["_accepts_loss_kwargs"]
        cached, model = self.__dict__.get("_loss_kwargs_cache"), self.__dict__.get("_model")
        if cached is None or cached[0] is not model:
            cached = self._loss_kwargs_cache = (model, _accepts_loss_kwargs(model))
        return cached[1]

    @model_accepts_loss_kwargs.setter
    def model_accepts_loss_kwargs(self, value: bool) -> None:
        self.__dict__["_accepts_loss_kwargs"] = value

    def get_tp_size(self) -> int:
        """The ranks that read the same batch (a tensor-parallel group; transformers' name)."""
        return self._view.model_parallel

    def _label_smoothing(self) -> float:
        """label_smoothing_factor, or 0 for a multi-label classifier (warned at init, as transformers)."""
        factor = self.args.label_smoothing_factor
        if factor and getattr(getattr(self.model, "config", None), "problem_type", None) == \
                "multi_label_classification":
            return 0.0
        return factor

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        if not _training_already(model):
            model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()  # a schedule-free optimizer trains on its own iterate, as in transformers
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            if self._compute_loss_takes_num_items():
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            else:
                loss = self.compute_loss(model, inputs)
        del inputs
        steps = self.args.torch_empty_cache_steps
        if steps is not None and self.state.global_step % steps == 0:  # as transformers, every micro-batch
            from accelerate.utils.memory import clear_device_cache

            clear_device_cache()
        scaled = self.loss_is_scaled_for_ga  # transformers' rule
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
                self.compute_loss_func is not None
        micro_steps = (self._session.micro_steps if self._session is not None else None) \
            or self.args.gradient_accumulation_steps
        if not scaled and micro_steps > 1:  # a mean per micro-batch: average over the step's micro-batches
            loss = loss / micro_steps
        self._strategy.backward(loss)
        return loss.detach()

    def compute_loss_context_manager(self):
        """The context forward and loss run in: autocast for bf16 / fp16 (HF's name)."""
        return self._strategy.precision.autocast() if self._strategy else contextlib.nullcontext()

    def _overrides(self, name: str) -> bool:
        """Whether a subclass replaced the method ``name``."""
        return getattr(type(self), name) is not getattr(Trainer, name)

    def _compute_loss_takes_num_items(self) -> bool:
        cached = self.__dict__.get("_compute_loss_num_items")
        if cached is None:
            cached = self._compute_loss_num_items = (
                "num_items_in_batch" in inspect.signature(self.compute_loss).parameters)
        return cached

    def prediction_step(self, model, inputs, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None):
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None for k in self.label_names)
        return_loss = inputs.pop("return_loss", None)
        loss_without_labels = bool(return_loss) and self.can_return_loss
        inputs = self._prepare_inputs(inputs)
        if ignore_keys is None:  # transformers' rule: a model's cache ("cache") is no prediction
            config = getattr(self.model, "config", None)
            ignore_keys = list(getattr(config, "keys_to_ignore_at_inference", ["cache"])) if config else []
        labels = None
        if has_labels:
            labels = tuple(inputs.get(n).detach() for n in self.label_names)
            labels = labels[0] if len(labels) == 1 else labels
        with torch.no_grad(), self.compute_loss_context_manager():
            if has_labels or loss_without_labels:
                num_items = self._eval_num_items(model, inputs)
                counted = ({"num_items_in_batch": num_items}
                           if num_items is not None and self._compute_loss_takes_num_items() else {})
                loss, outputs = self.compute_loss(model, inputs, return_outputs=True, **counted)
                loss = loss.mean().detach()
                logits = _logits_from_outputs(outputs, [*ignore_keys, "loss"], drop_first=True)
            else:
                loss = None
                logits = _logits_from_outputs(model(**inputs), ignore_keys, drop_first=False)
        if prediction_loss_only:
            return loss, None, None
        return loss, logits, labels

    def _eval_num_items(self, model, inputs) -> torch.Tensor | None:
        """The batch's label count, as transformers 5.23 passes it to ``compute_loss`` in evaluation too (a
        loss normalised by it then equals training's): this rank's batch only, so ``eval_loss`` does not
        depend on the number of workers; a tensor on the batch's device (no host sync)."""
        if "labels" not in inputs or not (self.compute_loss_func is not None
                                          or self.model_accepts_loss_kwargs):
            return None
        from raytrainer.worker.loss import label_targets, loss_shifts_labels

        shifted = loss_shifts_labels(getattr(model, "module", model))
        count = label_targets(inputs, shifted).ne(-100).sum()
        replicas = self._view.dp_size
        if replicas > 1 and self.args.average_tokens_across_devices and not self._overrides("compute_loss"):
            # transformers' compute_loss multiplies the loss by the data-parallel ranks, for a count over all
            # of them: this rank's count times the ranks gives back this batch's own mean
            count = count * replicas
        return count

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """Forward+backward FLOPs of a batch. A transformers model: transformers 5.23's count, 6 x the main
        input's elements x the parameters outside the embeddings (0 without that input); a model with its
        own ``floating_point_ops``: that; any other module: 6 x tokens (or examples) x all its parameters,
        where transformers reports 0."""
        if self._model_has("floating_point_ops"):
            return self.model.floating_point_ops(inputs)
        if self._model_has("num_parameters"):
            main = getattr(self.model, "main_input_name", "input_ids")
            if not isinstance(inputs, Mapping) or main not in inputs:
                return 0
            return 6 * inputs[main].numel() * self._parameter_count()
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
        tokens = ids.numel() if isinstance(ids, torch.Tensor) else rdata.batch_size_of(inputs)
        return 6 * tokens * self._parameter_count()

    def _track_num_input_tokens(self, inputs) -> None:
        """``include_num_input_tokens_seen``: transformers' own count (every token of the main input, or the
        non-padding ones) added to ``state.num_input_tokens_seen``, one all-gather of one integer per
        micro-batch while it is on (as in transformers); the ranks of a tensor-parallel group read the same
        batch, which counts once."""
        before = self.state.num_input_tokens_seen
        hf_trainer.Trainer._track_num_input_tokens(self, inputs)
        replicas = self.get_tp_size()
        if replicas > 1:
            counted = self.state.num_input_tokens_seen - before
            self.state.num_input_tokens_seen = before + counted // replicas

    def _model_has(self, name: str) -> bool:
        """``hasattr(self.model, name)``, remembered per model: asked every training step, and a module's
        ``__getattr__`` makes each miss raise (and catch) an AttributeError."""
        model = self.model
        cached = self.__dict__.get("_model_attrs")
        if cached is None or cached[0] is not model:
            cached = self._model_attrs = (model, {})
        found = cached[1].get(name)
        if found is None:
            found = cached[1][name] = hasattr(model, name)
        return found

    def _parameter_count(self) -> int:
        """The parameters floating_point_ops counts: a transformers model's outside the embeddings (its
        ``num_parameters``), any other module's all; cached per model."""
        cached = self.__dict__.get("_num_params")
        if cached is None or cached[0] is not self.model:
            model = self.model
            count = (model.num_parameters(exclude_embeddings=True) if hasattr(model, "num_parameters")
                     else sum(p.numel() for p in model.parameters()))
            cached = self._num_params = (self.model, count)
        return cached[1]

    # -- logging and callbacks ------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        if self.args.include_num_input_tokens_seen != "no":  # transformers' rule: tokens and their rate
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
            if start_time is not None:
                tokens = self.state.num_input_tokens_seen - getattr(self, "_initial_num_input_tokens_seen", 0)
                logs.update(speed_metrics("train", start_time, num_tokens=tokens))
        output = {**logs, "step": self.state.global_step}
        self.state.log_history.append(output)
        # callbacks get their own copy, as in transformers (its PrinterCallback pops total_flos from it)
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs=dict(logs))

    # transformers' own (on the handler)
    add_callback = hf_trainer.Trainer.add_callback
    pop_callback = hf_trainer.Trainer.pop_callback
    remove_callback = hf_trainer.Trainer.remove_callback

    def is_world_process_zero(self) -> bool:
        return self._ctx is None or self._ctx.is_world_zero

    def is_local_process_zero(self) -> bool:
        return self._ctx is None or self._ctx.is_local_zero

    # -- metrics files ----------------------------------------------------------------------------------
    # transformers' own helpers (as its Trainer binds them); the metrics files go to output_dir, made here
    metrics_format = staticmethod(hf_pt_utils.metrics_format)
    log_metrics = hf_pt_utils.log_metrics

    def save_metrics(self, split: str, metrics: dict[str, float], combined: bool = True) -> None:
        if self.is_world_process_zero():
            os.makedirs(self.args.output_dir, exist_ok=True)
        hf_pt_utils.save_metrics(self, split, metrics, combined)

    def save_state(self) -> None:
        if self.is_world_process_zero():
            os.makedirs(self.args.output_dir, exist_ok=True)
        hf_pt_utils.save_state(self)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Consolidated weights (``model.safetensors``, or ``save_pretrained`` when the model has it)."""
        from raytrainer.saving import save_model_files

        output_dir = output_dir or self.args.output_dir
        state_dict = self._strategy.full_state_dict(self.model_wrapped) if self._strategy else None
        if self.is_world_process_zero():
            console.saving_checkpoint(output_dir)  # transformers' _save logs this for save_model() too
            save_model_files(self.model, output_dir, state_dict, self.processing_class, self.args)
        if self.args.push_to_hub and not _internal_call and not self._on_rank:  # HF: a save pushes
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None,
                    **kwargs):
        """Save the model and a model card to ``output_dir`` and push them to ``hub_model_id`` (the driver
        pushes; waits for the current checkpoint push first). ``kwargs`` go to the model card (``license``,
        ``tags``, ``finetuned_from``, ``dataset``, ``language``, ``model_name``). See raytrainer/hub."""
        if self._on_rank:
            raise RuntimeError("push_to_hub() runs on the driver: call it after train(), not in a worker.")
        from raytrainer import hub

        return hub.push_to_hub(self, commit_message, blocking, token, revision, private, **kwargs)

    def create_model_card(self, language: str | None = None, license: str | None = None, tags=None,
                          model_name: str | None = None, finetuned_from: str | None = None, tasks=None,
                          dataset_tags=None, dataset=None, dataset_args=None) -> None:
        """transformers' draft model card (README.md) in ``output_dir``, from this run's arguments and log
        history (push_to_hub writes the same card); see raytrainer/hub/model_card.py."""
        from raytrainer.hub.model_card import create_model_card

        create_model_card(self, language=language, license=license, tags=tags, model_name=model_name,
                          finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags,
                          dataset=dataset, dataset_args=dataset_args)

    def _get_output_dir(self, trial=None) -> str:
        """Where this run (or search trial: each has its own ``output_dir``) writes (transformers' name)."""
        return self.args.output_dir

    def _evaluate(self, trial, ignore_keys_for_eval, skip_scheduler: bool = False) -> dict[str, float]:
        """An evaluation during training (transformers' hook of the same name): ``evaluate()``, then a
        ``ReduceLROnPlateau`` or ``GreedyLR`` scheduler steps on ``metric_for_best_model`` (``eval_loss``
        without one)."""
        from raytrainer.optim import METRIC_SCHEDULERS

        metrics = self.evaluate(ignore_keys=ignore_keys_for_eval)
        if isinstance(self.lr_scheduler, METRIC_SCHEDULERS) and not skip_scheduler:
            key = self.args.metric_for_best_model or "loss"
            key = key if key.startswith("eval_") else f"eval_{key}"
            self.lr_scheduler.step(metrics[key])
        return metrics

    # transformers' own: state.best_metric / best_global_step by metric_for_best_model and greater_is_better
    _determine_best_metric = hf_trainer.Trainer._determine_best_metric

    def _save_checkpoint(self, model, trial=None, metrics: dict | None = None) -> str:
        """Write ``checkpoint-<global_step>`` (committed in the background; see worker/checkpointing)."""
        return self._session.writer.save(metrics)


# -- helpers ---------------------------------------------------------------------------------------------
def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _forward_params(model) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def _accepts_loss_kwargs(model) -> bool:
    """transformers.Trainer's rule, on the module it was given (a PEFT model: its base model)."""
    if hf_trainer._is_peft_model(model):
        model = model.get_base_model()
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    params = inspect.signature(model.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _training_already(model: torch.nn.Module) -> bool:
    """Whether ``model.train()`` would change nothing: every module is in training mode and none has a
    ``train`` of its own (transformers' models do; they are always called). Checking is cheaper than the
    call, which sets each module's flag through ``nn.Module.__setattr__``, every training step."""
    train = torch.nn.Module.train
    return all(m.training and type(m).train is train and "train" not in vars(m) for m in model.modules())


def _to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        return type(obj)({k: _to_device(v, device) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj



def _logits_from_outputs(outputs, ignore_keys: list[str], drop_first: bool):
    if isinstance(outputs, Mapping) or hasattr(outputs, "keys"):
        logits = tuple(v for k, v in outputs.items() if k not in ignore_keys)
    elif isinstance(outputs, (tuple, list)):
        logits = tuple(outputs[1:] if drop_first else outputs)
    else:
        logits = () if drop_first else (outputs,)
    logits = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in logits)
    if len(logits) == 0:
        return None
    return logits[0] if len(logits) == 1 else logits
