"""Under FSDP each rank of a hosted trainer reads only its shards of the ``from_pretrained`` model it trains.

TRL's trainers load the model named by ``model=`` (a path or hub id) in their constructor; transformers'
Trainer loads ``model_init``'s in its constructor and again in ``train()``. Left as they are, every rank loads
the whole model and accelerate's ``prepare`` then shards it: at 70B, 280 GB of fp32 weights on each rank for
a moment, which no node holds eight times. raytrainer's own FSDP path builds a skeleton and reads each
rank's shards from the safetensors files (strategies/file_shards.py); a hosted trainer gets the same here:

- the first ``PreTrainedModel.from_pretrained`` of the trainer's construction (or of a ``model_init`` call)
  builds the skeleton under ``meta_model.weightless_loading``, which records each weight's file and key;
- once the trainer holds that model, it is sharded by accelerate's own ``fsdp2_prepare_model`` (the wrap
  policy, mixed precision and units transformers' ``train()`` would give it), each rank allocates its shards
  and reads their bytes from the files (``fsdp.fill_shards``); buffers the files lack (rotary tables) come
  from the model's own initialisation, PEFT's LoRA adapters from PEFT's;
- ``train()`` then finds the model sharded (accelerate leaves an FSDP module as it is) and creates the
  optimizer on the shards.

Where the files cannot give the trained model's weights as they are (a head added after loading, a model the
trainer did not take from the first load, adapters derived from the base weights) every rank builds the
trainer again the ordinary way: whole, then sharded by ``prepare``. So also with FSDP1,
``cpu_ram_efficient_loading`` (accelerate's rank-0 loading, as asked), CPU offload, activation checkpointing,
``torch_compile`` or ``parallelism_config`` (accelerate orders those around its own sharding), one
worker, and ``use_kernels=True``. A trainer whose construction loads nothing (a model given as an object)
is kept as built. A model read shard by shard is not kernelized by hub kernels, which transformers >= 5.25
applies by default where the ``kernels`` package is installed (its ``kernelize`` cannot run on the
weightless model).
"""

from __future__ import annotations

import contextlib
import gc
import logging

import torch

logger = logging.getLogger(__name__)


def wanted(targs, world_size: int) -> bool:
    """Whether ``targs`` (the rank's TrainingArguments) shard with FSDP2 where per-shard loading applies."""
    plugin = getattr(targs, "fsdp_plugin_args", None) or {}
    return (world_size > 1 and bool(plugin) and plugin.get("fsdp_version", 1) == 2
            and not plugin.get("cpu_ram_efficient_loading") and not plugin.get("cpu_offload")
            and not plugin.get("activation_checkpointing") and not getattr(targs, "torch_compile", False)
            and getattr(targs, "parallelism_config", None) is None)


class FirstLoad:
    """Meanwhile (``with first_load.weightless():``), the first ``from_pretrained`` builds a skeleton whose
    weights' files are recorded (``model``, ``sources``); any later one loads for real."""

    def __init__(self):
        self.model, self.sources = None, {}

    @contextlib.contextmanager
    def weightless(self):
        import transformers.modeling_utils as modeling_utils

        from raytrainer.meta_model import weightless_loading

        owner = modeling_utils.PreTrainedModel
        original = vars(owner)["from_pretrained"]

        def from_pretrained(cls, *args, **kwargs):
            owner.from_pretrained = original  # this call only (weightless_loading patches it in turn)
            if kwargs.get("use_kernels"):  # asked for: built the ordinary way (build_trainer catches it)
                raise ValueError("use_kernels=True: hub kernels replace layers of a loaded model, not of a "
                                 "weightless one")
            with weightless_loading(self.sources):  # a skeleton keeps torch's layers (no hub kernels)
                self.model = cls.from_pretrained(*args, **kwargs)
            return self.model

        owner.from_pretrained = classmethod(from_pretrained)
        try:
            yield self
        finally:
            owner.from_pretrained = original


#: What ``shard_from_files`` did, the same on every rank.
SHARDED, AS_BUILT, AGAIN = "sharded", "as built", "again"


def shard_from_files(trainer, loaded: FirstLoad, model) -> str:
    """Shard ``model`` (the trainer's) with the trainer's accelerator and fill each rank's shards from the
    files, where ``loaded`` built it weightless on every rank (SHARDED); leave it where no rank loaded
    anything weightless (AS_BUILT: a model given as an object, or built from a config); else AGAIN: build it
    the ordinary way (no trainer: its construction failed; a skeleton that is not the model trained, or whose
    weights the files lack; no FSDP2 accelerator). Every rank gets the same answer."""
    import torch.distributed as dist
    from accelerate.utils import DistributedType

    from raytrainer.meta_model import is_skeleton
    from raytrainer.strategies.fsdp import initialiser_from_files

    accelerator = getattr(trainer, "accelerator", None)
    initialise, untouched = None, accelerator is not None and loaded.model is None
    if (accelerator is not None and loaded.model is not None and is_skeleton(model)
            and any(m is loaded.model for m in model.modules())
            and accelerator.state.distributed_type == DistributedType.FSDP and accelerator.is_fsdp2):
        initialise = initialiser_from_files(model, loaded.sources)
    mine = 2 if initialise is not None else 1 if untouched else 0
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    votes = torch.tensor([mine, -mine], device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN)  # the least and the most any rank can do
    least, most = int(votes[0]), -int(votes[1])
    if least != most or least == 0:
        return AGAIN
    if least == 1:
        return AS_BUILT
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    from raytrainer.strategies.fsdp import agree_on_replicas, fill_shards

    fsdp2_prepare_model(accelerator, model)  # in place, on the meta device: no weight is materialised
    fill_shards(model, initialise, dist.get_rank(), accelerator.device)
    agree_on_replicas(model)
    return SHARDED


def load_sharded_model_init(trainer) -> None:
    """``trainer.call_model_init`` (``train()`` calls it again for each run) builds its model sharded from
    the files where it can, else whole as before."""
    call = trainer.call_model_init

    def call_model_init(trial=None):
        handler = trainer.callback_handler
        if not any(m is trainer.model for m in trainer.accelerator._models):
            # train() replaces the constructor's model with this call's: not held twice while it builds (a
            # model_init that fails leaves the trainer without one; train() raises its error). The callbacks'
            # model (transformers keeps the constructor's there) becomes the model trained.
            if handler.model is trainer.model:
                handler.model = None
            trainer.model = trainer.model_wrapped = None
            gc.collect()  # transformers models sit in reference cycles: freed by a collection, not the drop
        loaded = FirstLoad()
        with loaded.weightless():
            model = call(trial)
        if shard_from_files(trainer, loaded, model) == AGAIN:
            logger.info("FSDP: %s's weights are not the pretrained files' as they are; every rank builds it "
                        "whole, then shards it", type(model).__name__)
            del model, loaded
            model = call(trial)
        if handler.model is None:
            handler.model = model
        return model

    trainer.call_model_init = call_model_init
