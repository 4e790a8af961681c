"""Precision plugins, composed into every strategy: how the forward runs and how gradients step.

``Precision`` is full precision and does nothing special. ``AutocastPrecision`` runs forward (and the
loss) under ``torch.autocast`` in bf16; ``Fp16Precision`` adds dynamic loss scaling (``GradScaler``):
the loss is scaled before backward, gradients are unscaled before clipping, and a step whose gradients
hold inf/NaN is skipped while the scale shrinks. Both work on CPU and CUDA.
"""

from __future__ import annotations

import contextlib

import torch


class Precision:
    name = "fp32"

    def autocast(self):
        return contextlib.nullcontext()

    def forward_in_autocast(self, forward):
        """``forward`` as accelerate's prepared model runs it -- in autocast, floating outputs cast back to
        fp32 -- through which transformers' Trainer generates; None: no autocast, nothing to wrap."""
        return None

    def convert_input(self, data):
        """Inputs as the model expects them (an engine that casts the module casts floating inputs)."""
        return data

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale(self, optimizer) -> None:
        """Bring gradients to their true scale (before clipping them)."""

    def optimizer_step(self, optimizer) -> None:
        optimizer.step()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class AutocastPrecision(Precision):
    def __init__(self, device_type: str, dtype: torch.dtype):
        self.device_type, self.dtype = device_type, dtype
        self.name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype)

    def forward_in_autocast(self, forward):
        from accelerate.utils import convert_outputs_to_fp32

        return convert_outputs_to_fp32(self.autocast()(forward))


class Fp16Precision(AutocastPrecision):
    def __init__(self, device_type: str):
        super().__init__(device_type, torch.float16)
        self.scaler = torch.amp.GradScaler(device_type)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale(self, optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer) -> None:
        self.scaler.step(optimizer)  # skipped when the gradients hold inf/NaN
        self.scaler.update()

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.scaler.load_state_dict(state)


class CastPrecision(Precision):
    """The module itself is in ``dtype`` (a DeepSpeed engine casts it; fp16/bf16_full_eval cast it for
    evaluation): no autocast, floating inputs cast to ``dtype``, as HF does."""

    def __init__(self, dtype: torch.dtype | None):
        self.dtype = dtype
        self.name = {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[dtype]

    def convert_input(self, data):
        if self.dtype is None:
            return data
        if isinstance(data, torch.Tensor):
            return data.to(self.dtype) if data.is_floating_point() else data
        if isinstance(data, dict):
            return type(data)({k: self.convert_input(v) for k, v in data.items()})
        if isinstance(data, (list, tuple)):
            return type(data)(self.convert_input(v) for v in data)
        return data


def select_precision(args, device: torch.device) -> Precision:
    if args.fp16:
        return Fp16Precision(device.type)
    if args.bf16:
        return AutocastPrecision(device.type, torch.bfloat16)
    return Precision()
