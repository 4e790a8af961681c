"""Worker groups that outlive the script, on a running Ray cluster: the next run of a script of the same
shape trains on the workers the last one left, without their start.

Ray ends an actor when the process that made it ends, so a group the driver starts dies with the script.
On a cluster the script only connects to (``ray_address``, ``RAY_ADDRESS``, a ``ray.init(address=...)`` of
its own; not through Ray Client, ``ray://``), the group's Ray Train run is made instead by a *keeper*: a
detached actor, named after the group's shape, that runs Ray Train's ``fit()`` in a thread, owns the
group's channel (driver/channel.py), and outlives the driver. The driver follows the run as it follows its
own (``KeptChannel``: the same command board); when its group closes -- ``Trainer.close()``, the script's
end -- the keeper keeps the group, idle, for ``keep_workers_s`` seconds (``TrainingArguments``, default
300; 0 turns it off), then closes the run and ends itself: Ray Train's controller removes the placement
group and the workers end.

The name is the shape: ``group_key`` (world size, resources, strategy's process-group needs, backend and
timeout, restarts), the user, the Python environment (interpreter, its packages folder's last change,
raytrainer's own sources' last change), the working directory and the variables that change how the
libraries run (``HF_*``, ``TORCH*``, ``OMP_*``, ...). A script whose shape differs in any of these starts
a fresh group; different users never share one. One driver holds a keeper at a time: a second script of
the same shape while the first runs starts a group of its own, as without a keeper.

A driver that dies (killed, a lost node) is noticed by the keeper (its Ray job is dead): an idle group is
kept for the next script; a group in the middle of a command is aborted and the keeper ends -- a run no
driver follows would go on writing checkpoints nobody commits.
"""

from __future__ import annotations

import getpass
import hashlib
import logging
import os
import sys
import threading
import time

import ray

logger = logging.getLogger(__name__)

NAMESPACE = "raytrainer"  # the keepers' Ray namespace (named actors are per namespace)
PREFIX = "raytrainer-keeper-"

#: the environment variables that change what a worker process does, in the shape
_SHAPING_ENV = ("HF_", "TRANSFORMERS_", "TORCH", "CUDA", "NCCL", "GLOO", "OMP_", "MKL_", "PYTHON",
                "RAYTRAINER_", "ACCELERATE_", "WANDB_", "TOKENIZERS_")


def applies(args, datasets: dict | None) -> bool:
    """Whether ``args``' group is kept beyond the script: a cluster the script connected to (not a local
    instance a raytrainer script started for itself, which ends with that script), ``keep_workers_s > 0``,
    no Ray Dataset (Ray Train gives a run its datasets when it starts)."""
    from raytrainer.driver.ray_runtime import a_scripts_own_instance

    return (float(getattr(args, "keep_workers_s", 0) or 0) > 0 and ray.is_initialized() and not datasets
            and not _through_ray_client() and not a_scripts_own_instance())


def _through_ray_client() -> bool:
    """A driver connected through Ray Client (``ray://``): not kept (the keeper's lookups and the job
    table it reads are not tested through the client's proxy)."""
    try:
        return ray.util.client.ray.is_connected()
    except Exception:
        return False


def shape(args) -> dict:
    """What a kept group is made for: a group of another shape is not taken."""
    from raytrainer.driver.resources import group_key
    from raytrainer.worker.place import driver_place

    site = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    return {
        "group": repr(group_key(args)),
        "user": getpass.getuser(),
        "python": sys.executable,
        "prefix": sys.prefix,
        "packages": [os.stat(p).st_mtime_ns for p in site],  # a package installed or removed
        "raytrainer": _sources_changed(),
        "place": driver_place(),
        "env": sorted((k, v) for k, v in os.environ.items() if k.startswith(_SHAPING_ENV)),
    }


def keeper_name(args) -> str:
    digest = hashlib.sha256(repr(sorted(shape(args).items())).encode()).hexdigest()[:16]
    return f"{PREFIX}{getpass.getuser()}-{digest}"


def _sources_changed() -> int:
    """The last change to raytrainer's own sources (an editable install edited between runs)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    latest = 0
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                latest = max(latest, os.stat(os.path.join(folder, name)).st_mtime_ns)
    return latest


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=8)
class Keeper:
    """One kept worker group: its channel, its Ray Train run (``fit()`` in a thread of this actor), and
    which driver holds it. Every method is short; ``wait`` blocks for at most its timeout."""

    def __init__(self, idle_s: float):
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._channel = None  # a RayChannel made here: this actor owns it
        self._thread: threading.Thread | None = None
        self._ended: BaseException | None = None
        self._holder: str | None = None  # the Ray job id of the driver that holds the group
        self._backend = None  # the RayBackend that runs the group (driver/ray_train.py)
        self._idle_since = time.monotonic()
        self._closing = False
        threading.Thread(target=self._watch, daemon=True, name="raytrainer-keeper-watch").start()

    def claim(self, job: str, idle_s: float) -> tuple | None:
        """The group for the driver of ``job``: ``(channel actor, next command id, warm)``; None while
        another driver holds it or it is ending."""
        with self._lock:
            if self._holder is not None or self._closing or (self._thread and not self._thread.is_alive()):
                return None
            self._holder, self._idle_s = job, idle_s
            if self._channel is None:
                from raytrainer.driver.channel import RayChannel

                self._channel = RayChannel()
            latest, _ = _command_state(self._channel)
            return self._channel.actor, latest + 1, self._thread is not None

    def run(self, backend, args, ray_folder: str, datasets: dict | None = None) -> None:
        """Start the group's Ray Train run through ``backend`` (the first driver's group); its driver
        follows it with ``wait``."""
        with self._lock:
            if self._thread is None:
                self._backend = backend
                self._thread = threading.Thread(target=self._fit, args=(args, ray_folder, datasets),
                                                daemon=True, name="raytrainer-keeper-run")
                self._thread.start()

    def claim_and_run(self, job: str, idle_s: float, backend, args, ray_folder: str) -> tuple | None:
        """``claim``, and for a group not yet running its run started at once (``start_early``)."""
        held = self.claim(job, idle_s)
        if held is not None:
            self.run(backend, args, ray_folder)
        return held

    def _fit(self, args, ray_folder: str, datasets) -> None:
        try:
            self._backend.launch(args, self._channel, ray_folder, datasets)
        except BaseException as exc:
            self._ended = exc

    def wait(self, timeout: float) -> tuple[bool, BaseException | None]:
        """Whether the run has ended (within ``timeout`` seconds), and how."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        else:
            time.sleep(timeout)
        ended = thread is not None and not thread.is_alive()
        return ended, self._ended if ended else None

    def release(self) -> None:
        """The driver's group closed: the workers wait, idle, for the next driver of this shape."""
        with self._lock:
            self._holder, self._idle_since = None, time.monotonic()

    def end(self, abort: bool = False) -> None:
        """Close the run (``abort``: abort it through its controller, in the middle of a command) -- its
        workers end, its placement group is removed -- and end this actor."""
        with self._lock:
            self._closing = True
        if self._channel is not None:
            if abort and self._thread is not None:
                self._backend.abort(self._channel)
            self._channel.close()
            if self._thread is not None:
                self._thread.join(60)
                if self._thread.is_alive():
                    self._backend.abort(self._channel)
                    self._thread.join(30)
            self._channel.kill()
        # a detached actor ends only when it is killed or exits; its children go with it. Killed through
        # Ray, as intended (an exit of the process would be "a worker died unexpectedly" on the console of
        # the job that made it)
        ray.kill(ray.get_runtime_context().current_actor)
        time.sleep(30)
        os._exit(0)

    def _watch(self) -> None:
        """Every second: an idle group past its time ends; a holder whose job died is let go (idle) or,
        in the middle of a command, the run is aborted and the keeper ends."""
        while True:
            time.sleep(1.0)
            with self._lock:  # a claim and the decision to end are one or the other
                holder, idle_for = self._holder, time.monotonic() - self._idle_since
                run_over = self._thread is not None and not self._thread.is_alive()
                ending = holder is None and (idle_for > self._idle_s or run_over)
                self._closing = self._closing or ending
            if ending:
                if not run_over:
                    logger.info("closing a kept worker group: idle for %.0fs", idle_for)
                self.end()
            if holder is not None and _job_dead(holder):
                if self._channel is not None and _command_state(self._channel)[1]:
                    logger.warning("the driver of job %s died during a command: aborting its run", holder)
                    self.end(abort=True)
                with self._lock:
                    self._holder, self._idle_since = None, time.monotonic()


def _job_dead(job: str) -> bool:
    try:
        return any(j["JobID"] == job and j["IsDead"] for j in ray._private.state.state.job_table())
    except Exception:  # GCS unreachable for a moment: ask again
        return False


def _command_state(channel) -> tuple[int, bool]:
    return ray.get(channel.actor.command_state.remote(), timeout=10)


class KeptChannel:
    """The driver's end of a kept group: the group's channel as a ``RayChannel`` (commands, events,
    results), its life through the keeper: ``close`` gives the group back to the keeper (the ranks wait for
    the next driver), ``kill`` ends it (a failed or aborted run)."""

    def __init__(self, keeper, name: str, actor, first_command: int, warm: bool, running: bool = False):
        from raytrainer.driver.channel import RayChannel

        self.keeper, self.name, self.first_command, self.warm = keeper, name, first_command, warm
        self.running = warm or running  # its Ray Train run started (by a script before, or early)
        self._channel = RayChannel.of(actor)
        self.actor = actor
        self.released = threading.Event()

    def __getattr__(self, name):  # submit, wait_results, drain, fatal, controller, ...
        return getattr(self._channel, name)

    def close(self) -> None:
        """The group is given back to the keeper, idle, for the next script of its shape."""
        if self.released.is_set() or not ray.is_initialized():
            return
        self.released.set()
        try:
            ray.get(self.keeper.release.remote(), timeout=10)
        except Exception as exc:  # the keeper is gone: so is the group
            logger.debug("release: %s", exc)

    def end(self) -> None:
        """The group ends now rather than wait for the next script (its workers hold what another group
        needs): its run closes, and the keeper ends."""
        if self.released.is_set() or not ray.is_initialized():
            return
        self.released.set()
        try:
            ray.get(self.keeper.end.remote(), timeout=120)
        except Exception as exc:  # it exits in the call: the usual answer
            logger.debug("keeper: %s", exc)

    def kill(self) -> None:
        """The group is over (a failure, an abort): its run is aborted, so Ray Train's controller removes
        the placement group, and the keeper ends with its channel and workers."""
        if self.released.is_set() or not ray.is_initialized():
            return
        try:
            ray.get(self.keeper.end.remote(abort=True), timeout=120)
        except Exception as exc:  # it exits in the call: the usual answer
            logger.debug("keeper: %s", exc)
        try:
            ray.kill(self.keeper)
        except Exception as exc:  # gone already
            logger.debug("keeper: %s", exc)

    def follow(self, backend, args, ray_folder: str, datasets: dict | None) -> None:
        """Block while the group serves this driver: until it is given back (``close``), or its run ends
        (raised as the run's error). A new group's run is started in the keeper, through ``backend``."""
        if not self.running:
            ray.get(self.keeper.run.remote(backend, _run_settings(args), kept_folder(ray_folder, self.name),
                                           datasets))
        while not self.released.is_set():
            ended, error = ray.get(self.keeper.wait.remote(1.0))
            if ended:
                if error is not None:
                    raise error
                return


#: what of the arguments the keeper's Ray Train run reads (driver/ray_train.py: the scaling, the process
#: group, restarts, the storage of its run folder)
_RUN_FIELDS = ("output_dir", "storage_path", "storage_filesystem", "num_workers", "min_workers",
               "max_workers", "use_gpu", "resources_per_worker", "placement_strategy", "ddp_backend",
               "ddp_timeout", "max_failures")


def _run_settings(args):
    """The arguments the keeper needs, as plain values: the arguments themselves would import transformers
    (and torch) into the keeper's process to unpickle them, seconds of a first run's start."""
    import types

    return types.SimpleNamespace(**{f: getattr(args, f) for f in _RUN_FIELDS}, elastic=args.elastic)


def kept_folder(ray_folder: str, name: str) -> str:
    """Ray Train's run folder of a kept group: one of its own, beside the script's (a group of this script
    of another shape may run beside it, and two live runs must not share one)."""
    return f"{ray_folder}-{name.removeprefix(PREFIX)}"


def _keeper(name: str, idle_s: float):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return Keeper.options(name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                          scheduling_strategy=here).remote(idle_s)


def _held(keeper, name: str, ref, running: bool = False) -> KeptChannel | None:
    try:
        held = ray.get(ref, timeout=60)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # it was ending as we asked
        return None
    if held is None:
        return None
    actor, first, warm = held
    return KeptChannel(keeper, name, actor, first, warm, running)


def claim(args) -> KeptChannel | None:
    """This script's shape's kept group: the one ``start_early`` claimed for it, else the one the last
    script left, else a new one (its run started by the driver's group); held for this driver. None when
    another driver holds it."""
    name = keeper_name(args)
    early = _EARLY.pop(name, None)
    if early is not None:
        kept = _held(*early, running=True)
    else:
        idle_s = float(args.keep_workers_s)
        keeper = _keeper(name, idle_s)
        kept = _held(keeper, name, keeper.claim.remote(ray.get_runtime_context().get_job_id(), idle_s))
    if kept is not None and kept.warm:
        from raytrainer.logging_utils import say

        say("taking the warm workers the last run of this script left (keep_workers_s)")
    return kept


#: keeper name -> (keeper, name, reference of its claim) of the groups the arguments started (start_early)
_EARLY: dict[str, tuple] = {}
_STARTED_EARLY: set[str] = set()  # once per shape and process: a later copy of the arguments starts none


def start_early(args, backend) -> bool:
    """Claim this shape's kept group and start its run through ``backend`` now, without waiting: the
    workers start while the script goes on preparing its model and data, and ``claim`` hands the group to
    the script's first distributed call. Whether it started one. A group never taken ends with the script
    (``_end_unclaimed``): a run the driver's checks refuse leaves nothing behind."""
    name = keeper_name(args)
    if name in _STARTED_EARLY:
        return False
    _STARTED_EARLY.add(name)
    from raytrainer.storage import ray_run_folder

    idle_s = float(args.keep_workers_s)
    keeper = _keeper(name, idle_s)
    folder = kept_folder(ray_run_folder(args).rstrip("/"), name)
    ref = keeper.claim_and_run.remote(ray.get_runtime_context().get_job_id(), idle_s, backend,
                                      _run_settings(args), folder)
    _EARLY[name] = (keeper, name, ref)
    import atexit

    atexit.unregister(_end_unclaimed)
    atexit.register(_end_unclaimed)  # after Ray's own exit handler was registered: runs before it
    return True


def _end_unclaimed() -> None:
    """At exit: the groups started early that no call took end (the script stopped before training)."""
    while _EARLY:
        _, early = _EARLY.popitem()
        kept = _held(*early, running=True)
        if kept is not None:
            kept.kill()


def kept_groups() -> list[dict]:
    """The keepers on the cluster (every user's): ``{"name", "namespace"}`` each."""
    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and a["name"].startswith(PREFIX)]


def end_idle(exclude: str | None = None) -> int:
    """End this user's idle kept groups (other than ``exclude``): their workers hold what a group of
    another shape needs. Returns how many were asked to end."""
    mine = f"{PREFIX}{getpass.getuser()}-"
    count = 0
    for entry in kept_groups():
        if not entry["name"].startswith(mine) or entry["name"] == exclude:
            continue
        try:
            keeper = ray.get_actor(entry["name"], namespace=NAMESPACE)
            if ray.get(keeper.claim.remote("", 0.0), timeout=10) is not None:  # idle: held now, ended
                keeper.end.remote()
                count += 1
        except Exception as exc:  # ended meanwhile
            logger.debug("%s: %s", entry["name"], exc)
    return count
