"""``parallelism_config`` for transformers' loop on CPU workers (any hosted trainer, raytrainer's Trainer).

accelerate takes a ``ParallelismConfig`` only on an FSDP2, multi-GPU or DeepSpeed state
(``ParallelismConfig._validate_accelerator``); a CPU group's state is ``MULTI_CPU``, so every rank would fail
building the trainer. And accelerate applies no tensor parallelism itself: it wants the model sharded over
the mesh's ``tp`` dimension before ``prepare``. Measured under torchrun on 4 CPU processes (transformers
5.24, accelerate 1.16), transformers' loop trains dp_shard x tp, HSDP and tp alone as DDP does on the same
global batch, with three changes made from here, per trainer:

1. its accelerator is built with the arguments' ``parallelism_config`` hidden, switched to FSDP where the
   mesh has data-parallel dimensions (worker/hosted_sharding.shard_cpu_group; the ranks' arguments then ask
   for ``fsdp``: hosted_recipe), and then given the config and its device mesh (``parallelism.build_mesh``:
   one mesh per worker group and shape), the checks accelerate skipped made here;
2. each model ``model_init`` builds (and the one given) is made tensor-parallel over the mesh's ``tp``
   dimension before transformers' loop prepares it (``parallelism.apply_tensor_parallel``); with tp alone it
   is marked with its tensor-parallel size, which accelerate reads;
3. under FSDP2 with tensor parallelism, accelerate's ``_prepare_tp`` is skipped: it imports
   ``transformers.integrations.tensor_parallel.ReplicateParallel``, which transformers 5.24 no longer has;
   the parameters outside the plan (the norms) stay plain and FSDP2 shards them over the data-parallel
   dimensions, the layout raytrainer's own loop makes.
"""

from __future__ import annotations

import contextlib


def wanted(args) -> bool:
    """Whether this rank's arguments ask for a mesh accelerate would refuse (a CPU group)."""
    return getattr(args, "parallelism_config", None) is not None and bool(args.use_cpu)


@contextlib.contextmanager
def hidden(args):
    """``args.parallelism_config`` hidden from accelerate while the accelerator is built; yields it (None
    where nothing is hidden)."""
    if not wanted(args):
        yield None
        return
    config, args.parallelism_config = args.parallelism_config, None
    try:
        yield config
    finally:
        args.parallelism_config = config


def install(trainer, config) -> None:
    """The mesh of ``config`` on ``trainer``'s accelerator state, and the model given made tensor-parallel
    (``call_model_init`` makes each model ``model_init`` builds so)."""
    from accelerate.utils import DistributedType

    from raytrainer.parallelism import build_mesh
    from raytrainer.rank_context import ray_train_context

    accelerator = trainer.accelerator
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    if config.total_size != accelerator.num_processes:
        raise ValueError(f"parallelism_config spans {config.total_size} ranks; the worker group has "
                         f"{accelerator.num_processes}")
    if fsdp and not (config.dp_shard_enabled or config.cp_enabled):
        raise ValueError("parallelism_config: fsdp given, but the mesh has no dp_shard (or cp) dimension for "
                         "it to shard over; raise dp_shard_size or drop fsdp")
    if not fsdp and config.data_parallel_size > 1:
        raise ValueError("parallelism_config: data-parallel dimensions without dp_shard on CPU workers "
                         "(nothing would average the replicas' gradients); use dp_shard_size")
    state = accelerator.state
    state.parallelism_config = config
    state.device_mesh = build_mesh(config, ray_train_context(use_gpu=False))
    if fsdp and config.tp_enabled:
        accelerator._prepare_tp = lambda *objects: objects  # see the module's docstring, 3.
    if trainer.model is not None:
        tensor_parallel(trainer, trainer.model)
    call_model_init = trainer.call_model_init

    def call_model_init_tensor_parallel(trial=None):
        return tensor_parallel(trainer, call_model_init(trial))

    trainer.call_model_init = call_model_init_tensor_parallel


def tensor_parallel(trainer, model):
    """``model`` sharded over the mesh's ``tp`` dimension (once), as accelerate wants it before
    ``prepare``."""
    from torch.distributed.tensor import DTensor

    from raytrainer.parallelism import apply_tensor_parallel, check_plan

    accelerator = trainer.accelerator
    config = accelerator.state.parallelism_config
    if model is None or not config.tp_enabled or any(isinstance(p, DTensor) for p in model.parameters()):
        return model
    check_plan(config, model)
    apply_tensor_parallel(model, accelerator.torch_device_mesh)
    if not accelerator.is_fsdp2:  # tp alone: accelerate's get_model_tp_size, transformers' get_tp_size
        model._tp_size = config.tp_size
        if getattr(model, "tp_size", None) is None:  # a plain module (transformers' models read _tp_size)
            model.tp_size = config.tp_size
    return model


def check(targs) -> None:
    """On the driver, before anything starts: a mesh transformers' loop runs on CPU workers (raytrainer's
    own checks of the mesh, and no checkpoints under tensor parallelism alone)."""
    from raytrainer.parallelism import SIZES, _error
    from raytrainer.parallelism import check as check_mesh

    check_mesh(targs)
    config = targs.parallelism_config
    if config.tp_enabled and not config.dp_shard_enabled and targs.save_strategy != "no":
        shown = {k: getattr(config, k) for k in SIZES if getattr(config, k) != 1}
        raise _error(shown, "with tensor parallelism alone transformers' loop saves each checkpoint by "
                     "handing its DTensor weights to safetensors, which cannot write them",
                     "add dp_shard_size (checkpoints are then each rank's DCP shards), or pass "
                     "--save_strategy no")
