"""Where a worker group meets Ray: the ``RayBackend`` a ``WorkerGroup`` uses by default -- Ray's start, the
cluster's resources, the group's channel actor, the Ray Train run whose train function is the workers'
command loop, aborting it, and turning Ray Train's failure into the failing worker's own exception.

A group takes any object with these methods (``WorkerGroup(args, backend=...)``): the unit tests drive the
driver's logic with an in-process backend that replays recorded worker messages (tests/unit/fake_group.py).
"""

from __future__ import annotations

import logging
import os
import posixpath

from raytrainer import failures

logger = logging.getLogger(__name__)


class RayBackend:
    """Worker groups as Ray Train runs on the Ray cluster the arguments name (or a local instance)."""

    def __eq__(self, other) -> bool:  # no state of its own: every RayBackend is the same Ray
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def prepare(self, args, datasets: dict | None):
        """Before a group starts: Ray up, and the cluster able to hold the group (refused or waited for).
        On a cluster the script connected to, the group is a kept one (driver/keeper.py): its channel is
        returned -- a warm group's, whose workers already hold what it needs, or a new one's."""
        from raytrainer.driver import keeper, ray_runtime, resources

        ray_runtime.check_gpus_before_start(args)
        ray_runtime.ensure_ray(args)
        kept = keeper.claim(args) if keeper.applies(args, datasets) else None
        if kept is not None and kept.running:  # its workers hold what it needs already
            return kept
        if not ray_runtime.a_scripts_own_instance() and self.short_of_resources(args):
            keeper.end_idle(exclude=kept.name if kept is not None else None)  # groups of other shapes
        try:
            resources.check(args, started_here=ray_runtime.started_here())  # refuse, or wait (bounded)
        except BaseException:
            if kept is not None:
                kept.kill()
            raise
        if datasets:
            _check_cpus_for_ray_data(args)
        return kept

    def short_of_resources(self, args) -> bool:
        """Whether the cluster lacks, free now, the CPUs or GPUs a group for ``args`` needs."""
        import ray

        from raytrainer.driver.ray_runtime import cpus_needed, gpus_needed

        free = ray.available_resources()
        return free.get("CPU", 0) < cpus_needed(args) or free.get("GPU", 0) < gpus_needed(args)

    def channel(self):
        from raytrainer.driver.channel import RayChannel

        return RayChannel()

    def launch(self, args, channel, ray_folder: str, datasets: dict | None) -> None:
        """Run the group as a Ray Train run in ``ray_folder`` (blocks until it ends, or for a kept group
        until this driver gives it back)."""
        from raytrainer.driver.keeper import KeptChannel

        if isinstance(channel, KeptChannel):
            return channel.follow(self, args, ray_folder, datasets)
        _forget_previous_ray_run(args, ray_folder)
        config = {"channel": channel.actor, "use_gpu": bool(args.use_gpu), "ray_run_root": ray_folder}
        try:
            _torch_trainer(args, config, datasets).fit()
        finally:
            _remove_placement_group(channel)

    def abort(self, channel) -> None:
        """Abort the Ray Train run now (as Ray Train's own Ctrl-C handler does), through its controller."""
        import ray

        try:
            controller = channel.controller()
            if controller is not None:
                ray.get(controller.abort.remote(), timeout=30)
        except Exception as exc:
            logger.debug("abort: %s", exc)

    def failure(self, ended: BaseException | None) -> BaseException | None:
        """The error to raise for a run that ended with ``ended``: the failing worker's own exception, or
        Ray's for a controller that died, with a note saying so."""
        from ray.exceptions import ActorDiedError
        from ray.train import TrainingFailedError

        if isinstance(ended, TrainingFailedError):
            return worker_error(ended)
        if isinstance(ended, ActorDiedError):
            ended.add_note("(Ray Train's controller of this run died -- killed, or out of memory: Ray's logs "
                           "say which; its workers ended with it and raytrainer removed its placement group. "
                           "The Trainer's next call starts a new worker group.)")
        return ended


def start_early(args) -> None:
    """The arguments commit the script to Ray workers (``num_workers > 0``) on a running cluster
    (``ray_address``, ``RAY_ADDRESS``) with ``keep_workers_s > 0``: connect now and start the group's kept run
    (driver/keeper.py), while the script goes on loading its model and data; the first distributed call
    takes it. Only where the cluster has the room free now (after idle kept groups of other shapes end);
    otherwise, or on any error, nothing starts here and that call starts the group and says what is
    wrong. Not on a Ray worker (a rank, a Tune trial's actor)."""
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if not (args.num_workers and float(args.keep_workers_s or 0) > 0 and address):
        return  # (before importing Ray: arguments are made everywhere)
    if "://" in address or not _answers(address):  # Ray Client, or nothing there: the call says so later
        return
    import ray

    from raytrainer.driver import keeper, ray_runtime

    if ray.is_initialized() and ray._private.worker.global_worker.mode != ray.SCRIPT_MODE:
        return
    try:
        ray_runtime.ensure_ray(args)
        if not keeper.applies(args, None):
            return
        backend = RayBackend()
        if backend.short_of_resources(args):
            keeper.end_idle(exclude=keeper.keeper_name(args))
            if backend.short_of_resources(args):
                return
        if keeper.start_early(args, backend):
            from raytrainer.driver.resources import group_key
            from raytrainer.logging_utils import say

            strategy = group_key(args)[-1]
            say(f"starting {args.num_workers} worker(s) on Ray Train ({strategy}) while the script prepares")
    except Exception as exc:  # the first distributed call starts the group, and raises what is wrong
        logger.debug("early start: %s", exc)


def _answers(address: str, timeout: float = 1.0) -> bool:
    """Whether something listens at ``address`` (``host:port``; ``auto`` is Ray's own lookup): a bad
    address costs the arguments a second, not Ray's connection timeout."""
    import socket

    host, _, port = address.rpartition(":")
    if address == "auto" or not port.isdigit():
        return address == "auto"
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError:
        return False
    return True


def _remove_placement_group(channel) -> None:
    """The run has ended: its controller removed the worker group's placement group, unless it died first
    (killed, out of memory). Then the group's CPUs and GPUs stay reserved for as long as the driver lives:
    Ray scopes a placement group to its job, not to the actor that made it. Ray Train's placement-group
    cleaner actor covers this where Ray's State API is served; the driver does it for every run."""
    from ray.util.placement_group import placement_group_table, remove_placement_group

    try:
        group = channel.placement_group()
        if group is not None and placement_group_table(group).get("state") != "REMOVED":
            logger.warning("the run's controller ended without removing its placement group: removing it")
            remove_placement_group(group)
    except Exception as exc:  # the channel or Ray is gone: so is the placement group
        logger.debug("placement group: %s", exc)


def placement_groups_of_this_job() -> set[str]:
    """The ids of the live placement groups this driver's job made (a placement group's id ends with its
    job's): those of its worker groups, and of its Tune trials and their worker groups."""
    import ray
    from ray.util.placement_group import placement_group_table

    job = ray.get_runtime_context().get_job_id()
    return {pg_id for pg_id, pg in placement_group_table().items()
            if pg_id.endswith(job) and pg["state"] != "REMOVED"}


def orphaned_placement_groups() -> set[str]:
    """The ids of this job's live placement groups whose creating actor has died: a Ray Train controller
    that died with the Tune trial actor that owned it. Ray keeps a group for as long as its job *or* its
    creator lives, so such a group holds its CPUs and GPUs until the search's driver ends; nothing of the
    run is left to remove it (Ray Train's cleaner actor runs only where a State API is served)."""
    import ray
    from ray._private.state import state
    from ray.core.generated.gcs_pb2 import PlacementGroupTableData

    job = ray.get_runtime_context().get_job_id()
    out = set()
    for raw in state._connect_and_get_accessor().get_placement_group_table():
        group = PlacementGroupTableData.FromString(raw)
        made_by_an_actor = group.creator_actor_id != b"\xff" * len(group.creator_actor_id)  # nil: the driver
        if (made_by_an_actor and group.creator_actor_dead and group.creator_job_id.hex() == job
                and group.state != PlacementGroupTableData.REMOVED):
            out.add(group.placement_group_id.hex())
    return out


def remove_placement_groups(ids: set[str]) -> None:
    """Remove the placement groups ``ids``: what the worker groups of Tune trials killed at the end of a
    search left (their controllers died with the trials' actors) where Ray Train's cleaner does not run."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    if ids:
        logger.info("removing %d placement group(s) left by worker groups of Tune trials that ended or "
                    "failed (their controllers died with the trials' actors)", len(ids))
    for pg_id in ids:
        try:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
        except Exception as exc:  # removed meanwhile (Ray Train's cleaner, where it runs)
            logger.debug("placement group %s: %s", pg_id, exc)


def _forget_previous_ray_run(args, folder: str) -> None:
    """Remove Ray Train's run snapshot left in its run folder ``folder`` by an earlier fit.

    Ray Train restores a run of the same name from that snapshot and refuses to start when a checkpoint
    it lists is gone -- and raytrainer's driver rotates checkpoints away (save_total_limit). raytrainer
    never resumes through Ray's snapshot: ``resume_from_checkpoint`` and restarts within a fit use the
    committed checkpoints themselves, so each fit starts Ray's bookkeeping afresh.
    """
    from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME

    from raytrainer.storage import Storage

    storage = Storage.for_run(args)
    path = posixpath.join(folder, CHECKPOINT_MANAGER_SNAPSHOT_FILENAME)
    if storage.exists(path):
        storage.fs.delete_file(path)


def _run_config(args, channel, folder: str):
    """Ray Train's run folder ``folder`` (``<storage root>/.raytrainer/ray`` by default: Ray's run record
    and storage marker stay out of the user's ``output_dir`` listing), given as Ray expects it: a path on
    the filesystem plus the filesystem object -- for a bucket the same S3FileSystem (endpoint, region;
    credentials stay in each node's environment) raytrainer uses. The checkpoints are outside it, so they
    are not reported to Ray: raytrainer's manifests, registry and event channel track them."""
    from ray.train import FailureConfig, RunConfig

    from raytrainer.storage import Storage

    storage = Storage.for_run(args)
    root = folder.rstrip("/")
    return RunConfig(
        name=posixpath.basename(root),
        storage_path=posixpath.dirname(root) or "/",
        storage_filesystem=storage.fs,
        failure_config=FailureConfig(max_failures=args.max_failures),
        callbacks=[_controller_handle(channel)],
    )


def _controller_handle(channel):
    """A Ray Train controller callback that gives the group's channel the controller's handle, so the
    driver can abort a run it follows from another thread (Ray Train's own Ctrl-C handler is installed only
    when ``fit()`` runs in the main thread), and the worker group's placement group, which the driver removes
    if the controller dies without removing it (``RayBackend.launch``)."""
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

    class ControllerHandle(ControllerCallback, WorkerGroupCallback):
        def __init__(self, channel):
            self.channel = channel

        def after_controller_start(self, train_run_context):
            import ray

            self.channel.set_controller.remote(ray.get_runtime_context().current_actor)

        def after_worker_group_start(self, worker_group):
            state = worker_group.get_worker_group_state()
            self.channel.set_placement_group.remote(state.placement_group_handle.placement_group)

    return ControllerHandle(channel)


def _torch_trainer(args, config: dict, datasets: dict | None = None):
    from ray.train import ScalingConfig

    from raytrainer.driver.torch_backend import ProcessGroupConfig
    from raytrainer.worker.entry import worker_main

    scaling = ScalingConfig(
        # (min, max): Ray Train starts as many as fit and restarts a group that lost a node on what is left
        num_workers=(args.min_workers, args.max_workers) if args.elastic else args.num_workers,
        use_gpu=bool(args.use_gpu),
        resources_per_worker=args.resources_per_worker,  # a dict: TrainingArguments parsed it
        placement_strategy=args.placement_strategy,
    )
    if args.elastic:  # how often Ray Train's controller looks for room to grow (its default: 60 s)
        scaling.elastic_resize_monitor_interval_s = float(os.environ.get(RESIZE_CHECK_ENV, 60.0))
    torch_config = ProcessGroupConfig(backend=args.ddp_backend, timeout_s=args.ddp_timeout)
    run_config = _run_config(args, config["channel"], config["ray_run_root"])
    trainer_class = _trainer_class(config["channel"], elastic=args.elastic)
    return trainer_class(worker_main, train_loop_config=config, scaling_config=scaling,
                         torch_config=torch_config, run_config=run_config, datasets=datasets)


#: Seconds between an elastic run's checks for room to grow
#: (``ScalingConfig.elastic_resize_monitor_interval_s``).
RESIZE_CHECK_ENV = "RAYTRAINER_ELASTIC_RESIZE_CHECK_S"


def _trainer_class(channel, elastic: bool):
    """``TorchTrainer`` as raytrainer runs it: without the helper actors that would serve nothing -- Ray
    Train's dataset manager when the run has no Ray Dataset (~200 MB a group), its placement-group cleaner
    where there is no State API, its autoscaling coordinator on the local instance raytrainer started -- and
    for an elastic run a controller that grows the group only at a checkpoint (driver/scaling_policy.py)."""
    from ray.train.torch import TorchTrainer

    from raytrainer.driver.ray_runtime import in_local_instance, serves_state_api

    class RaytrainerTorchTrainer(TorchTrainer):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            left_out = set()
            if not self.datasets:  # its DatasetManager actor starts whether or not there are datasets
                left_out.add("DatasetsCallback")
            if not serves_state_api():  # its cleaner actor polls the State API, which needs the dashboard
                left_out.add("PlacementGroupCleanerCallback")
            return [c for c in callbacks if type(c).__name__ not in left_out]

        def _initialize_and_run_controller(self, **kwargs):
            from raytrainer.driver import scaling_policy

            if elastic:
                kwargs["scaling_policy"] = scaling_policy.GrowAtCheckpoints(self.scaling_config, channel)
            elif in_local_instance():
                kwargs["scaling_policy"] = scaling_policy.FixedWithoutAutoscaler(self.scaling_config)
            return super()._initialize_and_run_controller(**kwargs)

    return RaytrainerTorchTrainer


def _check_cpus_for_ray_data(args) -> None:
    """Ray Data's read tasks need a CPU the training workers do not hold, or the run waits forever."""
    import ray

    from raytrainer.driver.ray_runtime import cpus_needed

    total, needed = ray.cluster_resources().get("CPU", 0), cpus_needed(args)
    if total - needed < 1:
        raise ValueError(
            f"train_dataset is a Ray Dataset, but the Ray cluster has {total:g} CPUs and the "
            f"{args.num_workers} workers take {needed:g}: Ray Data would have no CPU to read with. Start Ray "
            "with more CPUs (ray.init(num_cpus=...)), or leave Ray to raytrainer (it reserves 2 spare CPUs)."
        )


def worker_error(err: Exception) -> Exception:
    """The failing rank's own exception, so the user sees their error, not a wrapper. When a worker's
    process was lost, the ranks that were in a collective with it fail too ("connection closed by peer"):
    the lost rank is the one named, not the lowest rank that noticed."""
    per_rank = {rank: getattr(exc, "cause", None) or exc
                for rank, exc in (getattr(err, "worker_failures", None) or {}).items()}
    if not per_rank:
        return err

    def noticed_a_lost_peer(exc) -> bool:
        return failures.retryable(exc) and not _is_ray_error(exc)

    rank = min(per_rank, key=lambda r: (noticed_a_lost_peer(per_rank[r]), r))
    cause = per_rank[rank]
    if hasattr(cause, "add_note"):
        others = sorted(r for r in per_rank if r != rank)
        lost = " (its process or node was lost)" if _is_ray_error(cause) else ""
        cause.add_note(f"(raised on Ray Train worker rank {rank}{lost}; {len(per_rank)} of the workers failed"
                       + (f", ranks {others} after it)" if others else ")"))
    return cause


def _is_ray_error(exc) -> bool:
    import ray.exceptions

    return isinstance(exc, ray.exceptions.RayError)
