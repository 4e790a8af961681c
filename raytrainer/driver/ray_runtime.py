"""Connecting to Ray: the user's cluster when an address is given, else a private local instance."""

from __future__ import annotations

import contextlib
import logging
import os

from raytrainer.logging_utils import say

logger = logging.getLogger(__name__)

# Environment of a local instance we start (inherited by its raylet and workers).
_LOCAL_ENV = {
    "RAY_AUTH_MODE": "disabled",  # never pick up a token file meant for another cluster
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",  # print() on a worker appears once on the driver
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    "RAY_DEDUP_LOGS": "0",
}

# Environment of the local instance's processes only, not of the driver after the start: a Ray cluster the
# driver's script starts later (``ray start``) inherits the driver's environment, and must not get these.
LOCAL_MARK_ENV = "RAYTRAINER_LOCAL_RAY"
_INSTANCE_ENV = {
    LOCAL_MARK_ENV: "1",  # in_local_instance(), in every process of the instance
    # Ray Train's preemption watcher (an actor per group) polls Ray for drained nodes: a local instance's
    # one node is never drained for a preemption (raytrainer acts on a notice however it comes)
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}


_STARTED_HERE = False  # this process started the local Ray instance it uses (no autoscaler behind it)
_DASHBOARD = False  # ... with Ray's dashboard

#: ``RAYTRAINER_RAY_DASHBOARD=1`` starts the local instance with Ray's dashboard and its State API (without
#: it, Ray runs a dashboard process that serves nothing but usage statistics).
DASHBOARD_ENV = "RAYTRAINER_RAY_DASHBOARD"


def cpus_needed(args) -> float:
    per_worker = (args.resources_per_worker or {}).get("CPU", 1)
    return args.num_workers * per_worker


def machine_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or a Slurm step's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def gpus_needed(args) -> float:
    return args.num_workers * (args.resources_per_worker or {}).get("GPU", 1) if args.use_gpu else 0


def serves_state_api() -> bool:
    """Whether the Ray instance runs Ray's State API: not where raytrainer started it without the dashboard
    (its processes, a Tune trial's actor, read that from the environment they inherit), nor on a cluster
    started without it (``ray start --include-dashboard=false``, or Ray without ``ray[default]``): the
    dashboard records its address in the cluster's key-value store when it serves (empty when it does not)."""
    if _STARTED_HERE:
        return _DASHBOARD
    if os.environ.get(LOCAL_MARK_ENV) == "1":
        return os.environ.get(DASHBOARD_ENV, "1") == "1"
    import ray.experimental.internal_kv as kv
    from ray._private import ray_constants

    try:
        return bool(kv._internal_kv_get("webui:url", namespace=ray_constants.KV_NAMESPACE_DASHBOARD))
    except Exception:  # not connected, or a Ray that keeps it elsewhere: Ray Train's own default stands
        return True


def in_local_instance() -> bool:
    """Whether this process (the driver, a Tune trial's actor) runs in a local instance raytrainer started:
    one machine, no autoscaler behind it."""
    return _STARTED_HERE or os.environ.get(LOCAL_MARK_ENV) == "1"


def started_here() -> bool:
    """Whether the Ray instance this process uses is the local one raytrainer started (no autoscaler)."""
    return _STARTED_HERE


def check_gpus_before_start(args) -> None:
    """``use_gpu=True`` where raytrainer is about to start a local Ray instance (no address given) on a
    machine without enough GPUs: an error now, naming the fix, before Ray starts. Once Ray is up -- whoever
    started it -- ``driver.resources.check`` decides from the cluster's nodes."""
    import ray

    needed = gpus_needed(args)
    if not needed or ray.is_initialized() or args.ray_address or os.environ.get("RAY_ADDRESS"):
        return
    import torch

    have = torch.cuda.device_count()
    if have < needed:
        raise ValueError(
            f"use_gpu=True asks for {needed:g} GPUs ({args.num_workers} workers), but this machine (where "
            f"raytrainer starts a local Ray instance without ray_address) has {have:g}. Run on a machine "
            "with GPUs, give a cluster's address (ray_address= or RAY_ADDRESS), or set use_gpu=False.")


def local_instance_cpus(args) -> tuple[int, float, int]:
    """This machine's cores, the CPUs the workers ask for, and the logical CPUs a local instance gets: the
    workers' share plus 2 spare, or Ray Data's read tasks (which need a CPU) would wait forever behind
    training workers holding every CPU of a small machine. Workers asking for more CPUs than the machine
    has are warned of: they would share the cores, every step slower."""
    cores, needed = machine_cores(), cpus_needed(args)
    if needed > cores:
        per_worker = needed / args.num_workers
        logger.warning(
            "num_workers=%d asks for %g CPUs, but this machine has %d CPU core(s): the workers would share "
            "them, each step slower than on fewer workers. Set num_workers to %d or fewer, or give a "
            "cluster's address (ray_address= or RAY_ADDRESS).", args.num_workers, needed, cores,
            max(1, int(cores // per_worker)))
    return cores, needed, max(cores, int(needed + 0.999) + 2)


def ensure_ray(args) -> None:
    """Attach to the cluster in ``ray_address`` / ``RAY_ADDRESS``, or start a local instance."""
    import ray

    if ray.is_initialized():
        return
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        # As on a local instance: Ray's own output (its controller's lines, workers' raw output, a failed
        # worker's traceback once per line) stays in the cluster's log folders; what the run says comes
        # through the channel. A script that called ray.init() itself keeps the forwarding it chose.
        context = ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        logs = os.path.join(getattr(context, "address_info", {}).get("session_dir") or "", "logs")
        say(f"connected to the Ray cluster at {address}; Ray's own output: {logs} on each node")
        return
    for key, value in _LOCAL_ENV.items():
        os.environ.setdefault(key, value)
    cores, needed, num_cpus = local_instance_cpus(args)
    global _STARTED_HERE, _DASHBOARD
    _STARTED_HERE = True
    # Without the dashboard unless asked for: its head and modules are about 1 GB of the process tree and a
    # second of a 2-core machine's start, and a local run needs nothing it serves. Ray Train's
    # placement-group cleaner, the one user of its State API here, is left out with it (driver/ray_train.py).
    # Ray's own output (its controller's progress lines, helper actors' errors, workers' stdout and stderr)
    # stays in the instance's log files: the console shows raytrainer's output, which reaches the driver
    # through the run's channel -- the workers' log records and what their Python code prints.
    _DASHBOARD = os.environ.get(DASHBOARD_ENV, "0") == "1"
    instance_env = {**_INSTANCE_ENV, DASHBOARD_ENV: "1" if _DASHBOARD else "0"}
    with _without_secrets(), _environment(instance_env):  # only the driver pushes to the Hub
        context = ray.init(address="local", num_cpus=num_cpus, include_dashboard=_DASHBOARD,
                           log_to_driver=False, logging_level=logging.WARNING, configure_logging=True)
    _mark_as_a_scripts_own()
    logs = os.path.join(getattr(context, "address_info", {}).get("session_dir") or "", "logs")
    say(f"started a local Ray instance on this machine's {cores} CPU core(s) (Ray schedules {num_cpus} CPUs: "
        f"{needed:g} for the workers, the rest spare); Ray's own output: {logs}")


_OWN_KEY = b"raytrainer:a-scripts-own-instance"


def _mark_as_a_scripts_own() -> None:
    """Say in the instance's key-value store that a script started it: it ends with that script."""
    import ray.experimental.internal_kv as kv

    kv._internal_kv_put(_OWN_KEY, b"1", namespace="raytrainer")


def a_scripts_own_instance() -> bool:
    """Whether the Ray instance this process is connected to is one a raytrainer script started for itself
    (this process or another connected to it): it ends with that script, and is sized for its workers."""
    if _STARTED_HERE:
        return True
    import ray.experimental.internal_kv as kv

    try:
        return bool(kv._internal_kv_get(_OWN_KEY, namespace="raytrainer"))
    except Exception:
        return False


_SECRETS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


@contextlib.contextmanager
def _environment(values: dict):
    """``values`` in the environment while the local instance starts (its raylet and GCS inherit them, and
    every worker the raylet starts), then the driver's own environment back. A variable the user set wins."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


@contextlib.contextmanager
def _without_secrets():
    """The local Ray instance (and so every worker it starts) inherits this process's environment: leave
    the Hub token out of it."""
    saved = {k: os.environ.pop(k) for k in _SECRETS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)
