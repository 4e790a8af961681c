"""Under FSDP each rank of a hosted trainer builds only its shards of the model it trains.

A ``model_init`` that builds a module itself (a config's model, a plain torch module) is built on the meta
device on every rank, sharded, and each rank runs the model's own initialisation on its shards
(``plain_build``; with ``cpu_ram_efficient_loading`` rank 0 builds it and accelerate broadcasts it into the
shards). A ``from_pretrained`` model is read shard by shard from its files:

TRL's trainers load the model named by ``model=`` (a path or hub id) in their constructor; transformers'
Trainer loads ``model_init``'s in its constructor and again in ``train()``. Left as they are, every rank loads
the whole model and accelerate's ``prepare`` then shards it: at 70B, 280 GB of fp32 weights on each rank for
a moment, which no node holds eight times. Instead each rank builds a skeleton and reads its shards from
the safetensors files (strategies/file_shards.py):

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
import functools
import gc
import logging

import torch

logger = logging.getLogger(__name__)


def wanted(targs, world_size: int) -> bool:
    """Whether ``targs`` (the rank's TrainingArguments) shard with FSDP2 where per-shard loading applies."""
    plugin = getattr(targs, "fsdp_plugin_args", None) or {}
    return plain_wanted(targs, world_size) and not plugin.get("cpu_ram_efficient_loading")


def plain_wanted(targs, world_size: int) -> bool:
    """Whether a ``model_init`` that builds a plain module is built without a whole copy on each rank
    (``plain_build``): FSDP2 on several ranks, as for the files, and with ``cpu_ram_efficient_loading``."""
    plugin = getattr(targs, "fsdp_plugin_args", None) or {}
    return (world_size > 1 and bool(plugin) and plugin.get("fsdp_version", 1) == 2
            and not plugin.get("cpu_offload") and not plugin.get("activation_checkpointing")
            and not getattr(targs, "torch_compile", False)
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
    least, negated_most = _least(mine, -mine)  # the least and the most any rank can do
    most = -negated_most
    if least != most or least == 0:
        return AGAIN
    if least == 1:
        return AS_BUILT
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    from raytrainer.strategies.fsdp import agree_on_replicas, fill_shards

    with not_twice():  # in place, on the meta device: no weight is materialised
        fsdp2_prepare_model(accelerator, model)
    fill_shards(model, initialise, dist.get_rank(), accelerator.device)
    agree_on_replicas(model)
    return SHARDED


def load_sharded_model_init(trainer, files: bool = True) -> None:
    """``trainer.call_model_init`` (``train()`` calls it again for each run) builds a plain module without a
    whole copy on any rank (``plain_build``), and with ``files`` a ``from_pretrained`` model sharded from the
    files where it can; else whole as before. Installed before the constructor runs too (its own
    ``model_init`` call, after it made the accelerator), the callbacks not made yet."""
    call = functools.partial(type(trainer).call_model_init, trainer)  # the class's own, once

    def call_model_init(trial=None):
        handler = getattr(trainer, "callback_handler", None)
        if not any(m is getattr(trainer, "model", None) for m in trainer.accelerator._models):
            # train() replaces the constructor's model with this call's: not held twice while it builds (a
            # model_init that fails leaves the trainer without one; train() raises its error). The callbacks'
            # model (transformers keeps the constructor's there) becomes the model trained.
            if handler is not None and handler.model is getattr(trainer, "model", None):
                handler.model = None
            trainer.model = trainer.model_wrapped = None
            gc.collect()  # transformers models sit in reference cycles: freed by a collection, not the drop
        model = plain_build(trainer, call, trial)
        if model is None and files:
            loaded = FirstLoad()
            with loaded.weightless():
                model = call(trial)
            if shard_from_files(trainer, loaded, model) == AGAIN:
                logger.info("FSDP: %s's weights are not the pretrained files' as they are; every rank builds "
                            "it whole, then shards it", type(model).__name__)
                del model, loaded
                model = call(trial)
        elif model is None:
            model = call(trial)
        if handler is not None and handler.model is None:
            handler.model = model
        return model

    trainer.call_model_init = call_model_init


class _Loads(Exception):
    """``model_init`` loads weights (``from_pretrained``): not a plain module (the files' way)."""


def plain_build(trainer, call, trial):
    """``call(trial)`` (the trainer's ``model_init``) of a module it builds itself -- no ``from_pretrained``
    inside -- under FSDP2 on several ranks, without a whole copy on any rank where it can; None where not
    (a load, a ``model_init`` that refuses the meta device or names its own device, another wrapper): the
    caller then builds it as before. Every rank builds it on the meta device first and all take one way:

    - each rank its own shards (the default): accelerate's ``fsdp2_prepare_model`` shards the skeleton and
      each rank runs the model's own initialisation on its shards (transformers' ``initialize_weights``, the
      root's ``reset_parameters()``, or each module's own: ``strategies.fsdp.model_initialiser``); copies
      of the same values several ranks hold (buffers) are made rank 0's;
    - with ``fsdp_config["cpu_ram_efficient_loading"]``, where some parameter has no initialiser, or where
      initialising a shard failed on any rank (said once), rank 0 builds the model for real and the others
      keep the skeleton (``_from_rank0``)."""
    import torch.distributed as dist
    from accelerate.utils import DistributedType

    from raytrainer.meta_model import is_skeleton
    from raytrainer.strategies.fsdp import initialiser_methods, model_initialiser

    accelerator = getattr(trainer, "accelerator", None)
    if (accelerator is None or accelerator.state.distributed_type != DistributedType.FSDP
            or not accelerator.is_fsdp2 or not dist.is_initialized()):
        return None
    model, writes = _skeleton(call, trial)
    plugin = accelerator.state.fsdp_plugin
    initialise = None
    if model is not None and is_skeleton(model) and not plugin.cpu_ram_efficient_loading:
        initialise = model_initialiser(model)
        beyond = writes.outside(model, initialiser_methods(model)) if initialise is not None else []
        if beyond:  # values initialising each shard would not give: rank 0's build has them
            logger.info("FSDP: model_init sets %s of %s beyond the modules' own initialisation (a custom "
                        "init, loaded weights); rank 0 builds it and broadcasts it into every rank's shard",
                        ", ".join(beyond[:3]) + (", ..." if len(beyond) > 3 else ""), type(model).__name__)
            initialise = None
    (least,) = _least(0 if model is None or not is_skeleton(model) else 2 if initialise is not None else 1)
    if least == 0:
        return None
    if least == 1:
        return _from_rank0(accelerator, call, trial, model)
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    from raytrainer.strategies.fsdp import agree_on_replicas, fill_shards

    with not_twice():  # in place, on the meta device
        fsdp2_prepare_model(accelerator, model)
    error = None
    try:
        fill_shards(model, initialise, dist.get_rank(), accelerator.device)
    except Exception as exc:  # any failure means: rank 0's way
        error = exc
    if _least(0 if error is not None else 1) == [0]:
        logger.warning("FSDP: initialising each rank's shard of %s failed (%s); rank 0 builds the model and "
                       "broadcasts it into every rank's shard instead", type(model).__name__,
                       error or "on another rank")
        del model
        gc.collect()
        return _from_rank0(accelerator, call, trial, _skeleton(call, trial)[0])
    agree_on_replicas(model)
    return model


def _skeleton(call, trial):
    """``call(trial)`` on the meta device, or None where it loads weights (``from_pretrained``) or fails
    there (meta_model.build_on_meta, which puts the random state back); with the tensors it wrote in place
    and where (``meta_model.InPlaceWrites``)."""
    import transformers.modeling_utils as modeling_utils

    from raytrainer.meta_model import InPlaceWrites, build_on_meta

    owner = modeling_utils.PreTrainedModel
    original = vars(owner)["from_pretrained"]

    def loads(cls, *args, **kwargs):
        raise _Loads()

    owner.from_pretrained = classmethod(loads)
    writes = InPlaceWrites()
    try:
        with writes:
            return build_on_meta(lambda: call(trial)), writes
    finally:
        owner.from_pretrained = original


def _least(*mine: int) -> list[int]:
    """The least of every rank's value of each of ``mine`` (one all-reduce)."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    votes = torch.tensor(list(mine), device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN)
    return [int(v) for v in votes]


def _from_rank0(accelerator, call, trial, skeleton):
    """Rank 0 builds the model for real; every other rank keeps ``skeleton`` (on the meta device), given
    rank 0's non-persistent buffers (rotary tables: the state dict leaves them out); accelerate's
    ``prepare`` then broadcasts rank 0's weights into every rank's shards (its ``cpu_ram_efficient_loading``,
    set for this model), and every rank goes on from rank 0's random state, as if each had built it."""
    import torch.distributed as dist

    accelerator.state.fsdp_plugin.cpu_ram_efficient_loading = True
    model = call(trial) if dist.get_rank() == 0 else skeleton
    kept = set(model.state_dict())
    for name, buffer in list(model.named_buffers()):
        if name in kept:
            continue
        value = (buffer.detach().to(accelerator.device, copy=True) if dist.get_rank() == 0
                 else torch.empty(buffer.shape, dtype=buffer.dtype, device=accelerator.device))
        dist.broadcast(value, src=0)
        if dist.get_rank() != 0:
            parent, _, leaf = name.rpartition(".")
            model.get_submodule(parent).register_buffer(leaf, value, persistent=False)
    state = [torch.get_rng_state()]
    dist.broadcast_object_list(state, src=0)
    torch.set_rng_state(state[0])
    return model


@contextlib.contextmanager
def not_twice():
    """Meanwhile ``fully_shard`` of a module whose parameters a unit already holds leaves it in that unit.
    accelerate 1.16 shards each ``_no_split_modules`` block, then carves the input embedding into a unit of
    its own unless the embedding itself is one: BERT's and RoBERTa's blocks include ``BertEmbeddings``, so
    ``fully_shard(word_embeddings)`` met parameters a unit held already and torch raised "Invariant
    encountered: value was None" (on GPUs as here). Tensor parallelism's DTensors, which no unit holds yet,
    are sharded as before. tests/unit/test_hosted_sharding.py pins it."""
    import torch
    import torch.distributed.fsdp as fsdp

    shard = fsdp.fully_shard
    units: list = []  # what this context sharded: its parameters are FSDP's (tensor parallelism's DTensors
    # are not, until a unit takes them)

    def held_above(module) -> bool:  # a parameter a unit holds that is not at or below ``module``
        held = {id(p) for unit in units for p in unit.parameters()}
        below = {id(p) for m in module.modules() if isinstance(m, fsdp.FSDPModule) for p in m.parameters()}
        return any(id(p) in held and id(p) not in below for p in module.parameters())

    def fully_shard(module, *args, **kwargs):
        modules = [module] if isinstance(module, torch.nn.Module) else list(module)
        left = [m for m in modules if not held_above(m)]
        if not left:
            return module if isinstance(module, torch.nn.Module) else None
        units.extend(left)
        return shard(left[0] if isinstance(module, torch.nn.Module) else left, *args, **kwargs)

    fsdp.fully_shard = fully_shard
    try:
        yield
    finally:
        fsdp.fully_shard = shard
