"""transformers' ``parallelism_config`` (accelerate's ``ParallelismConfig``) on Ray workers: one device mesh
over the worker group, with data parallelism (``dp_replicate`` x ``dp_shard``: FSDP2, HSDP with both) and
tensor parallelism (``tp``) from the model's ``tp_plan``.

The mesh is accelerate's (``ParallelismConfig.build_device_mesh``): dimensions in the order
``dp_replicate, dp_shard, cp, tp``, row-major over the world ranks. Ray Train numbers its workers node by node
(the ranks of one node are consecutive), so the innermost dimensions -- ``tp``, then ``dp_shard`` -- stay
within a node and ``dp_replicate`` spans nodes: the all-reduce of a tensor-parallel layer and FSDP's
all-gathers run over the fast links, and only the replicas' gradient all-reduce crosses nodes. Each rank
checks this once, when the mesh is built.

The ranks of one tensor-parallel group read the same batch (``RankContext.model_parallel``); the data is
sharded by the data-parallel rank only. Everything here is checked on the driver before a worker starts
(``check``), except what needs the model or the cluster (``check_plan``, ``check_fits``).
"""

from __future__ import annotations

import json
import logging
import os
import types

logger = logging.getLogger(__name__)

#: ParallelismConfig's fields a user sets (the handlers come from accelerate's defaults)
SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
KEYS = (*SIZES, "cp_backend", "sp_backend")


def _error(value, problem: str, fix: str) -> ValueError:
    return ValueError(f"parallelism_config={value!r}: {problem}. Fix: {fix}.")


def parse(value):
    """``value`` as accelerate's ``ParallelismConfig``: an instance, a dict of its sizes, or JSON (a string
    or a file's path, as ``--parallelism_config`` gives it); None for none, or for one whose sizes are all 1
    (a plain run, as accelerate reads it)."""
    if value is None or value == "":
        return None
    from accelerate.parallelism_config import ParallelismConfig

    config = value
    if isinstance(config, str):
        text = config
        if os.path.isfile(config):
            with open(config) as f:
                text = f.read()
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _error(value, f"is neither JSON nor a JSON file ({exc})",
                         'pass e.g. --parallelism_config \'{"dp_shard_size": 2, "tp_size": 2}\'') from None
    if isinstance(config, dict):
        unknown = sorted(set(config) - set(KEYS))
        if unknown:
            raise _error(value, f"has no field {unknown[0]!r}", f"use the fields {', '.join(KEYS)}")
        try:
            config = ParallelismConfig(**config)
        except (TypeError, ValueError) as exc:
            raise _error(value, str(exc), "give sizes that are whole numbers >= 1") from None
    if not isinstance(config, ParallelismConfig):
        raise _error(value, f"is a {type(value).__name__}",
                     "pass accelerate.ParallelismConfig(...), a dict of its sizes, or JSON")
    return config if config.total_size > 1 else None


def model_parallel_size(config) -> int:
    """Consecutive ranks that read the same batch: one tensor (x context) parallel group."""
    return config.tp_size * config.cp_size if config is not None else 1


def check(args) -> None:
    """On the driver, before anything starts: a mesh that the run's other arguments allow."""
    config = args.parallelism_config
    shown = {k: getattr(config, k) for k in SIZES if getattr(config, k) != 1}
    if args.num_workers == 0:
        raise _error(shown, "lays a device mesh over Ray workers, but num_workers=0",
                     f"pass --num_workers {config.total_size}")
    if getattr(args, "elastic", False):
        raise _error(shown, "needs a fixed number of workers (the mesh's product), but num_workers is a "
                     f"range ({args.min_workers}:{args.max_workers})",
                     f"pass --num_workers {config.total_size}")
    if config.total_size != args.num_workers:
        product = " x ".join(f"{k}={v}" for k, v in shown.items())
        raise _error(shown, f"spans {product} = {config.total_size} ranks, but "
                     f"num_workers={args.num_workers}",
                     f"pass --num_workers {config.total_size}, or sizes whose product is {args.num_workers}")
    if args.deepspeed:
        raise _error(shown, "lays out an FSDP2 / tensor-parallel mesh, which DeepSpeed does not run on",
                     "drop --deepspeed (parallelism_config shards with FSDP2), or drop parallelism_config")
    if config.sp_size > 1:
        raise _error(shown, "sp_size asks for DeepSpeed's Ulysses sequence parallelism, which raytrainer "
                     "does not run", "drop sp_size")
    if config.cp_size > 1 and not args.use_gpu:
        raise _error(shown, "cp_size shards each sequence with torch's ring attention, which runs on the "
                     "CUDA kernels of scaled_dot_product_attention only, and this run's workers use CPUs",
                     "drop cp_size (raytrainer does not yet run context parallelism on GPU workers either)")
    if config.cp_size > 1:
        raise _error(shown, "context parallelism is not wired into raytrainer's loop yet (its inputs must be "
                     "split along the sequence inside torch's context_parallel context at every step)",
                     "drop cp_size; shard the model with dp_shard_size and tp_size")
    if config.dp_replicate_enabled and not (config.dp_shard_enabled or config.tp_enabled):
        raise _error(shown, "dp_replicate alone is plain data parallelism",
                     "drop parallelism_config: num_workers > 1 trains with DDP already (or add dp_shard_size "
                     "for HSDP)")
    hybrid = [o for o in args.fsdp if o.startswith("hybrid_shard")]
    if hybrid:
        raise _error(shown, f"lays out the mesh itself, and --fsdp {hybrid[0]} lays out another",
                     "drop hybrid_shard from --fsdp and set dp_replicate_size to the number of nodes")
    if "no_shard" in args.fsdp:
        raise _error(shown, "shards with FSDP2 over its dp_shard dimension, and --fsdp no_shard asks for "
                     "none",
                     "drop --fsdp no_shard (or use --fsdp full_shard / shard_grad_op)")


def check_fits(config, per_node: list[int]) -> None:
    """On the driver, from the cluster's nodes (``per_node``: how many workers each holds): a tensor-parallel
    group must fit in one node, its collectives running in every layer's forward and backward."""
    group = model_parallel_size(config)
    if group > 1 and group > max(per_node, default=0):
        raise _error({k: getattr(config, k) for k in SIZES if getattr(config, k) != 1},
                     f"puts {group} consecutive ranks in one tensor-parallel group, which runs collectives "
                     f"in every layer, and no node of the cluster holds more than {max(per_node, default=0)} "
                     "workers", "lower tp_size to the workers a node holds (raise dp_shard_size instead), "
                     "or use nodes with more GPUs/CPUs")


def tp_plan(model) -> dict[str, str] | None:
    """The model's tensor-parallel plan: transformers' ``model.tp_plan`` (the config's
    ``base_model_tp_plan`` and the class's ``_tp_plan``), or a ``tp_plan`` dict set on a plain torch module;
    names may hold ``*`` for a layer number. None where it has none."""
    plan = getattr(model, "tp_plan", None)
    return dict(plan) if isinstance(plan, dict) and plan else None


def check_plan(config, model) -> None:
    """A tensor-parallel mesh needs the model's plan: refused where it has none (the driver checks a model
    it holds; each rank checks the one model_init built)."""
    if config is None or not config.tp_enabled or tp_plan(model) is not None:
        return
    raise ValueError(
        f"parallelism_config: tp_size={config.tp_size}, but {type(model).__name__} has no tensor-parallel "
        "plan (transformers' `base_model_tp_plan` in its config, or a `tp_plan` attribute). Fix: set "
        "`model.tp_plan = {'layers.*.mlp.up_proj': 'colwise', 'layers.*.mlp.down_proj': 'rowwise', ...}` in "
        "model_init (transformers' style names), or drop tp_size and shard with dp_shard_size alone.")


_meshes: dict = {}  # (sizes, device type) -> (the default group it was built over, the mesh)


def build_mesh(config, ctx):
    """The run's device mesh (a collective), with accelerate's flattened ``dp`` and ``dp_shard_cp``
    dimensions; each rank checks that its tensor-parallel group lies within one node. Built once per
    worker group and shape: every later Trainer and search trial on the same warm group reuses it (each
    build makes a process group per dimension slice, which would pile up over a search's trials)."""
    import warnings

    import torch.distributed as dist

    key = (*(getattr(config, k) for k in SIZES), ctx.device.type)
    made = _meshes.get(key)
    if made is not None and made[0] is dist.group.WORLD:
        return made[1]
    mesh = config.build_device_mesh(ctx.device.type)
    # FSDP takes its dimensions as accelerate flattened them (dp_shard_cp); torch warns at every slice of a
    # flattened dimension from the root that a later release will want the flattened mesh kept instead
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
    group = model_parallel_size(config)
    if group > 1 and ctx.distributed:
        nodes = [None] * ctx.world_size
        dist.all_gather_object(nodes, ctx.node_rank)
        split = [r for r in range(0, ctx.world_size, group) if len(set(nodes[r:r + group])) > 1]
        if split:
            raise RuntimeError(
                f"parallelism_config: the tensor-parallel group of ranks {split[0]}..{split[0] + group - 1} "
                f"spans nodes {sorted(set(nodes[split[0]:split[0] + group]))}: Ray placed "
                f"{nodes.count(nodes[0])} workers on the first node, not a multiple of tp_size x cp_size = "
                f"{group}. Use nodes whose worker counts are multiples of it (resources_per_worker, "
                "num_workers).")
    _meshes[key] = (dist.group.WORLD, mesh)
    return mesh


def apply_tensor_parallel(model, mesh) -> None:
    """Shard ``model`` in place over the ``tp`` dimension with its plan, through transformers' own
    tensor-parallel layers (``apply_tensor_parallelism``): colwise / rowwise linears, vocabulary-parallel
    embeddings, a gathered LM head."""
    from transformers.distributed.mixin import DistributedMixin
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    plan = tp_plan(model)
    # transformers' own expansion of the plan's `*` into layer numbers (a method of its models that reads
    # only named_modules / named_parameters, so a plain torch module's plan expands the same way)
    expanded = DistributedMixin._expand_parallel_plan(model, plan)
    # a tied weight (the LM head's, the embedding's) is one parameter, listed under its first name; the
    # module keeps its rule (the forward hook), and tie_weights below shares the sharded weight again
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    expanded = {name: style for name, style in expanded.items() if name in params or name in modules}
    if not expanded:
        raise ValueError(f"parallelism_config: the tensor-parallel plan of {type(model).__name__} names no "
                         f"module or parameter of it ({sorted(plan)[:3]}...). Fix: name its modules as "
                         "model.named_modules() gives them, with * for a layer number.")
    # transformers reads the model's text config and mesh manager, which only the head-wise styles use: a
    # plain torch module (colwise / rowwise layers) lends it none for the call
    lent = {name: value for name, value in (("config", types.SimpleNamespace(get_text_config=lambda: None)),
                                             ("_mesh_manager", None)) if not hasattr(model, name)}
    for name, value in lent.items():
        setattr(model, name, value)
    try:
        apply_tensor_parallelism(model, mesh["tp"], expanded)
    finally:
        for name in lent:
            delattr(model, name)
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and callable(getattr(model, "tie_weights", None)):
        model.tie_weights()  # the head shares the embedding's (now sharded) weight again
