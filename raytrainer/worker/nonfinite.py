"""``nonfinite_loss``: what a NaN or inf training loss does.

transformers trains on (``ignore``); its weights turn NaN and every later checkpoint with them, and a Ray
restart (``max_failures``) would only replay the same step. raytrainer stops by default (``error``): each
micro-batch's loss is or-ed into a flag on the device (no host synchronisation), and the flag is read once
per optimizer update, before the clipping and the step -- so the weights, and any checkpoint written, are
those before the bad update. The error names the rank, the step and the loss; raytrainer does not retry it
(driver/runner.py: a deterministic failure ends the run whatever ``max_failures`` says).

``skip_step`` skips such updates instead (gradients dropped, no optimizer or scheduler step; ``global_step``
still advances, as for an fp16 overflow): every rank must skip the same ones, so the flag is agreed across
ranks (one small all-reduce per update). The cost of ``error`` is a one-byte device-to-host read per
update -- the "loss read every step" side of bench/mfu.py measures what such a read costs on a GPU.
"""

from __future__ import annotations

import logging
import math

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """A training loss was NaN or inf with ``nonfinite_loss="error"``: a deterministic failure."""


class NonFiniteGuard:
    def __init__(self, mode: str, ctx):
        self.mode, self.ctx = mode, ctx
        self.total: torch.Tensor | None = None  # this update's losses summed: not finite if any is not
        self.skipped = 0
        self.finite: bool | None = None  # the last update's losses on this rank, when they were read

    def add(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss (device only)."""
        if self.mode != "ignore":
            self.total = loss.detach().float() if self.total is None else self.total + loss.detach().float()

    def skip_update(self, state) -> bool:
        """Once per optimizer update, after its micro-batches: raises under ``error``; True under
        ``skip_step`` when any rank saw a non-finite loss (the same answer on every rank)."""
        total, self.total, self.finite = self.total, None, None
        if total is None:
            return False
        value = float(total)  # the one host read per update
        self.finite = math.isfinite(value)  # a sum is finite only if each of its terms is
        bad = not self.finite
        if self.mode == "skip_step" and self.ctx.distributed:
            bad = self.ctx.sum([float(bad)])[0] > 0
        if not bad:
            return False
        step = state.global_step + 1
        if self.mode == "error":
            raise NonFiniteLossError(
                f"nonfinite_loss='error': rank {self.ctx.rank} computed a training loss of "
                f"{value} in the update to step {step} (epoch {state.epoch or 0:.2f}); training "
                "stopped before that update, so the weights and the checkpoints are those before it. Lower "
                "learning_rate, set max_grad_norm, check this step's inputs, or pass "
                "nonfinite_loss='skip_step' (skip such updates) or 'ignore' (train on, as transformers)")
        self.skipped += 1
        logger.warning("nonfinite_loss='skip_step': a training loss was not finite in the update to step %d; "
                       "that update is skipped (%d so far)", step, self.skipped)
        return True


class NonFiniteCallback(TrainerCallback):
    """``nonfinite_loss`` for transformers' loop (a hosted trainer: raytrainer.hosted): the same guard,
    fed by the trainer's ``training_step`` and read at ``on_pre_optimizer_step``, after the update's
    micro-batches and their clipping, before ``optimizer.step()``. ``error`` raises there (the weights are
    those before the bad update); ``skip_step`` makes that one ``optimizer.step()`` a skipped one, as
    accelerate's fp16 overflow is (``optimizer_step_was_skipped``: transformers then leaves the scheduler
    alone too, and drops the gradients)."""

    same_on_every_rank = True

    def __init__(self, trainer, mode: str, ctx):
        self.trainer, self.guard, self.skipping = trainer, NonFiniteGuard(mode, ctx), False
        inner = trainer.training_step  # the class's own (TRL's, a user's), bound

        def training_step(*args, **kwargs):
            loss = inner(*args, **kwargs)
            self.guard.add(loss)
            return loss

        trainer.training_step = training_step

    def on_train_begin(self, args, state, control, **kwargs):
        self.guard.total = None  # a step interrupted by a resume or an earlier failure counts nothing here

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.guard.skip_update(state):  # raises under "error"
            optimizer = self.trainer.optimizer
            self.skipping = True

            def skipped(closure=None):
                del optimizer.step  # the class's step again from the next update
                optimizer._is_overflow = True  # accelerate's record of a skipped step

            optimizer.step = skipped

    def on_step_end(self, args, state, control, **kwargs):
        if self.skipping and getattr(self.trainer.optimizer, "scaler", None) is None:
            self.trainer.optimizer._is_overflow = False  # without a scaler nothing else resets it
        self.skipping = False
