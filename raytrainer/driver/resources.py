"""Can the Ray cluster place the worker group? Decided from its nodes before the group starts.

Ray Train waits, without a word and without end, for a placement group the cluster cannot give: ``use_gpu``
on nodes without GPUs, a ``resources_per_worker`` entry no node has. Before a group starts the driver
compares one worker's bundle with each live node's total resources (wherever Ray runs: the local instance
raytrainer started, one the script started itself with ``ray.init()``, a cluster at ``ray_address``):

- the nodes can hold the workers (perhaps once other jobs release them): the group starts;
- they cannot, and nothing can add a node -- no autoscaler: a ``ValueError`` at once, naming what the
  workers need, what each node has and the fix;
- they cannot, and an autoscaler may add nodes: a warning at once with the same figures, then the driver
  waits for the nodes, and fails with that message after ``RAYTRAINER_RESOURCE_WAIT_S`` seconds (600).

"An autoscaler may add nodes": the autoscaler's cluster config in the GCS (autoscaler v2, KubeRay) lists a
node group that can grow and has every resource of the bundle; or the v1 autoscaler's status names node
types of a cluster config (a ``ray start`` head or ``ray.init()`` without one runs the read-only provider,
whose node types are ``node_<node id>``). A local instance that raytrainer started has no autoscaler.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time

logger = logging.getLogger(__name__)

WAIT_ENV = "RAYTRAINER_RESOURCE_WAIT_S"
DEFAULT_WAIT_S = 600.0
_POLL_S = 2.0
_SHOWN = ("CPU", "GPU", "memory")  # always named in the message (with the bundle's other resources)


class ResourcesUnavailableError(RuntimeError):
    """The cluster did not get the nodes the worker group needs within the bounded wait."""


def group_key(args) -> tuple:
    """What a worker group is made with: a call that needs other values needs another group."""
    from raytrainer.strategies import strategy_name

    resources = tuple(sorted((args.resources_per_worker or {}).items()))
    return (args.num_workers, args.min_workers, bool(args.use_gpu), resources, args.placement_strategy,
            args.ddp_backend, args.ddp_timeout, args.max_failures,
            strategy_name(args, args.num_workers))


def worker_bundle(args) -> dict[str, float]:
    """One worker's resources, as Ray Train asks for them (its ScalingConfig's defaults: 1 CPU, or 1 GPU
    with ``use_gpu``)."""
    from ray.train import ScalingConfig

    scaling = ScalingConfig(num_workers=args.num_workers, use_gpu=bool(args.use_gpu),
                            resources_per_worker=args.resources_per_worker)
    return {k: float(v) for k, v in scaling._resources_per_worker_not_none.items() if v}


def per_node(bundle: dict[str, float], nodes: list[dict[str, float]]) -> list[int]:
    """How many workers of ``bundle`` each node (its total resources) holds at most."""
    return [min((math.floor(n.get(k, 0.0) / v + 1e-9) for k, v in bundle.items()), default=0) for n in nodes]


def placeable(bundle: dict[str, float], nodes: list[dict[str, float]], strategy: str = "PACK") -> int:
    """How many workers of ``bundle`` the nodes (their total resources) hold at most, by ``strategy``."""
    counts = per_node(bundle, nodes)
    if strategy == "STRICT_PACK":
        return max(counts, default=0)
    if strategy == "STRICT_SPREAD":
        return sum(1 for c in counts if c > 0)
    return sum(counts)


def live_nodes() -> list[dict[str, float]]:
    import ray

    return [dict(n.get("Resources") or {}) for n in ray.nodes() if n.get("Alive")]


def shortfall_message(args, bundle: dict[str, float], nodes: list[dict[str, float]]) -> str:
    keys = list(dict.fromkeys([*bundle, *_SHOWN]))

    def show(resources: dict[str, float]) -> str:
        return ", ".join(f"{k}: {_amount(k, resources.get(k, 0.0))}" for k in keys)

    have = "; ".join(f"node {i}: {{{show(n)}}}" for i, n in enumerate(nodes)) or "no live node"
    asked = ", ".join(f"{k}: {_amount(k, v)}" for k, v in bundle.items())
    fits = placeable(bundle, nodes, args.placement_strategy)
    fix = ("set use_gpu=False or run where GPUs are (a cluster with GPU nodes: ray_address=)"
           if bundle.get("GPU") else "change resources_per_worker, or num_workers")
    workers = f"{args.min_workers} to {args.max_workers}" if args.elastic else args.num_workers
    return (f"the {workers} workers (use_gpu={bool(args.use_gpu)}, resources_per_worker="
            f"{args.resources_per_worker}, placement_strategy={args.placement_strategy!r}) each need "
            f"{{{asked}}}, and the Ray cluster's nodes hold {fits} "
            f"such workers: {have}. Add nodes that have these resources, or {fix}.")


def _amount(key: str, value: float) -> str:
    if key == "memory" or key == "object_store_memory":
        return f"{value / 2**30:.1f} GiB"
    return f"{value:g}"


def check(args, started_here: bool) -> None:
    """Before a worker group starts: refuse, or warn and wait (bounded), when the nodes cannot hold it."""
    bundle = worker_bundle(args)
    nodes = live_nodes()
    if getattr(args, "parallelism_config", None) is not None:  # a tensor-parallel group within one node
        from raytrainer.parallelism import check_fits

        check_fits(args.parallelism_config, per_node(bundle, nodes))
    if placeable(bundle, nodes, args.placement_strategy) >= args.min_workers:  # an elastic run: its min
        return
    message = shortfall_message(args, bundle, nodes)
    if started_here or not autoscaler_may_add(bundle):
        raise ValueError(f"{message} No autoscaler can add a node to this cluster, so the run would wait "
                         "forever.")
    wait_s = float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S))
    logger.warning("waiting up to %.0fs (%s) for an autoscaler to add nodes: %s", wait_s, WAIT_ENV, message)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(min(_POLL_S, max(deadline - time.monotonic(), 0.0)))
        nodes = live_nodes()
        if placeable(bundle, nodes, args.placement_strategy) >= args.min_workers:
            logger.info("the cluster has the nodes the workers need now")
            return
    raise ResourcesUnavailableError(
        f"no nodes came within {wait_s:.0f}s ({WAIT_ENV}): {shortfall_message(args, bundle, nodes)}")


def autoscaler_may_add(bundle: dict[str, float]) -> bool:
    """Whether something may add a node that holds ``bundle`` (see the module's docstring)."""
    config = _cluster_config()
    if config is not None and config.node_group_configs:
        return any((g.max_count == -1 or g.max_count > g.min_count)
                   and all(g.resources.get(k, 0) >= v for k, v in bundle.items())
                   for g in config.node_group_configs)
    status = _v1_status()
    mapping = (status.get("autoscaler_report") or {}).get("node_type_mapping") or {}
    # the read-only provider names each node's type after the node: "node_<id>" (format_readonly_node_type)
    return any(node_type != f"node_{node}" for node, node_type in mapping.items())


def _cluster_config():
    try:
        import ray._private.state

        return ray._private.state.state.get_cluster_config()
    except Exception as exc:  # an older or newer Ray without it: no answer from there
        logger.debug("no autoscaler cluster config: %s", exc)
        return None


def _v1_status() -> dict:
    try:
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get("__autoscaling_status")
        return json.loads(raw) if raw else {}
    except Exception as exc:
        logger.debug("no autoscaler status: %s", exc)
        return {}
