"""Per-shard construction under FSDP2: each rank builds only its shard of a model, in transformers' loop.

A rank's ``model_init`` (or TRL's load by name) runs on the meta device (raytrainer.meta_model), accelerate
shards the skeleton with ``fully_shard``, and each rank then fills only its shards
(worker/hosted_loading.py): from the pretrained files' bytes for its slices (``initialiser_from_files``,
strategies/file_shards.py), or with the model's own initialisation run on its shards (``model_initialiser``).
``fill_shards`` allocates and fills; ``agree_on_replicas`` then makes the copies several ranks hold (HSDP's
replicas, tensor parallelism's replicated parameters, buffers) equal. No rank ever holds the whole model:
at 70B on 64 ranks, 2.2 GB of weights each instead of 140 GB on rank 0.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def fill_shards(model: torch.nn.Module, initialise, rank: int, device: torch.device) -> None:
    """Allocate this rank's shards of the meta-built, sharded ``model`` on ``device`` and run ``initialise``
    on them (the model's own initialisation, the pretrained files' bytes). Random draws: each rank its own
    stream (on a CPU mesh DTensor's random ops draw from the local generator, so the same seed would give
    every shard the same values); every rank then goes on from the shared generator state it had. Copies
    of the same values on several ranks are made equal after (``agree_on_replicas``)."""
    import warnings

    model.to_empty(device=device)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad(), warnings.catch_warnings():
        torch.manual_seed(torch.initial_seed() + rank)
        warnings.filterwarnings("ignore", message=".*DTensor random operators.*")
        initialise()


def agree_on_replicas(model: torch.nn.Module, tp_group=None) -> None:
    """Each rank drew its own values in ``fill_shards``, also where ranks hold copies of the same values --
    HSDP's replicas, a tensor-parallel group's replicated parameters (norms, biases of rowwise layers, layers
    without a plan; ``tp_group``) and buffers: those copies take the values of the first rank that holds them
    (a broadcast over each dimension a tensor is not sharded on; replicated tensors are the small ones)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            groups = []
            if isinstance(tensor, DTensor):
                mesh, local = tensor.device_mesh, tensor.to_local()
                groups = [mesh.get_group(i) for i, p in enumerate(tensor.placements) if p.is_replicate()]
                if tp_group is not None and "tp" not in mesh.mesh_dim_names:
                    groups.append(tp_group)  # sharded over the data-parallel ranks only: copies over tp
            else:
                local = tensor
                groups = [None]  # a plain tensor: one copy per rank
            for group in groups:
                source = 0 if group is None else dist.get_global_rank(group, 0)
                dist.broadcast(local, src=source, group=group)


def initialiser_from_files(model: torch.nn.Module, sources: dict):
    """What fills ``model``'s shards from the files ``weightless_loading(sources)`` saw its weights set from
    (``file_shards.files_initialiser``), or None where the files do not give them all."""
    from raytrainer.meta_model import sources_by_name
    from raytrainer.strategies.file_shards import files_initialiser

    files = sources_by_name(model, sources)
    return files_initialiser(model, files, model_initialiser(model)) if files else None


def model_initialiser(model: torch.nn.Module):
    """How ``model`` initialises every parameter and buffer it holds, on whatever storage they have (its
    shards), or None: transformers' ``initialize_weights``, the root module's own ``reset_parameters``, or
    each module's own (``_each_module_resets``).
    Taken from the model as built, before ``fully_shard`` changes its class."""
    hf = (getattr(model, name, None) for name in ("initialize_weights", "_init_weights"))
    if all(callable(method) for method in hf):
        custom = type(model).is_custom_code() if hasattr(type(model), "is_custom_code") else False

        def initialise():
            for module in model.modules():
                module.__dict__.pop("_is_hf_initialized", None)
            # FSDP2 made the root's class a subclass defined in torch, which transformers would take for
            # custom code (and then skip the modules that hold no parameters of their own)
            model.is_custom_code = lambda: custom
            try:
                model.initialize_weights()
            finally:
                del model.is_custom_code
        return initialise
    if any("reset_parameters" in vars(cls) for cls in type(model).__mro__[:-1]
           if cls is type(model) or cls.__module__.split(".")[0] != "torch"):
        return model.reset_parameters
    return _each_module_resets(model)


def initialiser_methods(model: torch.nn.Module) -> frozenset:
    """The methods whose writes ``model_initialiser(model)`` makes again on each shard: for a transformers
    model, everything its construction writes (its ``_init_weights``, which ``initialize_weights`` runs on
    each shard, is what a whole build's values follow); else ``reset_parameters`` (the root's, or each
    module's own). A weight the build set anywhere else (a custom init or a ``load_state_dict`` in
    ``model_init`` after the constructor, ``self.apply(self._init_weights)`` in a plain module's
    ``__init__``) would come out otherwise on the shards (``meta_model.InPlaceWrites``)."""
    from raytrainer.meta_model import INIT_METHODS

    hf = (getattr(model, name, None) for name in ("initialize_weights", "_init_weights"))
    if all(callable(method) for method in hf):
        return INIT_METHODS | {"__init__"}
    return frozenset({"reset_parameters"})


def _each_module_resets(model: torch.nn.Module):
    """torch's convention, as torchtitan and Lightning Fabric use it: each module that holds parameters or
    buffers initialises them with its own ``reset_parameters()`` (``nn.Linear``, ``nn.Embedding``,
    ``nn.LayerNorm``, a user's module that defines one). The initialiser runs them all, in module order;
    None (every rank builds the whole model, with a warning naming what) where a parameter or buffer
    belongs to a module without one: after ``to_empty`` its values would be whatever the memory held."""
    resets, orphans = [], []
    for name, module in model.named_modules():
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        if not own:
            continue
        if callable(getattr(module, "reset_parameters", None)):
            resets.append(module.reset_parameters)
        else:
            orphans += [f"{name}.{n}" if name else n for n, _ in own]
    if orphans:
        logger.warning(
            "FSDP: %s has parameters or buffers that no module's reset_parameters() initialises (%s); rank 0 "
            "builds the whole model and broadcasts it into every rank's shard. Give their module a "
            "reset_parameters() (or the model a root one) to initialise each shard on its rank",
            type(model).__name__, ", ".join(orphans[:5]) + (", ..." if len(orphans) > 5 else ""))
        return None
    if not resets:
        return None

    def initialise():
        for reset in resets:
            reset()
    return initialise
