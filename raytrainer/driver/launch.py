"""Launching a Trainer method on Ray Train worker actors and following it from the driver.

The call runs as a command on the Trainer's live worker group (driver/group.py). The run spec is the
pickled Trainer itself (made once by the preflight), so a subclass's overrides run on the workers; it is
put in the object store once per command and the command carries only its reference. While the command
runs, a pump thread drains the event channel: worker log records are printed, rank 0's callback events
are replayed into the driver's display callbacks.
"""

from __future__ import annotations

import logging
import posixpath
import threading

from raytrainer.callbacks import CallbackHandler, TrainerControl, TrainerState, runs_on_driver
from raytrainer.driver import failures
from raytrainer.driver.pace import StragglerWatch
from raytrainer.logging_utils import emit_worker_record

logger = logging.getLogger(__name__)


class _Sized:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


class DriverDisplay:
    """The driver's callbacks (progress bar, printer, transformers' trackers, any with ``on_driver = True``),
    fed by rank 0."""

    def __init__(self, trainer):
        callbacks = [cb for cb in trainer.callback_handler.callbacks if runs_on_driver(cb)]
        self.handler = CallbackHandler(callbacks, trainer.model, trainer.processing_class, None, None,
                                       flow=False)
        self.args = trainer.args
        self.state = TrainerState(is_local_process_zero=True, is_world_process_zero=True)
        self.control = TrainerControl()
        self.stragglers = StragglerWatch()
        self._done = 0
        # Callbacks that may stop training decide at each evaluation; the workers wait for the decision.
        self.steers = any(getattr(cb, "may_stop_training", False) for cb in callbacks)

    def replay(self, event: str, snapshot: dict, kwargs: dict) -> None:
        for key, value in snapshot.items():
            setattr(self.state, key, value)
        if event == "on_prediction_step":
            done, total = kwargs["done"], kwargs["total"]
            self.handler.eval_dataloader = _Sized(total) if total is not None else None
            for _ in range(max(done - self._done, 0)):
                self.handler.call_event(event, self.args, self.state, self.control)
            self._done = done
            return
        if event in ("on_evaluate", "on_predict"):
            self._done = 0
        self.handler.call_event(event, self.args, self.state, self.control, **kwargs)


class _Pump(threading.Thread):
    def __init__(self, channel, display: DriverDisplay, registry, period: float = 0.1):
        super().__init__(daemon=True, name="raytrainer-events")
        self.channel, self.display, self.registry, self.period = channel, display, registry, period
        self._stop_event = threading.Event()
        self._stop_sent = False
        self._attempt, self._evaluations = 0, 0

    def run(self) -> None:
        while not self._stop_event.wait(self.period):
            self.drain()
        # The last events too, on this thread: the driver's callbacks see a call's events from one thread
        # (a tracker's state may be thread-local: MLflow's active run is).
        self.drain()

    def drain(self) -> None:
        import ray

        try:
            events = ray.get(self.channel.drain.remote())
        except Exception as exc:  # the channel died: nothing more will arrive
            logger.debug("event channel unavailable: %s", exc)
            return
        for kind, _rank, payload in events:
            try:
                if kind == "log":
                    emit_worker_record(payload)
                elif kind == "event":
                    self.display.replay(*payload)
                elif kind == "checkpoint":
                    self.registry.add(payload)
                elif kind == "pace":
                    self.display.stragglers.observe(payload)
                elif kind == "attempt":  # a (re)started worker group numbers its evaluations from 1
                    self._attempt, self._evaluations = payload["attempt"], 0
            except Exception:
                logger.exception("while showing a worker event")
            if kind == "event" and payload[0] == "on_evaluate" and self.display.steers:
                self._evaluations += 1  # the workers wait for this decision (worker/stop.py)
                stop = bool(self.display.control.should_training_stop)
                self.channel.decide_evaluation.remote(self._attempt, self._evaluations, stop)
        if self.display.control.should_training_stop and not self._stop_sent:
            # A driver-side callback asked to stop (e.g. a pruned search trial): tell the workers.
            self._stop_sent = True
            self.channel.request_stop.remote()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


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


def _run_config(args, channel=None, folder: str | None = None):
    """Ray Train's run folder ``folder`` (``<storage root>/.raytrainer/ray`` by default: Ray's run record
    and storage marker stay out of the user's ``output_dir`` listing), given as Ray expects it: a path on
    the filesystem plus the filesystem object -- for a bucket the same S3FileSystem (endpoint, region;
    credentials stay in each node's environment) raytrainer uses. The checkpoints are outside it, so they
    are not reported to Ray: raytrainer's manifests, registry and event channel track them."""
    from ray.train import FailureConfig, RunConfig

    from raytrainer.driver.group import ray_run_folder
    from raytrainer.storage import Storage

    storage = Storage.for_run(args)
    root = (folder or ray_run_folder(args)).rstrip("/")
    return RunConfig(
        name=posixpath.basename(root),
        storage_path=posixpath.dirname(root) or "/",
        storage_filesystem=storage.fs,
        failure_config=FailureConfig(max_failures=args.max_failures),
        callbacks=[_controller_handle(channel)] if channel is not None else None,
    )


def _controller_handle(channel):
    """A Ray Train controller callback that gives the group's channel the controller's handle, so the
    driver can abort a run it follows from another thread (Ray Train's own Ctrl-C handler is installed only
    when ``fit()`` runs in the main thread)."""
    from ray.train.v2._internal.execution.callback import ControllerCallback

    class ControllerHandle(ControllerCallback):
        def __init__(self, channel):
            self.channel = channel

        def after_controller_start(self, train_run_context):
            import ray

            self.channel.set_controller.remote(ray.get_runtime_context().current_actor)

    return ControllerHandle(channel)


def _torch_trainer(args, config: dict, datasets: dict | None = None):
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytrainer.worker.entry import worker_main

    scaling = ScalingConfig(
        num_workers=args.num_workers,
        use_gpu=bool(args.use_gpu),
        resources_per_worker=args.resources_per_worker,  # a dict: TrainingArguments parsed it
        placement_strategy=args.placement_strategy,
    )
    torch_config = TorchConfig(backend=args.ddp_backend, timeout_s=args.ddp_timeout)
    run_config = _run_config(args, config["channel"], config.get("ray_run_root"))
    return TorchTrainer(worker_main, train_loop_config=config, scaling_config=scaling,
                        torch_config=torch_config, run_config=run_config, datasets=datasets)


def launch(trainer, spec: bytes, method: str, kwargs: dict, registry) -> dict:
    """Run ``method`` on the Trainer's live worker group (started now if it has none, or none that fits the
    arguments); return rank 0's payload. A Ray Data training set is given to Ray Train at the start of a
    run, so that ``train()`` runs on a group of its own, closed after it."""
    from raytrainer.driver import ray_runtime, resources
    from raytrainer.driver.group import WorkerGroup, attach
    from raytrainer.driver.ray_runtime import check_gpus_before_start, ensure_ray

    args = trainer.args
    check_gpus_before_start(args)
    ensure_ray(args)
    datasets = _ray_datasets(trainer, method)
    group = trainer.__dict__.get("_group")
    if group is not None and (datasets or not group.usable_for(args)):
        group.close()  # its workers hold the resources the next group needs
        group = None
    if group is None or not group.started:  # a search trial's lent group may not have started yet
        resources.check(args, started_here=ray_runtime.started_here())  # refuse, or wait (bounded)
    if group is None:
        if datasets:
            _check_cpus_for_ray_data(args)
        group = WorkerGroup(args)
        if not datasets:
            attach(trainer, group)
    try:
        return group.run(trainer, spec, method, kwargs, registry, datasets)
    finally:
        if datasets:
            group.close()


def _ray_datasets(trainer, method: str) -> dict | None:
    """A Ray Data training set goes to Ray Train, which gives each worker its shard."""
    from raytrainer.data import is_ray_dataset, pad_ray_dataset

    dataset = trainer.train_dataset
    if method == "train" and is_ray_dataset(dataset):  # no row left out of the equal split
        rows = trainer._ray_data_rows  # counted by the driver's pre-flight
        return {"train": pad_ray_dataset(dataset, rows, max(trainer.args.num_workers, 1))}
    return None


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
