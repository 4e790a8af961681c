"""The one interface every distribution strategy implements.

A strategy owns how the model is placed and wrapped, how gradients are produced and synchronised,
and how a consolidated copy of the weights is obtained. The per-rank loop talks to it only through
these methods, so adding a backend never touches the loop.
"""

from __future__ import annotations

import contextlib

import torch

from raytrainer.worker.context import RankContext


class Strategy:
    name = "single"

    def __init__(self, ctx: RankContext, args):
        from raytrainer.strategies.precision import select_precision

        self.ctx = ctx
        self.args = args
        self.precision = select_precision(args, ctx.device)

    # -- setup ---------------------------------------------------------------------------------
    def setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move ``model`` to this rank's device and wrap it; returns the model the loop trains."""
        return model.to(self.ctx.device)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def eval_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module evaluation and prediction run: no collective may hide in its forward."""
        return self.unwrap(model)

    # -- one optimizer step ----------------------------------------------------------------------
    def no_sync(self, model: torch.nn.Module, sync: bool):
        """Context for a micro-step; ``sync=False`` on gradient-accumulation steps skips all-reduce."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss)

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    # -- state -------------------------------------------------------------------------------------
    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Consolidated CPU weights, complete on rank 0 (a collective: every rank calls it)."""
        return {k: v.detach().cpu() for k, v in self.unwrap(model).state_dict().items()}

    def optimizer_state_dict(self, model: torch.nn.Module, optimizer) -> dict:
        """The optimizer state a checkpoint holds, complete on rank 0 (a collective)."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, model: torch.nn.Module, optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)
