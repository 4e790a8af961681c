"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state sharded.

Chosen the HF way, with ``fsdp="full_shard auto_wrap offload"``-style options and ``fsdp_config``:

- ``full_shard``: reshard parameters after forward (ZeRO-3); ``shard_grad_op``: keep them gathered until
  backward (ZeRO-2); ``hybrid_shard`` / ``hybrid_shard_zero2``: shard within a node, replicate across
  nodes (a 2-D mesh); ``offload``: parameters and optimizer state on the CPU. Each
  ``fsdp_config["transformer_layer_cls_to_wrap"]`` module (a transformers model's ``_no_split_modules`` by
  default, or each module with at least ``fsdp_config["min_num_params"]`` parameters) is sharded as its
  own unit, then the root, as transformers 5 does with or without ``auto_wrap`` (``fsdp_config
  ["auto_wrap_policy"] = "NO_WRAP"``: the root alone).
- ``fsdp_config["activation_checkpointing"]``: recompute the wrapped layers' activations in backward.
- ``parallelism_config`` (accelerate's ``ParallelismConfig``; see raytrainer/parallelism.py): the mesh
  comes from it -- tensor parallelism over its ``tp`` dimension from the model's ``tp_plan`` first, then
  FSDP2 over its data-parallel dimensions (``dp_shard``; with ``dp_replicate``, HSDP), each layer
  (``_no_split_modules``) its own unit. Parameters are then 2-D DTensors (``_StridedShard`` over
  ``dp_shard``, ``Shard`` over ``tp``); checkpoints are DCP's, resharded on load to any mesh.

The module is sharded in place (its class becomes an ``FSDPModule``); evaluation runs through it, so every
rank takes part in each forward -- raytrainer's evaluation sharding gives every rank the same number of
batches for that reason. Checkpoints (``fsdp_config["state_dict_type"]``): ``SHARDED_STATE_DICT``, the
default, holds the model and the optimizer state as each rank's shards, written by every rank through DCP
into ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` (accelerate's layout) -- nothing is gathered; a resume
reads each rank's share, resharded to any world size (``raytrainer consolidate`` makes safetensors of it).
``FULL_STATE_DICT`` gathers both on rank 0 into ``model.safetensors`` and ``optimizer.pt``, as does
``save_model`` (consolidated weights from ``torch.distributed.checkpoint.state_dict`` with
``full_state_dict=True``); so does ``save_only_model``. A PEFT model's checkpoint holds its adapter files,
gathered alone: the frozen base never reaches rank 0.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from raytrainer.arg_types import as_flag
from raytrainer.strategies.base import Strategy

logger = logging.getLogger(__name__)


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def wraps(config: dict) -> bool:
    """Whether layers are sharded as their own units. transformers 5 wraps by default (its
    ``auto_wrap_policy`` defaults to ``TRANSFORMER_BASED_WRAP``, ``"auto_wrap"`` is a no-op); only
    ``fsdp_config["auto_wrap_policy"] = "NO_WRAP"`` shards the model as one unit, every parameter gathered
    at once in each forward and backward."""
    return str(config.get("auto_wrap_policy", "")).upper() != "NO_WRAP"

class FSDPStrategy(Strategy):
    name = "fsdp"
    gathers_in_forward = True

    def __init__(self, ctx, args):
        super().__init__(ctx, args)
        self._from_rank0 = False  # model_init built real weights on rank 0 only (build_model)
        self._init_shards = None  # model_init built on meta on every rank: (factory, initialise)
        self._pending_writes: list = []  # the background writes of the last save_sharded (futures)
        self.parallelism = getattr(args, "parallelism_config", None)  # accelerate's ParallelismConfig
        self.device_mesh = None  # the run's whole mesh, with parallelism_config (built in setup_model)
        kind = (args.fsdp_config or {}).get("state_dict_type", "SHARDED_STATE_DICT")
        # SHARDED_STATE_DICT: the optimizer state (2x the weights for Adam) stays sharded, one DCP file per
        # rank in optimizer_0/; FULL_STATE_DICT: consolidated into optimizer.pt on rank 0.
        if kind == "SHARDED_STATE_DICT":
            from raytrainer.strategies.dcp import OPTIMIZER_DIR

            self.sharded_state_dir = OPTIMIZER_DIR

    @contextlib.contextmanager
    def generation_context(self, model):
        """``generate()`` calls the encoder and decoder directly, never the root's forward, whose hooks gather
        the parameters the root unit holds (a shared embedding, a tied LM head, the final norms): gathered
        for the whole call and freed after. Each inner unit (a layer) still gathers its own parameters in
        its forward, one layer at a time, as in training."""
        from torch.distributed.fsdp import FSDPModule

        root = model if isinstance(model, FSDPModule) else None
        if root is not None:
            # FSDP2 decides which unit is the root at the first forward through it; a predict() before any
            # training step would otherwise make the first encoder layer the root. Idempotent; torch has no
            # public spelling of it (fully_shard's own pre-forward hook calls the same).
            root._get_fsdp_state()._lazy_init()
            root.unshard()
        try:
            yield
        finally:
            if root is not None:
                root.reshard()

    def saves_model_sharded(self, model) -> bool:
        """SHARDED_STATE_DICT: a checkpoint holds the model as each rank's shard (``pytorch_model_fsdp_0/``),
        nothing gathered -- except a PEFT model's, which stays PEFT's consolidated adapter files (a few MB,
        what ``PeftModel.from_pretrained`` and a hub push take)."""
        return self.sharded_state_dir is not None and not hasattr(self.unwrap(model), "peft_config")

    def save_sharded(self, model, optimizer, scheduler, folder: str, step: int) -> list[str]:
        """The model's and the optimizer's shards, written in the background (DCP's ``async_save``): the step
        waits only for the copy into memory; ``take_pending_writes`` hands the writes to the checkpoint
        writer."""
        from raytrainer.strategies.dcp import save_model, save_optimizer

        pending = self._pending_writes
        written = [save_model(model, folder, pending)] if self.saves_model_sharded(model) else []
        return [*written, save_optimizer(model, optimizer, folder, pending)]

    def take_pending_writes(self) -> list:
        pending, self._pending_writes = self._pending_writes, []
        return pending

    def _mesh(self, options: set[str]):
        from torch.distributed.device_mesh import init_device_mesh

        ctx = self.ctx
        device_type = ctx.device.type
        if self.parallelism is not None:  # FSDP2's part of the whole mesh: its data-parallel dimensions
            from raytrainer.parallelism import build_mesh

            if self.device_mesh is None:
                self.device_mesh = build_mesh(self.parallelism, ctx)
            if self.parallelism.data_parallel_size == 1:
                return None  # tensor parallelism alone: nothing for FSDP to shard over
            return self.device_mesh[tuple(self.parallelism.fsdp_dim_names)]
        if options & {"hybrid_shard", "hybrid_shard_zero2"}:
            nodes = ctx.world_size // ctx.local_world_size
            return init_device_mesh(device_type, (nodes, ctx.local_world_size),
                                    mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(device_type, (ctx.world_size,))

    def _units(self, model: torch.nn.Module, config: dict) -> list[torch.nn.Module]:
        """The submodules sharded as their own units (auto_wrap), innermost first."""
        names = set(config.get("transformer_layer_cls_to_wrap") or [])
        if not names:  # transformers models name their layers
            names = set(getattr(model, "_no_split_modules", None) or [])
        min_params = config.get("min_num_params")
        units = []
        for module in reversed(list(model.modules())):  # children before parents
            if module is model:
                continue
            if type(module).__name__ in names or (
                    min_params and not names and sum(p.numel() for p in module.parameters()) >= min_params):
                units.append(module)
        return units

    def build_model(self, factory, fresh: bool = True) -> torch.nn.Module:
        """``model_init`` on several ranks builds no rank's whole model where it can be avoided.

        - Each rank initialises its own shard (the default for a fresh run): every rank builds the model on
          the meta device (no storage), ``setup_model`` shards it, allocates each rank's shard and runs the
          model's own initialisation on the shards -- transformers' ``initialize_weights`` (``_init_weights``,
          which transformers itself relies on for every weight a checkpoint lacks), the root module's own
          ``reset_parameters()``, or else each module's own ``reset_parameters()`` where every parameter and
          buffer has one. A rank holds its shard, never the model.
        - A ``from_pretrained`` inside ``model_init``: every rank builds the skeleton under
          ``meta_model.weightless_loading``, which records the file and key of each weight transformers
          set, and each rank reads its own shards' bytes from the safetensors files (``file_shards``) --
          where every parameter comes from the files as it is or is a LoRA adapter PEFT initialises without
          the base weights (buffers the model computes, such as rotary tables, from the model's own
          initialisation).
        - Else rank 0 builds the real model and broadcasts it into every rank's shard, the other ranks
          building a weightless skeleton (accelerate's ``cpu_ram_efficient_loading``): a ``from_pretrained``
          whose weights the files do not give as they are (a new head added in ``model_init``, DoRA or
          adapters made from the base weights, fused or converted weights), a model neither way can
          initialise, a resumed
          run (its weights come from the checkpoint), or ``fsdp_config["cpu_ram_efficient_loading"]`` (the
          initial weights exactly those of one process's ``model_init()``, at the cost of one whole model on
          rank 0's CPU). The skeleton comes from ``model_init`` itself under
          ``meta_model.weightless_loading``, where ``from_pretrained`` builds on meta and reads no tensor;
          a ``model_init`` that fails even so is built for real on that rank, with a warning.
        - Not with ``offload`` (its shards live on the CPU while buffers go to the device) or one worker:
          every rank builds the model then."""
        if self.ctx.world_size == 1 or "offload" in self.args.fsdp:
            return factory()
        model = None
        if fresh and not as_flag((self.args.fsdp_config or {}).get("cpu_ram_efficient_loading")):
            from raytrainer.meta_model import build_on_meta, is_skeleton

            model = build_on_meta(factory)
            initialise = None
            if model is None:  # it refuses the meta device (from_pretrained): each rank reads the files?
                model, initialise = _from_files(factory)
                mine = "shards" if initialise is not None else "rank0"
            elif not is_skeleton(model):  # model_init chose its own device: built for real, not again
                mine = "real"
            else:
                initialise = _initialiser(model)
                mine = "shards" if initialise is not None else "rank0"
            not_shards, not_real = self.ctx.any_flags([mine != "shards", mine != "real"])
            if not not_shards:
                self._init_shards = factory, initialise  # factory: for the rank-0 way, should it fail
                return model
            if not not_real:
                return model  # whole on every rank: sharded in setup_model as with one builder
            del model
        self._from_rank0 = True
        return factory() if self.ctx.is_world_zero else _skeleton(factory, self.ctx.rank)

    def setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        from raytrainer.strategies.malloc import return_freed_memory

        return_freed_memory()  # a step's gathered units and gradients go back to the OS when freed

        options = set(self.args.fsdp)
        config = self.args.fsdp_config or {}
        mesh = self._mesh(options)
        kwargs = {"mesh": mesh,
                  "reshard_after_forward": not options & {"shard_grad_op", "hybrid_shard_zero2"}}
        # rank 0's full weights, kept (the same tensors) until broadcast into every rank's shard
        full = ({n: p.detach() for n, p in model.named_parameters()}
                if self._from_rank0 and self.ctx.is_world_zero else None)
        if self.parallelism is not None and self.parallelism.tp_enabled:
            from raytrainer.parallelism import apply_tensor_parallel, check_plan

            check_plan(self.parallelism, model)
            apply_tensor_parallel(model, self.device_mesh)
        if "offload" in options:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        elif not self._from_rank0 and not self._init_shards:
            model = model.to(self.ctx.device)
        # rank 0's full model stays where model_init built it (the CPU): fully_shard moves each unit's
        # tensors to the device as it shards them, so the device never holds more than one unit whole
        wrap = wraps(config) or self.parallelism is not None
        units = self._units(model, config) if wrap else []
        if config.get("activation_checkpointing"):
            _checkpoint_activations(model, units or self._units(model, config))
        if mesh is not None:
            for unit in units:
                fully_shard(unit, **kwargs)
            fully_shard(model, **kwargs)
        if self._init_shards:
            if self._initialise_shards(model):
                return model
            (factory, _), self._init_shards = self._init_shards, None  # every rank goes the rank-0 way
            del model, units
            return self.setup_model(self.build_model(factory, fresh=False))
        if self._from_rank0:
            self._fill_from_rank0(model, full)
        return model

    def _initialise_shards(self, model: torch.nn.Module) -> bool:
        """Allocate this rank's shards of the meta-built ``model`` and initialise them (``fill_shards``);
        False (on every rank) where that failed on any rank."""
        error = None
        try:
            fill_shards(model, self._init_shards[1], self.ctx.rank, self.ctx.device)
        except Exception as exc:  # any failure means: the rank-0 way
            error = exc
        if self.ctx.any_flags([error is not None])[0]:
            logger.warning(
                "FSDP: initialising each rank's shard of %s failed (%s); rank 0 builds the model and "
                "broadcasts it instead", type(model).__name__, error or "on another rank")
            return False
        tp_group = None
        if self.parallelism is not None and self.parallelism.tp_enabled:
            tp_group = self.device_mesh.get_group("tp")
        agree_on_replicas(model, tp_group)
        return True

    def _fill_from_rank0(self, model: torch.nn.Module, full: dict | None) -> None:
        """Allocate the meta ranks' shards, then fill every rank's shard from rank 0's full weights one
        tensor at a time: a rank holds its shard plus one full tensor in flight, never the model. Buffers
        (non-persistent ones too: rotary tables, say) and the RNG follow rank 0's."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        if not self.ctx.is_world_zero:
            model.to_empty(device=self.ctx.device)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if full is not None:
                    value = full.pop(name).to(self.ctx.device)
                else:
                    value = torch.empty(param.shape, dtype=param.dtype, device=self.ctx.device)
                dist.broadcast(value, src=0)
                if isinstance(param, DTensor):  # this rank's slice, cut locally (no further collective)
                    param.to_local().copy_(_local_part(value, param))
                else:
                    param.copy_(value)
                del value
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)
        # meta ranks drew no random numbers in model_init: all ranks go on from rank 0's generator state
        state = torch.get_rng_state() if self.ctx.is_world_zero else None
        torch.set_rng_state(self.ctx.broadcast_object(state))

    def eval_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # sharded parameters are gathered in forward: every rank must run it

    def no_sync(self, model: torch.nn.Module, sync: bool):
        from torch.distributed.fsdp import FSDPModule

        if sync or not isinstance(model, FSDPModule):  # tensor parallelism alone: no gradient sync to skip
            return contextlib.nullcontext()
        return _gradient_sync_off(model)

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor | None:
        """torch's clipping, over the gradients of every mesh: with tensor parallelism a layer's parameters
        are DTensors over (dp_shard, tp) and a norm's over dp_shard alone, and torch's one-call norm cannot
        stack norms of different meshes. Each mesh's total norm is reduced on it, then all are combined."""
        from torch.distributed.tensor import DTensor

        params = self._parameters(model)
        groups: dict = {}
        for p in params:
            if p.grad is not None:
                mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
                groups.setdefault(mesh, []).append(p)
        if len(groups) <= 1:
            return super().clip_grad_norm(model, max_norm)
        _quiet_redistribute_warning()
        norms = []
        for group in groups.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p in group])
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = torch.linalg.vector_norm(torch.stack(norms))
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        return total

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Consolidated CPU weights (a collective). A PEFT model's are the entries PEFT saves, gathered alone
        (its adapters, a few MB): the frozen base, the size of the model, is never gathered."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from raytrainer.saving import peft_state_gathered

        adapter = peft_state_gathered(self.unwrap(model))
        return adapter if adapter is not None else get_model_state_dict(model, options=_full_options())

    def save_final_weights(self, model: torch.nn.Module, folder: str) -> None:
        """Each rank writes its own shard of the weights (DCP); nothing is gathered."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=folder)

    def optimizer_state_dict(self, model, optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = get_optimizer_state_dict(model, optimizer, options=_full_options())
        return {"fsdp_full_optimizer_state": state}

    def load_optimizer_state_dict(self, model, optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if "fsdp_full_optimizer_state" not in state:
            raise ValueError(
                "this checkpoint's optimizer state was not saved by the FSDP strategy: resume it with the "
                "strategy that saved it (model weights alone load under any strategy).")
        set_optimizer_state_dict(model, optimizer, state["fsdp_full_optimizer_state"],
                                 options=StateDictOptions(full_state_dict=True))


def _local_part(value: torch.Tensor, param) -> torch.Tensor:
    """This rank's part of the whole tensor ``value`` for the DTensor ``param`` (any mesh and placements,
    the strided shards of FSDP over tensor parallelism included), cut locally."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return value[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def _quiet_redistribute_warning() -> None:
    """A norm over a 2-D mesh is reduced one dimension after the other, and DTensor warns at every step that
    one flattened collective would be faster -- for a scalar, which costs nothing either way."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


@contextlib.contextmanager
def _gradient_sync_off(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


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


def _from_files(factory):
    """``factory()`` as a skeleton on every rank, with how to fill its shards from the pretrained files it
    loads; (None, None) where it cannot be built so or the files do not give its weights."""
    from raytrainer.meta_model import weightless_loading

    sources: dict = {}
    try:
        with weightless_loading(sources):
            model = factory()
    except Exception as exc:  # any failure only means: the rank-0 way
        logger.debug("FSDP: model_init cannot build a weightless copy (%s: %s)", type(exc).__name__, exc)
        return None, None
    initialise = initialiser_from_files(model, sources)
    return (model, initialise) if initialise is not None else (None, None)


def initialiser_from_files(model: torch.nn.Module, sources: dict):
    """What fills ``model``'s shards from the files ``weightless_loading(sources)`` saw its weights set from
    (``file_shards.files_initialiser``), or None where the files do not give them all."""
    from raytrainer.meta_model import sources_by_name
    from raytrainer.strategies.file_shards import files_initialiser

    files = sources_by_name(model, sources)
    return files_initialiser(model, files, _initialiser(model)) if files else None


def _skeleton(factory, rank: int) -> torch.nn.Module:
    """``factory()`` without weights, for a rank that receives rank 0's: transformers' ``from_pretrained``
    inside builds on the meta device instead of refusing it (``meta_model.weightless_loading``). Where even
    that fails (a loader of another library that insists on real tensors), the rank builds the model for
    real -- once, replaced by rank 0's weights in ``setup_model`` -- rather than fail the run."""
    from raytrainer.meta_model import weightless_loading

    try:
        with weightless_loading():
            return factory()
    except Exception as exc:  # any failure only means: build it for real on this rank
        logger.warning("FSDP: model_init could not build a weightless copy on rank %d (%s: %s); that rank "
                       "builds the whole model once, then takes rank 0's weights", rank, type(exc).__name__,
                       exc)
    return factory()


def _initialiser(model: torch.nn.Module):
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


def _each_module_resets(model: torch.nn.Module):
    """torch's convention, as torchtitan and Lightning Fabric use it: each module that holds parameters or
    buffers initialises them with its own ``reset_parameters()`` (``nn.Linear``, ``nn.Embedding``,
    ``nn.LayerNorm``, a user's module that defines one). The initialiser runs them all, in module order;
    None (rank 0's build, with a warning naming what) where a parameter or buffer belongs to a module
    without one: after ``to_empty`` its values would be whatever the memory held."""
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
            "builds the model and broadcasts it into each rank's shard. Give their module a "
            "reset_parameters() (or the model a root one) to initialise each shard on its rank",
            type(model).__name__, ", ".join(orphans[:5]) + (", ..." if len(orphans) > 5 else ""))
        return None
    if not resets:
        return None

    def initialise():
        for reset in resets:
            reset()
    return initialise


def _checkpoint_activations(model: torch.nn.Module, units: list[torch.nn.Module]) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    targets = {id(u) for u in units}
    apply_activation_checkpointing(model, check_fn=lambda m: id(m) in targets and m is not model)
