"""DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from raytrainer.strategies.base import Strategy


class DDPStrategy(Strategy):
    name = "ddp"

    def setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.ctx.device)
        kwargs = {"find_unused_parameters": find_unused_parameters(self.args, model)}
        if self.args.ddp_bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.args.ddp_bucket_cap_mb
        if self.args.ddp_static_graph is not None:
            kwargs["static_graph"] = self.args.ddp_static_graph
        if self.args.ddp_broadcast_buffers is not None:
            kwargs["broadcast_buffers"] = self.args.ddp_broadcast_buffers
        if self.ctx.device.type == "cuda":
            kwargs["device_ids"] = [self.ctx.device.index]
        return DistributedDataParallel(model, **kwargs)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model: torch.nn.Module, sync: bool):
        return super().no_sync(model, sync) if sync else model.no_sync()


def find_unused_parameters(args, model: torch.nn.Module) -> bool:
    """transformers.Trainer's rule: ``ddp_find_unused_parameters`` when set; else True -- a head whose
    parameters the loss does not use (a pooler, say) would otherwise stop DDP at the next step with
    "Expected to have finished reduction" -- except for a transformers model with gradient checkpointing,
    which that search breaks."""
    if args.ddp_find_unused_parameters is not None:
        return bool(args.ddp_find_unused_parameters)
    if any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__):
        checkpointing = (model.is_activation_checkpointing if hasattr(model, "is_activation_checkpointing")
                         else getattr(model, "is_gradient_checkpointing", False))
        return not (checkpointing or args.activation_checkpointing)
    return True
