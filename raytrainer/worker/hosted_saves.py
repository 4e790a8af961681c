"""Checkpoints of a hosted trainer written in the background: the step waits only for copies in host memory.

transformers' ``Trainer._save_checkpoint`` writes on the training thread: the weights (``save_model`` ->
``_save`` -> ``save_pretrained``: safetensors) and, under DDP, the optimizer and scheduler
(``_save_optimizer_and_scheduler``: ``torch.save``), on rank 0. A hosted rank (worker/hosted.py) runs it
with three of its steps changed, inside a checkpoint save only (``save_model`` called by a user still
writes before it returns):

- ``_save``: the state dict is copied to the host (into the last save's buffers, ``BackgroundSaves.copy``)
  -- except the frozen parameters, which no step changes (a LoRA
  run copies its adapter, not the base model) -- and transformers' own ``_save`` writes the copy on a
  writer thread (``save_pretrained``, the tokenizer, the arguments: the same files, in the same format).
- ``_save_optimizer_and_scheduler`` under DDP or a single rank: the optimizer's and the scheduler's state
  dicts are copied, and ``torch.save`` writes them on the writer thread, as transformers names them.
- under DeepSpeed, the engine's checkpoint engine is raytrainer's background one
  (strategies/deepspeed_writes.py, as raytrainer's own loop uses): each rank's ZeRO files are copied to the
  host and written on a thread.

- under FSDP with ``SHARDED_STATE_DICT``, accelerate's ``save_fsdp_model`` / ``save_fsdp_optimizer`` call
  DCP's blocking ``save``; inside a checkpoint save they get raytrainer's background DCP save instead
  (strategies/dcp.save_state, as raytrainer's own loop saves: ``async_save`` copies the rank's shards to
  the host, a thread writes them, its collectives on a gloo group beside the step's). tests/unit/
  test_hosted_saves.py pins how accelerate calls it.

Under FSDP a LoRA model's checkpoint leaves out its frozen weights under every name they have
(``_no_frozen_aliases``: torch's filter missed a frozen embedding tied to ``lm_head``).

``load_best_model_at_end`` waits for the last checkpoint's writes and commit first (the best may be it).
The checkpoint's folder is made once ``save_model`` returns: transformers sets ``best_model_checkpoint``
only where the best step's folder exists when it looks, right after ``save_model``, which writes nothing
under ``SHARDED_STATE_DICT`` (the shards come later, from ``_save_optimizer_and_scheduler``): a sharded
run whose latest checkpoint was its best never loaded it at the end (on GPUs as here).

The RNG states and ``trainer_state.json`` (small) are written at once, as transformers writes them. Under
FSDP with ``FULL_STATE_DICT`` (transformers' default) the state is gathered on rank 0, a collective, and
written there on the training thread, as transformers does.

``CommitCallback`` (worker/hosted_commit.py) waits for a checkpoint's writes (``take``) on its own thread
before it lists, hashes and commits the folder; the next save and the end of training wait for it. Memory:
one checkpoint's trainable state on the host, kept between saves so a copy allocates nothing after the
first (DCP's ``async_save`` with ``cache_staged_state_dict`` keeps the same).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import os

import torch

from raytrainer.worker.hosted_adapter import adapter_once


class BackgroundSaves:
    """The writes a hosted trainer's checkpoint saves have started (futures, in order), and the host
    buffers their copies are in: a save copies into the last save's buffers (once that save's writes are
    done) where the shapes match, so after the first save a copy allocates nothing (DCP's
    ``cache_staged_state_dict`` makes the same trade: the buffers stay between saves)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raytrainer-save")
        self._pending: list[concurrent.futures.Future] = []  # until take()
        self._inflight: list[concurrent.futures.Future] = []  # until the next save begins
        self._buffers: dict[str, torch.Tensor] = {}  # the last save's copies, by path in its state
        self._staged: dict[str, torch.Tensor] = {}  # this save's
        self.saving = False  # inside transformers' _save_checkpoint
        #: the driver alone rotates the checkpoints (``save_total_limit``): they are committed in
        #: ``output_dir`` itself, where the driver's registry may be keeping one a hub push still reads
        self.driver_rotates = False
        #: called as each checkpoint save begins, before transformers writes or rotates anything (the last
        #: checkpoint's commit ends: CommitCallback.wait)
        self.before_each: list = []

    def begin(self) -> None:
        """A checkpoint save begins: the last one's writes are done (their errors are the commit's to
        report), so its buffers may take this one's copies."""
        for wait in self.before_each:
            wait()
        concurrent.futures.wait(self._inflight)
        self._inflight, self._staged, self.saving = [], {}, True

    def end(self) -> None:
        self._buffers, self._staged, self.saving = self._staged, {}, False  # unused buffers are freed

    def submit(self, fn, *args) -> None:
        self.track(self._writer.submit(fn, *args))

    def track(self, future: concurrent.futures.Future) -> None:
        """A write of this save going on in the background (the writer thread's, or DCP's own)."""
        self._pending.append(future)
        self._inflight.append(future)

    def take(self) -> list[concurrent.futures.Future]:
        """The writes started since the last call, this trainer's and its DeepSpeed engine's."""
        from raytrainer.strategies.deepspeed_writes import take_pending

        pending, self._pending = self._pending, []
        return pending + take_pending(self.trainer.model_wrapped)

    def copy(self, obj, path: str):
        """``obj`` (a tensor, or a state dict of them) on the host, each tensor in this save's buffer for
        its ``path``; what is not a tensor deep-copied."""
        if isinstance(obj, torch.Tensor):
            buffer = self._buffers.pop(path, None)
            if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
                buffer = obj.detach().to("cpu", copy=True)
            else:
                buffer.copy_(obj.detach())
            self._staged[path] = buffer
            return buffer
        if isinstance(obj, dict):
            return {k: self.copy(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.copy(v, f"{path}/{i}") for i, v in enumerate(obj))
        return copy.deepcopy(obj)


def write_in_background(trainer) -> BackgroundSaves:
    """Make ``trainer``'s checkpoint saves write in the background (its methods wrapped on the instance, so
    a subclass's own overrides still run: TRL's ``_save_checkpoint`` writes its model card first)."""
    saves = BackgroundSaves(trainer)
    save_checkpoint, save, save_model = trainer._save_checkpoint, trainer._save, trainer.save_model
    save_optimizer_and_scheduler = trainer._save_optimizer_and_scheduler

    def _save_checkpoint(model, trial):
        if trainer.is_deepspeed_enabled:
            from raytrainer.strategies.deepspeed_writes import write_in_background as engine_in_background

            engine_in_background(trainer.model_wrapped)
        saves.begin()
        try:
            with contextlib.ExitStack() as stack:
                if saves.driver_rotates:
                    stack.enter_context(_driver_rotates())
                if trainer.is_fsdp_enabled:
                    stack.enter_context(_dcp_in_background(saves))
                    stack.enter_context(_no_frozen_aliases())
                    stack.enter_context(adapter_once(trainer))
                save_checkpoint(model, trial)
        finally:
            saves.end()

    def _save(output_dir=None, state_dict=None):
        if (not saves.saving or not trainer.args.should_save
                or getattr(trainer, "is_distributed_loading_by_transformers", False)  # collectives in it
                or (state_dict is not None and not state_dict)):  # {}: ZeRO-3's placeholder, removed at once
            return save(output_dir, state_dict)
        snapshot = _snapshot(saves, trainer.model, state_dict)
        os.makedirs(output_dir, exist_ok=True)  # the folder transformers writes the rest into, now
        saves.submit(save, output_dir, snapshot)

    def _save_optimizer_and_scheduler(output_dir):
        if not saves.saving or trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
            return save_optimizer_and_scheduler(output_dir)
        if trainer.args.should_save:
            from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

            states = {OPTIMIZER_NAME: saves.copy(trainer.optimizer.state_dict(), "optimizer"),
                      SCHEDULER_NAME: saves.copy(trainer.lr_scheduler.state_dict(), "scheduler")}
            saves.submit(_torch_save_each, output_dir, states)

    def save_model_now(output_dir=None, _internal_call=False):
        save_model(output_dir, _internal_call)
        if saves.saving and output_dir and trainer.args.should_save:  # before transformers looks for the
            os.makedirs(output_dir, exist_ok=True)  # best checkpoint's folder, right after this (above)
        if not saves.saving:  # a user's save_model (ZeRO-3's engine files too) is written when it returns
            for write in saves.take():
                write.result()

    load_best_model = trainer._load_best_model

    def _load_best_model():  # the best checkpoint may be the last, still being written and committed
        for wait in saves.before_each:
            wait()
        concurrent.futures.wait(saves._inflight)
        return load_best_model()

    finalize_training = trainer._finalize_training

    def _finalize_training(*args, **kwargs):  # with save_total_limit=1 it deletes all but the best folder,
        with _driver_rotates():  # the driver does once they are committed (a copy elsewhere goes anyway)
            return finalize_training(*args, **kwargs)

    trainer._load_best_model, trainer._finalize_training = _load_best_model, _finalize_training
    trainer._save_checkpoint, trainer._save, trainer.save_model = _save_checkpoint, _save, save_model_now
    trainer._save_optimizer_and_scheduler = _save_optimizer_and_scheduler
    return saves


@contextlib.contextmanager
def _driver_rotates():
    """Meanwhile transformers deletes no checkpoint. ``_save_checkpoint``'s last step
    (``rotate_checkpoints(output_dir=run_dir, save_total_limit=...)``, a function of ``transformers.trainer``)
    would delete the oldest folders of ``output_dir`` whatever reads them, and ``_finalize_training`` (with
    ``save_total_limit=1`` and a best checkpoint) every folder ``sort_checkpoints`` lists but the best, while
    the driver may still be committing them: it wrote a manifest into a folder being deleted, leaving a
    folder of one file that rotation no longer saw. The driver's registry (driver/registry.py) applies both
    rules to the same folders once each is committed, keeping the ones a hub push is still reading
    (``hub_strategy="all_checkpoints"``). tests/unit/test_hosted_saves.py pins how transformers calls them."""
    import transformers.trainer as hf_trainer

    rotate, listed = hf_trainer.rotate_checkpoints, hf_trainer.sort_checkpoints
    hf_trainer.rotate_checkpoints = lambda *args, **kwargs: None
    hf_trainer.sort_checkpoints = lambda *args, **kwargs: []
    try:
        yield
    finally:
        hf_trainer.rotate_checkpoints, hf_trainer.sort_checkpoints = rotate, listed


@contextlib.contextmanager
def _dcp_in_background(saves: BackgroundSaves):
    """Meanwhile DCP's ``save`` of a folder (accelerate's, under FSDP: ``dist_cp.save(state_dict=...,
    storage_writer=dist_cp.FileSystemWriter(ckpt_dir), planner=...)``) writes in the background, each
    future one of ``saves``' writes."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from raytrainer.strategies.dcp import save_state

    blocking = dcp.save

    def save(state_dict=None, *, checkpoint_id=None, storage_writer=None, **kwargs):
        folder = checkpoint_id or getattr(storage_writer, "path", None)
        planner = kwargs.get("planner")  # accelerate's is DCP's default; raytrainer's puts small items last
        if (folder is None or not dist.is_initialized() or set(kwargs) - {"planner"}
                or (planner is not None and type(planner) is not dcp.DefaultSavePlanner)):
            return blocking(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, **kwargs)
        pending: list = []
        folder = os.path.abspath(str(folder))
        save_state(state_dict, os.path.dirname(folder), os.path.basename(folder), pending)
        for write in pending:
            saves.track(write)
        return None

    dcp.save = save
    try:
        yield
    finally:
        dcp.save = blocking


@contextlib.contextmanager
def _no_frozen_aliases():
    """Meanwhile torch's ``get_model_state_dict`` asked to leave the frozen parameters out leaves out every
    name of them. It drops each under the one name ``named_parameters()`` gives it, so a frozen weight tied
    to another name stayed: a LoRA model whose frozen embedding is tied to its ``lm_head`` (GPT-2, Gemma,
    small Qwen and Llama models) kept ``lm_head.weight``, the whole embedding, in every FSDP checkpoint that
    accelerate saved adapter-only (``save_fsdp_model``, ``ignore_frozen_params=True``; a Gemma's 590M
    numbers per save). Loading it back is unchanged: accelerate loads an adapter-only file not strictly."""
    import torch.distributed.checkpoint.state_dict as dcp_state

    everything = dcp_state.get_model_state_dict

    def get_model_state_dict(model, *, submodules=None, options=None):
        state = everything(model, submodules=submodules, options=options)
        if options is None or not options.ignore_frozen_params:
            return state
        frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        return {name: value for name, value in state.items() if name not in frozen}

    dcp_state.get_model_state_dict = get_model_state_dict
    try:
        yield
    finally:
        dcp_state.get_model_state_dict = everything


def _snapshot(saves: BackgroundSaves, model, state_dict: dict | None) -> dict:
    """``state_dict`` (the model's own when None) with a host copy of each tensor a step may change: the
    frozen parameters are kept as they are (no step changes them). Tensors that share memory (tied
    weights) share their copy, so ``save_pretrained`` sees them tied as it does the live ones."""
    frozen = {p.data_ptr() for p in model.parameters() if not p.requires_grad}
    copies: dict = {}

    def copy(name: str, tensor):
        if not isinstance(tensor, torch.Tensor):
            return saves.copy(tensor, f"model/{name}")
        if tensor.data_ptr() in frozen:
            return tensor
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if key not in copies:
            copies[key] = saves.copy(tensor, f"model/{name}")
        return copies[key]

    state = model.state_dict() if state_dict is None else state_dict
    return {name: copy(name, tensor) for name, tensor in state.items()}


def _torch_save_each(folder: str, states: dict) -> None:
    for name, state in states.items():
        torch.save(state, os.path.join(folder, name))
