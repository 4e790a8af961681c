"""FSDP for transformers' loop on CPU workers, as it runs on GPU workers.

accelerate picks FSDP only for a group of accelerators: for a CPU group (``use_cpu``, gloo) its state keeps
``MULTI_CPU`` whatever ``fsdp`` says (accelerate/state.py, ``AcceleratorState.__init__``), and the model
is wrapped in DDP: every rank holds the whole model, optimizer and gradients, silently. A hosted trainer
(``raytrainer.trl``, ``on_ray``) is built here with one change: right after transformers creates its
accelerator, a CPU group given ``fsdp`` is switched to accelerate's FSDP state with transformers' own
plugin, so ``accelerator.prepare`` shards with ``fully_shard`` (FSDP2) or FSDP1 as it would on GPUs, and
saves, resumes and final weights take transformers' FSDP paths. tests/unit/test_hosted_sharding.py pins
both halves: accelerate still leaves a CPU group unsharded, and after the switch each rank holds its share.
"""

from __future__ import annotations


def build_trainer(trainer_cls: type, args: tuple, kwargs: dict):
    """``trainer_cls(*args, **kwargs)``, sharded on a CPU group when its arguments ask for FSDP."""
    trainer = trainer_cls.__new__(trainer_cls)
    create = trainer.create_accelerator_and_postprocess  # the class's own (a subclass may override it)

    def create_accelerator_and_postprocess():
        create()
        if shard_cpu_group(trainer.accelerator.state, trainer.args):
            create()  # once more, on the FSDP state: transformers' FSDP flags and checks for this run

    trainer.create_accelerator_and_postprocess = create_accelerator_and_postprocess  # also for search trials
    trainer.__init__(*args, **kwargs)
    return trainer


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
    return True
