"""The one interface every distribution strategy implements.

A strategy owns how the model is placed and wrapped, how gradients are produced and synchronised,
and how a consolidated copy of the weights is obtained. The per-rank loop talks to it only through
these methods, so adding a backend never touches the loop.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any, Protocol

import torch

from raytrainer.rank_context import RankContext


class OptimizerFactory(Protocol):
    """How a strategy gets the optimizer and its LR schedule (the worker loop passes the Trainer's
    ``create_*`` methods, a subclass's overrides included): the strategy never sees the Trainer."""

    num_training_steps: int  #: the schedule's length, in optimizer steps

    def optimizer(self) -> torch.optim.Optimizer: ...

    def scheduler(self, optimizer) -> Any: ...

    def both(self) -> tuple[torch.optim.Optimizer, Any]: ...


class Strategy:
    name = "single"
    #: Whether the model's forward gathers parameters sharded across ranks (a collective in every forward):
    #: then every rank must run the same number of forwards, as ``generate(synced_gpus=True)`` does.
    gathers_in_forward = False

    def __init__(self, ctx: RankContext, args):
        from raytrainer.strategies.precision import select_precision

        self.ctx = ctx
        self.args = args
        self.precision = select_precision(args, ctx.device)
        self._param_cache: tuple | None = None  # (a weak reference to the model, its parameters)
        if args.tf32 is not None and ctx.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = args.tf32
            torch.backends.cudnn.allow_tf32 = args.tf32

    # -- setup ---------------------------------------------------------------------------------
    def model_init_context(self):
        """The context ``model_init`` builds the model in on this rank (Fabric's ``module_init_context``):
        sharded strategies build only this rank's share; the default builds the whole model."""
        return contextlib.nullcontext()

    def build_model(self, factory, fresh: bool = True) -> torch.nn.Module:
        """``factory()`` (the Trainer's ``model_init``) on this rank, in ``model_init_context``. ``fresh``:
        no checkpoint's weights will be loaded into it (a sharded strategy may then initialise each rank's
        share itself)."""
        with self.model_init_context():
            return factory()

    def holds_whole_model(self, model: torch.nn.Module) -> bool:
        """This rank built the whole model (none of it on the meta device): a resume loads it here."""
        return not any(p.is_meta for p in model.parameters())

    def setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move ``model`` to this rank's device and wrap it; returns the model the loop trains."""
        return model.to(self.ctx.device)

    def setup_optimizer(self, model: torch.nn.Module, optimizers: OptimizerFactory) -> tuple:
        """The optimizer and its schedule for the set-up ``model``, made by ``optimizers``: returns
        ``(model the loop trains, optimizer, scheduler)`` -- an engine may wrap all three together here."""
        self._param_cache = None  # a new training run: its model's parameters are listed again
        optimizer, scheduler = optimizers.both()
        return model, optimizer, scheduler

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def eval_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module evaluation and prediction run: no collective may hide in its forward."""
        return self.unwrap(model)

    def generation_context(self, model: torch.nn.Module):
        """What ``model.generate()`` runs in on this rank (Seq2SeqTrainer): ``generate`` calls submodules
        (an encoder, a decoder) directly rather than the wrapped model's forward. Nothing by default."""
        return contextlib.nullcontext()

    # -- one optimizer step ----------------------------------------------------------------------
    def no_sync(self, model: torch.nn.Module, sync: bool):
        """Context for a micro-step; ``sync=False`` on gradient-accumulation steps skips all-reduce."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss)

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor | None:
        return torch.nn.utils.clip_grad_norm_(self._parameters(model), max_norm)

    def optimizer_step(self, model: torch.nn.Module, optimizer) -> float | None:
        """One optimizer update; returns the gradient norm when the step itself measured it."""
        self.precision.optimizer_step(optimizer)
        return None

    def scheduler_step(self, scheduler) -> None:
        scheduler.step()

    def zero_grad(self, model: torch.nn.Module) -> None:
        if type(model).zero_grad is not torch.nn.Module.zero_grad:  # a wrapper's own (an engine's)
            model.zero_grad(set_to_none=True)
            return
        for p in self._parameters(model):  # what Module.zero_grad(set_to_none=True) does
            if p.grad is not None:
                p.grad = None

    def _parameters(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        """``model``'s parameters, listed once per model: walking the module tree is most of what
        ``zero_grad`` and clipping cost a small model each step (about 15 us each for a 3-layer MLP), and a
        model's parameters stay the same objects while it trains, as the optimizer's do (sharding replaces
        them in ``setup_model``, before the optimizer is made). Each training run lists them again
        (``setup_optimizer``): between two ``train()`` calls a model may gain or replace parameters (an
        adapter, resized embeddings)."""
        if self._param_cache is not None and self._param_cache[0]() is model:
            return self._param_cache[1]
        params = list(model.parameters())
        self._param_cache = (weakref.ref(model), params)
        return params

    # -- state -------------------------------------------------------------------------------------
    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Consolidated CPU weights, complete on rank 0 (a collective: every rank calls it)."""
        return {k: v.detach().cpu() for k, v in self.unwrap(model).state_dict().items()}

    def whole_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every weight, a PEFT model's frozen base included (the driver's model is the whole model), complete
        on rank 0 (a collective). ``full_state_dict`` may leave out what a PEFT model's files do not hold."""
        return self.full_state_dict(model)

    def save_final_weights(self, model: torch.nn.Module, folder: str) -> None:
        """Write the trained weights into the local ``folder`` (a collective; see raytrainer.final_weights).
        Replicated weights are consolidated once, by rank 0, into ``model.safetensors``."""
        weights = self.whole_state_dict(model)
        if self.ctx.is_world_zero:
            from safetensors.torch import save_file

            from raytrainer.saving import WEIGHTS_NAME, dedupe_shared

            save_file(dedupe_shared(weights), os.path.join(folder, WEIGHTS_NAME), metadata={"format": "pt"})

    def optimizer_state_dict(self, model: torch.nn.Module, optimizer) -> dict:
        """The optimizer state a checkpoint holds, complete on rank 0 (a collective)."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, model: torch.nn.Module, optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)

    # -- sharded training state (strategies that save it in a folder of their own) ---------------------
    #: Subfolder of checkpoint-<step>/ holding this strategy's sharded training state; None: the optimizer
    #: state is consolidated into optimizer.pt.
    sharded_state_dir: str | None = None

    def saves_model_sharded(self, model) -> bool:
        """Checkpoints hold ``model`` as each rank's shard in ``save_sharded``'s folders (no consolidated
        weights, nothing gathered on rank 0)."""
        return False

    def save_sharded(self, model, optimizer, scheduler, folder: str, step: int) -> str | list[str]:
        """Write this rank's part of the training state under ``folder`` (a collective); returns the
        subfolder(s) written. Writes may go on in the background: see ``take_pending_writes``."""
        raise NotImplementedError

    def take_pending_writes(self) -> list:
        """The futures of the background writes the last ``save_sharded`` started (handed over once): the
        checkpoint writer waits for them, off the training thread, before it lists and hashes the files."""
        return []

    def names_its_writes(self) -> bool:
        """Whether each future of ``take_pending_writes`` gives the path it wrote and ends with this rank's
        own write (DeepSpeed's engine files), rather than with every rank's (DCP): in a folder the ranks
        share, each rank then hashes exactly its own files -- a listing might catch another rank's file
        half-written."""
        return False

    @classmethod
    def check_resume(cls, args, files: list[str], step: int, world_size: int) -> None:
        """On the driver: refuse a checkpoint this strategy cannot resume on ``world_size`` workers -- here,
        one whose model is only a DeepSpeed engine's ZeRO-3 partitions, which only that engine reads."""
        from raytrainer.checkpoint import zero_model_tag

        tag = zero_model_tag(files)
        if tag is not None:
            raise ValueError(
                f"resume_from_checkpoint: this checkpoint holds the model only as DeepSpeed ZeRO-3 "
                f"partitions ({tag}/), which only a ZeRO-3 DeepSpeed engine reads. Resume it with a ZeRO-3 "
                f"`deepspeed` config, or write its weights out with `raytrainer consolidate CHECKPOINT OUT` "
                f"and start from those (model_init loading OUT, or a model built from it).")
