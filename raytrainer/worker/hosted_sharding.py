"""FSDP and ZeRO-3 for transformers' loop on CPU workers, as on GPU workers.

accelerate picks FSDP only for a group of accelerators: for a CPU group (``use_cpu``, gloo) its state keeps
``MULTI_CPU`` whatever ``fsdp`` says (accelerate/state.py, ``AcceleratorState.__init__``), and the model
is wrapped in DDP: every rank holds the whole model, optimizer and gradients, silently. A hosted trainer
(``raytrainer.trl``, ``on_ray``) is built here with one change: right after transformers creates its
accelerator, a CPU group given ``fsdp`` is switched to accelerate's FSDP state with transformers' own
plugin, so ``accelerator.prepare`` shards with ``fully_shard`` (FSDP2) or FSDP1 as it would on GPUs, and
saves, resumes and final weights take transformers' FSDP paths. tests/unit/test_hosted_sharding.py pins
both halves: accelerate still leaves a CPU group unsharded, and after the switch each rank holds its share.

ZeRO-3 needs no switch (accelerate takes a DeepSpeed config on a CPU group), but two things a launcher does
first: DeepSpeed's communication is set up over the group before the trainer is built (a trainer that loads
its model, as TRL's do, partitions it under ``zero.Init``, which sizes the batch by DeepSpeed's world size);
and the driver's ``trainer.model`` is consolidated from the partitions (``save_whole``) where transformers'
``save_model`` writes only DeepSpeed's checkpoint.
"""

from __future__ import annotations

import functools
import logging

from raytrainer.hosted_recipe import building_on_a_rank
from raytrainer.strategies.malloc import return_freed_memory

logger = logging.getLogger(__name__)


def build_trainer(trainer_cls: type, args: tuple, kwargs: dict, targs, again=None):
    """``trainer_cls(*args, **kwargs)`` (``targs``: its training arguments): under DeepSpeed, built after
    DeepSpeed's communication is set up over the worker group; on a CPU group given ``fsdp``, sharded. Under
    FSDP2 on several ranks, given ``again`` (a fresh ``(args, kwargs)`` of the same recipe, for a second
    build), the model it loads with ``from_pretrained`` is read shard by shard (worker/hosted_loading.py)."""
    import torch

    from raytrainer.worker import hosted_loading

    if getattr(targs, "deepspeed", None) and torch.distributed.is_initialized():
        import deepspeed

        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())  # over the worker group
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    plain = hosted_loading.plain_wanted(targs, world_size)
    if again is None or not hosted_loading.wanted(targs, world_size):
        return _construct(trainer_cls, args, kwargs, plain=plain)
    loaded = hosted_loading.FirstLoad()
    try:
        with loaded.weightless():
            trainer = _construct(trainer_cls, args, kwargs, by_shard=True, plain=True)
    except Exception as exc:  # a constructor that reads the weights it loaded: the ordinary way (below)
        logger.info("FSDP: %s could not be built on a weightless model (%s: %s)", trainer_cls.__name__,
                    type(exc).__name__, exc)
        trainer = None
    done = hosted_loading.shard_from_files(trainer, loaded, getattr(trainer, "model", None))
    if done == hosted_loading.SHARDED:
        trainer.model_wrapped = trainer.model
    if done != hosted_loading.AGAIN:
        return trainer
    logger.info("FSDP: the model %s trains is not the pretrained files' as they are; every rank builds the "
                "trainer again, loading the whole model, which prepare() then shards", trainer_cls.__name__)
    del trainer, loaded
    return _construct(trainer_cls, *again(), plain=plain)


def _construct(trainer_cls: type, args: tuple, kwargs: dict, by_shard: bool = False, plain: bool = False):
    """``trainer_cls(*args, **kwargs)``, its accelerator switched to FSDP on a CPU group given ``fsdp``;
    ``plain``: each ``model_init`` call (the constructor's too) builds a plain module without a whole copy on
    any rank; ``by_shard``: each of ``train()`` also reads its shards of the files (hosted_loading.py)."""
    from raytrainer.worker import hosted_loading, hosted_mesh

    trainer = trainer_cls.__new__(trainer_cls)
    create = trainer.create_accelerator_and_postprocess  # the class's own (a subclass may override it)

    def create_accelerator_and_postprocess():
        with hosted_mesh.hidden(trainer.args) as mesh:  # parallelism_config on CPU (worker/hosted_mesh.py)
            create()
            if shard_cpu_group(trainer.accelerator.state, trainer.args):
                create()  # once more, on the FSDP state: transformers' FSDP flags and checks for this run
        if mesh is not None:
            hosted_mesh.install(trainer, mesh)
        gradients_in_the_buckets(trainer.accelerator)
        if getattr(trainer.accelerator, "is_fsdp2", False):
            _tied_embeddings_as_one(trainer.accelerator)

    trainer.create_accelerator_and_postprocess = create_accelerator_and_postprocess  # also for search trials
    if plain:
        hosted_loading.load_sharded_model_init(trainer, files=False)
    building = building_on_a_rank.set(True)
    try:
        trainer.__init__(*args, **kwargs)
    finally:
        building_on_a_rank.reset(building)
    if by_shard:  # after __init__: its own model_init call is the constructor's load, sharded by the caller
        hosted_loading.load_sharded_model_init(trainer)
    trainer._raytrainer_save_whole = functools.partial(save_whole, trainer)  # the driver's trainer.model
    return trainer


def gradients_in_the_buckets(accelerator) -> None:
    """DDP keeps each gradient in the bucket it all-reduces (``gradient_as_bucket_view``) instead of a
    tensor of its own that the bucket is copied into and back from: from the all-reduce to the optimizer
    step every rank holds one copy of the gradients, not two, and the copy back is gone (TRL SFT on 2 CPU
    workers: 1.07x ``accelerate launch``'s steps/s against 0.94x; the peak, in the backward, barely moves).
    The values are the bucket's, averaged, as before (tests/unit/test_hosted_sharding.py: bit for bit
    transformers' own DDP on 2 ranks). transformers' arguments have no field for it (its DDP kwargs: find
    unused parameters, bucket size, buffers, static graph), so a rank sets it on the handler transformers
    made."""
    handler = getattr(accelerator, "ddp_handler", None)
    if handler is not None:
        handler.gradient_as_bucket_view = True
    else:
        from accelerate.utils import DistributedDataParallelKwargs

        accelerator.ddp_handler = DistributedDataParallelKwargs(gradient_as_bucket_view=True)


def _tied_embeddings_as_one(accelerator) -> None:
    """Before accelerate's FSDP2 ``prepare`` shards a model, the embedding modules that hold its input
    embedding's very weight become that one module (``share_tied_embedding``); while it shards, a module
    already inside a unit stays there (``hosted_loading.not_twice``)."""
    import torch

    from raytrainer.worker import hosted_loading

    prepare = accelerator._prepare_fsdp2

    def _prepare_fsdp2(*args):
        for obj in args:
            if isinstance(obj, torch.nn.Module):
                share_tied_embedding(obj)
        with hosted_loading.not_twice():
            return prepare(*args)

    accelerator._prepare_fsdp2 = _prepare_fsdp2


def share_tied_embedding(model) -> None:
    """Each other module of ``model`` that holds its input embedding's weight -- an encoder-decoder's
    ``encoder.embed_tokens`` and ``decoder.embed_tokens``, tied to T5's ``shared`` by ``_tied_weights_keys``
    -- is replaced by the input embedding module itself (same class, same settings), as T5 was built before
    transformers 5. accelerate puts the input embedding in one FSDP2 unit with the LM head and the final
    norm (``fsdp2_prepare_model``, the tied case), and the other two modules stayed in the root's: one weight
    in two units, which torch refuses at the first forward ("shared with a parameter already managed by
    another FSDP group"). As one module, the embedding's unit also gathers its weight for an encoder called
    on its own (``generate()``'s first step). The state dict keeps every name."""
    get = getattr(model, "get_input_embeddings", None)
    embed = get() if callable(get) else None
    weight = getattr(embed, "weight", None)
    if weight is None:
        return
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if (module is not embed and type(module) is type(embed) and getattr(module, "weight", None) is weight
                and module.extra_repr() == embed.extra_repr()):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, embed)


def save_whole(trainer, folder: str) -> None:
    """The trained model as a model folder that ``from_pretrained`` loads (on every rank: a collective).
    transformers' ``save_model``, except under ZeRO-3 without ``stage3_gather_16bit_weights_on_model_save``,
    where ``save_model`` writes DeepSpeed's partitions only: there DeepSpeed gathers them onto rank 0
    module by module (each other rank holds one module's parameters at a time) and rank 0 writes them."""
    engine = trainer.model_wrapped
    if (hasattr(engine, "_zero3_consolidated_16bit_state_dict")
            and engine.zero_optimization_partition_weights()
            and not engine.zero_gather_16bit_weights_on_model_save()):
        trainer._save(folder, state_dict=engine._zero3_consolidated_16bit_state_dict())  # rank 0 writes
    else:
        trainer.save_model(folder)


def shard_cpu_group(state, args) -> bool:
    """Switch accelerate's ``state`` of a CPU group to FSDP with the plugin transformers builds from
    ``args`` (True), or leave it (False: no ``fsdp``, or accelerate already chose)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if args.fsdp_plugin_args is None or state.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    # Each AcceleratorState() refreshes its fields from PartialState's: both say FSDP, as they do on GPUs.
    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return_freed_memory()  # FSDP's transient buffers go back to the OS (strategies/malloc.py)
    return True
