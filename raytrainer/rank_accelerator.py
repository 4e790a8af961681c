"""``trainer.accelerator``: the part of accelerate's ``Accelerator`` that Trainer subclasses and user code
call, answered by raytrainer's own rank context and strategy (no accelerate state is created).

A subclass written for transformers.Trainer that does ``self.accelerator.backward(loss)``,
``self.accelerator.gather_for_metrics(x)`` or ``self.accelerator.is_main_process`` runs unchanged, in the
script's process (``num_workers=0``) and on every Ray worker.
"""

from __future__ import annotations

import contextlib

import torch


class RankAccelerator:
    def __init__(self, trainer):
        self._trainer = trainer

    @property
    def _ctx(self):
        return self._trainer._view

    # -- where this process stands ----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._ctx.device

    @property
    def num_processes(self) -> int:
        return self._ctx.world_size

    @property
    def process_index(self) -> int:
        return self._ctx.rank

    @property
    def local_process_index(self) -> int:
        return self._ctx.local_rank

    @property
    def is_main_process(self) -> bool:
        return self._ctx.is_world_zero

    @property
    def is_local_main_process(self) -> bool:
        return self._ctx.is_local_zero

    @property
    def use_distributed(self) -> bool:
        return self._ctx.distributed

    @property
    def mixed_precision(self) -> str:
        args = self._trainer.args
        return "bf16" if args.bf16 else "fp16" if args.fp16 else "no"

    @property
    def gradient_accumulation_steps(self) -> int:
        return self._trainer.args.gradient_accumulation_steps

    # -- what the training step uses --------------------------------------------------------------------
    def prepare(self, *objects):
        """Models and optimizers are placed by raytrainer's strategy: returned as given. A ``DataLoader`` is
        sharded as accelerate shards it, each data-parallel rank reading its own batches
        (``data.shard_loader``): a subclass that builds its loader as transformers' does and prepares it
        trains each example once per epoch on Ray too."""
        from torch.utils.data import DataLoader

        from raytrainer.data import shard_loader

        ctx = self._ctx
        prepared = tuple(shard_loader(o, ctx.dp_size, ctx.dp_rank, self._trainer._data_seed())
                         if isinstance(o, DataLoader) else o for o in objects)
        return prepared[0] if len(prepared) == 1 else prepared

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """Backward the way the run's strategy does it (loss scaling for fp16, a DeepSpeed engine's own)."""
        strategy = self._trainer._strategy
        if strategy is None:
            loss.backward(**kwargs)
        else:
            strategy.backward(loss)

    def autocast(self):
        strategy = self._trainer._strategy
        return strategy.precision.autocast() if strategy is not None else contextlib.nullcontext()

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True):
        """The module under the strategy's wrapper (DDP, a DeepSpeed engine) and torch.compile's."""
        strategy = self._trainer._strategy
        if strategy is not None:
            model = strategy.unwrap(model)
        model = getattr(model, "_orig_mod", model)
        wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
        return model.module if isinstance(model, wrappers) else model

    # -- collectives --------------------------------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        self._ctx.barrier()

    def gather(self, tensor):
        """Every rank's ``tensor`` (or nested list/dict of them), concatenated along dim 0, on every rank."""
        ctx = self._ctx
        if not ctx.distributed:
            return tensor
        if isinstance(tensor, dict):
            return type(tensor)({k: self.gather(v) for k, v in tensor.items()})
        if isinstance(tensor, (list, tuple)):
            return type(tensor)(self.gather(v) for v in tensor)
        t = tensor if tensor.dim() else tensor[None]
        parts = [torch.empty_like(t) for _ in range(ctx.world_size)]
        torch.distributed.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    def gather_for_metrics(self, data):
        """As ``gather``; objects that are not tensors are gathered as Python objects into one list."""
        if isinstance(data, torch.Tensor) or (isinstance(data, (list, tuple, dict)) and _all_tensors(data)):
            return self.gather(data)
        ctx = self._ctx
        if not ctx.distributed:
            return data
        out = [None] * ctx.world_size
        torch.distributed.all_gather_object(out, data)
        return [x for part in out for x in (part if isinstance(part, list) else [part])]

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        ctx = self._ctx
        if not ctx.distributed:
            return tensor
        t = tensor.clone()
        torch.distributed.all_reduce(t)
        return t / ctx.world_size if reduction == "mean" else t

    # -- output -------------------------------------------------------------------------------------------
    def print(self, *args, **kwargs) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self):
        with self._trainer.args.main_process_first(local=False):
            yield


def _all_tensors(data) -> bool:
    values = data.values() if isinstance(data, dict) else data
    return all(isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple, dict)) and _all_tensors(v))
               for v in values)
