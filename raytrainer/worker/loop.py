"""The per-rank training loop. Every rank runs this, in lock step.

    set seed; model_init(trial); strategy.setup_model; [auto_find_batch_size probe]; train dataloader;
    strategy.setup_optimizer (optimizer and scheduler; an engine may wrap all three)
    on_train_begin
    for epoch:
        on_epoch_begin
        for each optimizer update (``gradient_accumulation_steps`` micro-batches; the last update of an
        epoch may have fewer):
            on_step_begin
            micro-batches: training_step (no gradient all-reduce but on the last), on_substep_end between
            a non-finite loss in them? (nonfinite_loss: stop, or skip this update on every rank)
            clip gradients; on_pre_optimizer_step; optimizer.step(); on_optimizer_step; scheduler.step()
            global_step += 1; on_step_end
            control flags OR-ed across ranks -> log / evaluate / save, identically on every rank
        on_epoch_end (also when the epoch was cut short), flags OR-ed, log / evaluate / save
    on_train_end; TrainOutput with speed metrics
"""

from __future__ import annotations

import math
import sys
import time

import torch

from raytrainer.callbacks import ExportableState, TrainerControl, TrainerState
from raytrainer.data import batch_size_of, set_epoch, skip_first_batches
from raytrainer.optim import METRIC_SCHEDULERS, reapply_hyperparameters
from raytrainer.strategies import select_strategy
from raytrainer.trainer_utils import (
    MemoryTracker,
    TrainOutput,
    enable_full_determinism,
    has_length,
    set_seed,
    speed_metrics,
)
from raytrainer.worker import console
from raytrainer.worker.agreement import must_agree, sync_control
from raytrainer.worker.batch_size import find_batch_size
from raytrainer.worker.checkpointing import CheckpointWriter, Resume
from raytrainer.worker.loss import adapt_mean_losses, label_targets, loss_shifts_labels
from raytrainer.worker.neftune import NEFTune
from raytrainer.worker.nonfinite import NonFiniteGuard
from raytrainer.worker.pace import PaceMeter
from raytrainer.worker.session import RankSession


class _Schedule:
    """How many optimizer updates make an epoch and the run (HF's rules)."""

    def __init__(self, args, len_dataloader: int | None):
        ga = args.gradient_accumulation_steps
        if len_dataloader is not None:
            self.micro_per_epoch = len_dataloader
            self.updates_per_epoch = max(math.ceil(len_dataloader / ga), 1)
            if args.max_steps > 0:
                self.max_steps = args.max_steps
                self.num_epochs = math.ceil(args.max_steps / self.updates_per_epoch)
            else:
                self.max_steps = math.ceil(args.num_train_epochs * self.updates_per_epoch)
                self.num_epochs = math.ceil(args.num_train_epochs)
        else:  # iterable data: the run is max_steps long, epochs end when the stream does
            self.micro_per_epoch = args.max_steps * ga  # transformers' steps_in_epoch
            self.updates_per_epoch = args.max_steps
            self.max_steps = args.max_steps
            self.num_epochs = sys.maxsize


def training_loop(trainer, session: RankSession, resume_from_checkpoint, trial,
                  ignore_keys_for_eval) -> TrainOutput:
    args, ctx = trainer.args, session.ctx
    memory = MemoryTracker(args.skip_memory_metrics)
    memory.start("train")
    # every rank, as transformers' Trainer seeds its process
    enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)
    strategy = session.strategy = select_strategy(args, ctx)
    resume = (Resume(resume_from_checkpoint, ctx.rank, trainer.args.storage_filesystem)
              if resume_from_checkpoint else None)
    # a checkpoint whose model is DCP shards is read after setup_model, each rank its share: the model is
    # built as for a fresh run (each rank initialising its own shard), then overwritten
    sharded_resume = resume is not None and resume.model_sharded
    if trainer.model_init is not None:  # a sharded strategy builds only this rank's share
        trainer.model = strategy.build_model(lambda: trainer.call_model_init(trial),
                                             fresh=resume is None or sharded_resume)
        trainer.optimizer = trainer.lr_scheduler = None
    trainer._align_special_tokens()  # as transformers' train(), on the model this rank trains
    if resume is not None:
        strategy.before_resume(list(resume.reader.files), resume.state.global_step)
    if resume is not None and not sharded_resume and strategy.holds_whole_model(trainer.model):
        # a rank built on meta gets its shard from rank 0 in setup_model; a model partitioned by
        # zero.Init gets its partition from the engine's checkpoint
        resume.load_model(trainer.model)
    neftune = NEFTune(trainer.model, args.neftune_noise_alpha) if args.neftune_noise_alpha else None
    if "underflow_overflow" in args.debug:  # transformers' tracer: stops at the first inf/nan in a module
        from transformers.debug_utils import DebugUnderflowOverflow

        DebugUnderflowOverflow(trainer.model)
    if args.activation_checkpointing:
        _checkpoint_activations(trainer.model, args)
    elif args.gradient_checkpointing:
        trainer.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs or {"use_reentrant": False})

    wrapped = strategy.setup_model(trainer.model)
    trainer.model = strategy.unwrap(wrapped)
    if sharded_resume:
        resume.load_sharded_model(wrapped, ctx)
    if args.auto_find_batch_size:
        saved = resume.state.train_batch_size if resume is not None else None
        args.per_device_train_batch_size = saved or find_batch_size(trainer, strategy, wrapped)
    train_dataloader = trainer.get_train_dataloader()
    len_dataloader = len(train_dataloader) if has_length(train_dataloader) else None
    schedule = _Schedule(args, len_dataloader)

    wrapped, trainer.optimizer, trainer.lr_scheduler = strategy.setup_optimizer(
        wrapped, _Optimizers(trainer, schedule.max_steps))
    trainer.model_wrapped = wrapped
    trainer.model = strategy.unwrap(wrapped)
    adapt_mean_losses(trainer)  # a loss that is a mean: its share of the step's sum (worker/loss.py)
    # The training forward may go through torch.compile; state, syncing and clipping use ``wrapped``.
    model = _compiled(wrapped, args) if args.torch_compile else wrapped
    optimizer, scheduler = trainer.optimizer, trainer.lr_scheduler
    if resume is not None:
        resume.load_optimizer_and_scheduler(strategy, wrapped, optimizer, scheduler, ctx)
        if getattr(trainer, "_resume_with_new_hyperparameters", False):  # a PBT exploit
            reapply_hyperparameters(optimizer, scheduler, args)
    plateau = isinstance(scheduler, METRIC_SCHEDULERS)  # stepped on a metric after each evaluation

    state = trainer.state = TrainerState(
        is_local_process_zero=trainer.is_local_process_zero(),
        is_world_process_zero=trainer.is_world_process_zero(),
        train_batch_size=args.train_batch_size,
    )
    state.compute_steps(args, schedule.max_steps)
    state.max_steps, state.num_train_epochs = schedule.max_steps, schedule.num_epochs
    handler = trainer.callback_handler
    epochs_trained, skip_updates = 0, 0
    control = trainer.control = TrainerControl()
    state.stateful_callbacks = TrainerState(stateful_callbacks=[  # as transformers; a resume replaces it
        cb for cb in [*handler.callbacks, control] if isinstance(cb, ExportableState)]).stateful_callbacks
    if resume is not None:
        console.compare_with_checkpoint(args, resume.state)
        _restore_state(state, resume.state)
        trainer._load_callback_state()  # with restore_callback_states_from_checkpoint, as transformers
        control = trainer.control
        epochs_trained, skip_updates = divmod(state.global_step, schedule.updates_per_epoch)
        if resume.world_size not in (None, ctx.world_size):  # the run's record of its group's sizes
            state.log_history.append({"world_size": ctx.world_size, "previous_world_size": resume.world_size,
                                      "epoch": state.epoch, "step": state.global_step})
        if resume.world_size not in (None, ctx.world_size) and state.epoch is not None:
            # another number of workers: the epoch's position carries over as the share of its samples seen
            epochs_trained = int(state.epoch)
            skip_updates = round((state.epoch - epochs_trained) * schedule.micro_per_epoch
                                 / args.gradient_accumulation_steps)
        if args.ignore_data_skip:
            skip_updates = 0
    _mark_trial(state, trainer, trial)
    start_step = state.global_step
    trainer._initial_num_input_tokens_seen = state.num_input_tokens_seen  # this call's tokens per second
    count_tokens = args.include_num_input_tokens_seen != "no"
    resumed_at = (epochs_trained, skip_updates * args.gradient_accumulation_steps) if resume else None
    console.announce_training(trainer, train_dataloader, schedule.num_epochs, schedule.updates_per_epoch,
                              schedule.max_steps, resumed_at)
    writer = session.writer = CheckpointWriter(trainer, session.checkpoint_sink)
    handler.model, handler.optimizer, handler.lr_scheduler = trainer.model, optimizer, scheduler
    handler.train_dataloader = train_dataloader

    control = trainer.control = handler.on_train_begin(args, state, control)
    if args.eval_on_start:  # a sanity check before the first step (no best-model or scheduler update)
        trainer.evaluate(ignore_keys=ignore_keys_for_eval)
    tr_loss = torch.zeros((), device=ctx.device)
    # a resumed run logs its first loss over the steps since the resume (as transformers)
    loop = _LogState(total_loss=0.0, last_logged=state.global_step, grad_norm=None)
    strategy.zero_grad(wrapped)
    ga = args.gradient_accumulation_steps
    max_norm = args.max_grad_norm if args.max_grad_norm is not None and args.max_grad_norm > 0 else math.inf
    samples_seen = 0
    normalised_loss = trainer.compute_loss_func is not None or trainer.model_accepts_loss_kwargs
    # Count label tokens only when something uses the count (HF's loss normalisation, or an override).
    count_items = normalised_loss or (trainer._overrides("compute_loss")
                                      and trainer._compute_loss_takes_num_items())
    shifted = count_items and loss_shifts_labels(trainer.model)
    # Flags need an all-reduce only if some callback may decide differently on different ranks.
    must_sync = must_agree(handler.callbacks, ctx)
    epoch_batches = _EpochBatches(train_dataloader, resumed=resume is not None)
    guard = NonFiniteGuard(args.nonfinite_loss, ctx)
    if ctx.distributed:  # each rank's own work per step, for the driver's straggler warning
        loop.pace = PaceMeter(trainer.model, ctx, time_forward=not args.torch_compile)
    start_time = loop.start_time = time.time()  # as HF: after model, optimizer and state are set up

    for epoch in range(epochs_trained, schedule.num_epochs):
        set_epoch(train_dataloader, epoch)
        first_resumed_epoch = resume is not None and epoch == epochs_trained
        if first_resumed_epoch and skip_updates == 0:
            resume.restore_rng()  # before the epoch's iterator draws its seed, as at save time
        control = trainer.control = handler.on_epoch_begin(args, state, control)
        updates_this_epoch = schedule.updates_per_epoch
        exhausted = False
        start_update = skip_updates if first_resumed_epoch else 0
        batches = epoch_batches(start_update * ga)  # from where the checkpoint was taken
        micro_done = start_update * ga  # the epoch's micro-batches so far: its share done is state.epoch's
        for update in range(start_update, updates_this_epoch):
            fetch_started = time.perf_counter()
            micro = _take(batches, ga)
            if loop.pace is not None:
                loop.pace.fetching(fetch_started)
            if not micro:
                exhausted = True
                break
            if first_resumed_epoch and update == start_update and start_update:
                resume.restore_rng()  # after the skipped batches: the next step draws what it drew
            control = trainer.control = handler.on_step_begin(args, state, control)
            session.micro_steps = len(micro)
            micro_done += len(micro)
            num_items = (_num_items_in_batch(micro, args, ctx, normalised_loss, shifted)
                         if count_items else None)
            losses = []
            for i, inputs in enumerate(micro):
                last = i == len(micro) - 1
                with strategy.no_sync(wrapped, sync=last):
                    loss = trainer.training_step(model, inputs, num_items)
                guard.add(loss)
                losses.append(loss)
                state.total_flos += float(trainer.floating_point_ops(inputs))
                if count_tokens:
                    trainer._track_num_input_tokens(inputs)
                samples_seen += batch_size_of(inputs, default=0)
                if not last:
                    control = trainer.control = handler.on_substep_end(args, state, control)

            loop.learning_rate = trainer._get_learning_rate()  # this step's rate: the one its log shows
            skip = guard.skip_update(state)  # nonfinite_loss: raises, or skips this update everywhere
            tr_loss = _add_losses(tr_loss, losses, args.logging_nan_inf_filter and not guard.finite,
                                  steps_in_window=1 + state.global_step - loop.last_logged)
            if not skip:
                # as transformers, the norm is measured (and logged) without clipping too
                strategy.precision.unscale(optimizer)
                loop.grad_norm = strategy.clip_grad_norm(wrapped, max_norm)
                control = trainer.control = handler.on_pre_optimizer_step(args, state, control)
                step_norm = strategy.optimizer_step(wrapped, optimizer)
                loop.grad_norm = step_norm if step_norm is not None else loop.grad_norm
                control = trainer.control = handler.on_optimizer_step(args, state, control)
                if not plateau:
                    strategy.scheduler_step(scheduler)
            strategy.zero_grad(wrapped)

            state.global_step += 1
            state.epoch = epoch + micro_done / schedule.micro_per_epoch  # transformers' fraction
            control = trainer.control = handler.on_step_end(args, state, control)
            if must_sync or writer.pending:
                any_busy = sync_control(control, ctx, busy=writer.busy())
                if writer.pending and not any_busy:
                    writer.commit()  # every rank's part is written: commit in this same step
            tr_loss = _maybe_log_evaluate_save(trainer, tr_loss, loop, trial, ignore_keys_for_eval, must_sync)
            control = trainer.control
            if control.should_epoch_stop or control.should_training_stop:
                break
        if exhausted and schedule.num_epochs == sys.maxsize and state.global_step == 0:
            raise ValueError("the training dataset yielded no batch; check train_dataset and batch size")
        control = trainer.control = handler.on_epoch_end(args, state, control)
        if must_sync:
            sync_control(control, ctx)
        tr_loss = _maybe_log_evaluate_save(trainer, tr_loss, loop, trial, ignore_keys_for_eval, must_sync)
        control = trainer.control
        if control.should_training_stop or state.global_step >= schedule.max_steps:
            break

    writer.commit()  # the end of training waits for the last save
    if loop.pace is not None:
        loop.pace.close()
    console.training_completed()
    if neftune is not None:
        neftune.remove()
    total_loss = loop.total_loss + _mean_across_ranks(tr_loss, ctx)
    train_loss = total_loss / max(state.global_step - start_step, 1)
    num_samples = int(ctx.sum([float(samples_seen)])[0])
    # the steps this call ran (as transformers), not those a resumed checkpoint had done
    metrics = speed_metrics("train", start_time, num_samples=num_samples,
                            num_steps=state.global_step - start_step)
    metrics["total_flos"] = float(ctx.sum([state.total_flos])[0])  # a float, as transformers
    state.total_flos = metrics["total_flos"]
    metrics["train_loss"] = train_loss
    metrics.update(memory.stop("train"))
    metrics.update(trainer.__dict__.pop("_init_mem_metrics", None) or {})  # once, as transformers
    trainer.log(metrics)
    trainer.control = handler.on_train_end(args, state, trainer.control)
    return TrainOutput(state.global_step, train_loss, metrics)


class _LogState:
    def __init__(self, total_loss: float, last_logged: int, grad_norm):
        self.total_loss = total_loss
        self.last_logged = last_logged
        self.grad_norm = grad_norm
        self.learning_rate = None  # the last step's, read before its scheduler step (as transformers logs)
        self.pace = None  # each rank's own work per step (worker/pace.py), when distributed
        self.start_time = None  # when the loop's first step began (the rate of tokens in each log)


def _add_losses(tr_loss: torch.Tensor, losses: list, nan_inf_filter: bool, steps_in_window: int):
    """``tr_loss`` plus one update's micro-batch losses. With ``nan_inf_filter`` a non-finite loss adds the
    window's running mean instead (on the device, no host sync); the loop passes False when the update's
    losses were read and all found finite, where the filter would change nothing."""
    for loss in losses:
        if nan_inf_filter:
            loss = torch.where(torch.isfinite(loss), loss, tr_loss / steps_in_window)
        tr_loss = tr_loss + loss
    return tr_loss


def _maybe_log_evaluate_save(trainer, tr_loss, loop: _LogState, trial, ignore_keys, must_sync: bool = False):
    """Log, evaluate, save -- as the (agreed) flags say. A flag a callback sets in ``on_log``, ``on_evaluate``
    or ``on_save`` on any rank is agreed across ranks before anything acts on it (an evaluation, a save, the
    loop's stop): one more flag all-reduce on the steps that log, evaluate or save, none on the others."""
    args, state, control = trainer.args, trainer.state, trainer.control
    if not (control.should_log or control.should_evaluate or control.should_save):
        return tr_loss  # most steps
    ctx = trainer._ctx
    if control.should_log and state.global_step > loop.last_logged:
        loss = _logging_window_sums(trainer._session, tr_loss, loop.pace)
        loop.total_loss += loss
        logs = {"loss": loss / (state.global_step - loop.last_logged)}  # unrounded, as transformers 5
        if loop.grad_norm is not None:
            logs["grad_norm"] = float(loop.grad_norm)
        logs["learning_rate"] = (loop.learning_rate if loop.learning_rate is not None
                                 else trainer._get_learning_rate())
        loop.last_logged = state.global_step
        tr_loss = torch.zeros_like(tr_loss)
        trainer.log(logs, loop.start_time)
        if must_sync:
            sync_control(trainer.control, ctx)  # on_log's flags

    metrics = None
    if trainer.control.should_evaluate:
        metrics = trainer._evaluate(trial, ignore_keys)
        new_best = bool(trainer._determine_best_metric(metrics, trial))  # transformers' own
        if getattr(args.save_strategy, "value", args.save_strategy) == "best":
            trainer.control.should_save = new_best
        if must_sync:
            sync_control(trainer.control, ctx)  # on_evaluate's (and the evaluation's on_log) flags

    if trainer.control.should_save:
        trainer._save_checkpoint(trainer.model_wrapped, trial, metrics=metrics)
        trainer.control = trainer.callback_handler.on_save(args, state, trainer.control)
        if must_sync:
            sync_control(trainer.control, ctx)  # on_save's flags
    return tr_loss


class _Optimizers:
    """The Trainer's ``create_*`` methods (a subclass's overrides included), as a strategy asks for them
    (``strategies.base.OptimizerFactory``)."""

    def __init__(self, trainer, num_training_steps: int):
        self.trainer, self.num_training_steps = trainer, num_training_steps

    def optimizer(self):
        return self.trainer.create_optimizer()

    def scheduler(self, optimizer):
        return self.trainer.create_scheduler(self.num_training_steps, optimizer=optimizer)

    def both(self):
        self.trainer.create_optimizer_and_scheduler(num_training_steps=self.num_training_steps)
        return self.trainer.optimizer, self.trainer.lr_scheduler


def _restore_state(state: TrainerState, saved: TrainerState) -> None:
    """Take the saved run's progress; keep what belongs to this run (ranks, steps plan)."""
    for name in ("global_step", "epoch", "log_history", "best_metric", "best_global_step",
                 "best_model_checkpoint", "total_flos", "num_input_tokens_seen", "stateful_callbacks",
                 "trial_name", "trial_params"):
        setattr(state, name, getattr(saved, name))


def _mark_trial(state: TrainerState, trainer, trial) -> None:
    """A search trial's run says so, as transformers' does, for the trackers (a run per trial, its name and
    hyperparameters): set after a resume, which brings the saved run's."""
    search = getattr(trainer, "_search_trial", None)  # (trial id, hyperparameters), set by the search
    if search is None and trial is None:
        return
    state.is_hyper_param_search = True
    if search is not None:
        state.trial_name, state.trial_params = search
    else:  # a Tune config dict, or the workers' stand-in for an Optuna trial
        state.trial_params = dict(trial) if isinstance(trial, dict) else dict(getattr(trial, "params", {}))


def _checkpoint_activations(model: torch.nn.Module, args) -> None:
    """activation_checkpointing, as transformers 5: every_n_layers and offload go to the model's
    activation_checkpointing_enable(); a model with only gradient_checkpointing_enable() gets the rest."""
    kwargs = dict(args.activation_checkpointing_kwargs or {})
    every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None,
                                              every_n_layers=every_n_layers, offload=offload)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or {"use_reentrant": False})


def _num_items_in_batch(micro: list, args, ctx, global_count: bool, shifted: bool = False) -> int | None:
    """Label tokens (not -100) in one accumulation window, counted as transformers does (``shift_labels``
    when the batch has them, else ``labels[..., 1:]`` for a loss that shifts, else ``labels``); summed across
    data-parallel ranks (one all-reduce) only when the loss is normalised by it and
    ``average_tokens_across_devices``."""
    if not micro or "labels" not in micro[0]:
        return None
    count = sum(int(label_targets(b, shifted).ne(-100).sum()) for b in micro)
    if global_count and args.average_tokens_across_devices and ctx.dp_size > 1:
        # the ranks of one model-parallel group read the same batch: its tokens are counted once
        count = int(ctx.sum([float(count)])[0]) // ctx.model_parallel
    return count


def _compiled(model: torch.nn.Module, args) -> torch.nn.Module:
    kwargs = {"backend": args.torch_compile_backend or "inductor"}
    if args.torch_compile_mode:
        kwargs["mode"] = args.torch_compile_mode
    return torch.compile(model, **kwargs)


def _logging_window_sums(session: RankSession, tr_loss: torch.Tensor, pace) -> float:
    """The loss summed since the last log, averaged across ranks; each rank's pace rides in the same
    all-reduce, and rank 0 hands it to the driver (``session.pace_sink``)."""
    ctx = session.ctx
    if pace is None:
        return _mean_across_ranks(tr_loss, ctx)
    total, *per_rank = ctx.sum([float(tr_loss.item()), *pace.slots()])
    if session.pace_sink is not None and ctx.is_world_zero:
        session.pace_sink(pace.report(per_rank))
    return total / ctx.world_size


def _mean_across_ranks(t: torch.Tensor, ctx) -> float:
    return ctx.sum([float(t.item())])[0] / ctx.world_size


class _EpochBatches:
    """Each epoch's batch iterator; a mid-epoch resume's first epoch starts after its first ``skip`` batches.

    Skipped at the batch sampler where the loader allows it, so a resume reads only the examples it trains
    on; otherwise (an iterable dataset, Ray Data batches, a custom loader) the skipped batches are read and
    dropped. Either way the iterator is created, and the skipped batches drawn, before the loop restores
    the checkpoint's RNG state, as the uninterrupted run had drawn them before that state was saved.

    A loader with persistent workers draws its workers' base seed from the global RNG once, at its first
    iterator. The uninterrupted run drew it in its first epoch, before any checkpoint saved the RNG state;
    so in a resumed run that draw leaves the global RNG as it was, else the steps after it would differ.
    """

    def __init__(self, loader, resumed: bool):
        self.loader = loader
        self.fork_first_iterator = resumed and getattr(loader, "persistent_workers", False)

    def __call__(self, skip: int):
        skipping = skip_first_batches(self.loader, skip) if skip else None
        if skipping is not None:
            return iter(skipping)
        batches = self._iter()
        _take(batches, skip)
        return batches

    def _iter(self):
        if not self.fork_first_iterator:
            return iter(self.loader)
        self.fork_first_iterator = False
        with torch.random.fork_rng(devices=[]):
            return iter(self.loader)


def _take(iterator, n: int) -> list:
    out = []
    for _ in range(n):
        try:
            out.append(next(iterator))
        except StopIteration:
            break
    return out
