"""The driver's handle on a live worker group: one Ray Train run whose workers wait for commands.

The first distributed call of a Trainer starts the group (``WorkerGroup.run``): a Ray Train run in a driver
thread, whose train function is the command loop of ``raytrainer.worker.entry``. ``train``, ``evaluate``,
``predict`` and later calls are commands on it: a command is the method's name and the object-store
reference of its spec (the pickled Trainer and the arguments); each rank answers with its part. Start-up
-- Ray Train's controller, the worker processes, their imports, the process group -- is paid once per
group, not once per call.

A group ends with ``Trainer.close()`` (or the ``with`` block, the end of the interpreter, ``shutdown()``),
after a deterministic failure, or when a call needs another group (``group_key``: world size, resources,
strategy, backend). Groups are shared by the Trainers of a process (``idle_group_for``): a Trainer that is
garbage collected leaves its group idle for the next Trainer of the same shape -- a notebook's next cell, a
second Trainer in a script -- for ``IDLE_TIMEOUT_S``; and where the cluster has no room for another group, a
new Trainer takes an idle group another Trainer holds instead of closing it and starting its own. The warm
workers reset their process state between commands (worker/entry.py), so a command runs as on a new group.

Ray Train's fault tolerance is unchanged: a worker lost during a command restarts the group
(``max_failures`` counts over the group's life) and the command runs again, ``train`` resuming from the
checkpoint it last committed.

Everything Ray is the group's backend (driver/ray_train.py's ``RayBackend`` by default): a test gives the
group an in-process backend that replays recorded worker messages, and so exercises the driver's logic
(dispatch, failure handling, checkpoint registry, log routing, warm groups, results) without Ray.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import itertools
import logging
import threading
import time
import weakref

from raytrainer.driver.resources import group_key
from raytrainer.logging_utils import say
from raytrainer.protocol import Method, RankResult, Spec

logger = logging.getLogger(__name__)

_LIVE: weakref.WeakSet = weakref.WeakSet()  # the groups of this process that are running

#: How long a group no Trainer holds stays up for the next Trainer of the same shape.
IDLE_TIMEOUT_S = 600.0


class GroupFailed(Exception):
    """The group's run ended with ``error`` (a worker's own exception where there is one)."""


class WorkerGroup:
    """One live worker group: the Ray Train run, its channel, the commands sent to it."""

    _ids = itertools.count(1)

    def __init__(self, args, backend=None, ray_folder: str | None = None):
        from raytrainer.driver.ray_train import RayBackend
        from raytrainer.storage import ray_run_folder

        self.args = args  # the run's settings (its storage's filesystem serves Ray Train's run folder)
        # Ray Train's run folder, a path on that filesystem: <storage root>/.raytrainer/ray by default
        self.ray_folder = (ray_folder or ray_run_folder(args)).rstrip("/")
        self.key = group_key(args)
        self.backend = backend or RayBackend()
        self.channel = None
        self._thread: threading.Thread | None = None
        self._ended: BaseException | None = None  # how the run ended, once it has
        self._commands = itertools.count(1)
        self.started_at: float | None = None
        self.finalizer = None  # leaves the group idle when the Trainer that holds it is collected (attach)
        self.owner = None  # a weak reference to that Trainer
        self.busy = False  # running a command
        self.lent = False  # lent to a search trial (GroupPool)
        self.last_used = 0.0
        self.idle_timer: threading.Timer | None = None  # closes it after IDLE_TIMEOUT_S with no Trainer
        # the hosted trainers alive that ran on it, by recipe key: the ranks keep theirs (worker/hosted.py)
        self.hosted: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.name = f"group-{next(self._ids)}"

    # -- life -------------------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def usable_for(self, args) -> bool:
        return (not self.started or self.alive) and self.key == group_key(args)

    def start(self, datasets: dict | None = None) -> None:
        kept = self.backend.prepare(self.args, datasets)  # a kept group's channel (driver/keeper.py)
        _close_unreachable_groups()
        # Ray Train keeps a snapshot of its run in the run folder, rewritten while the run lives: two live
        # runs in one folder corrupt each other's. One whose folder another live group has (a Trainer of the
        # same output_dir, or one whose group passed to another Trainer) gets a folder of its own beside it.
        if any(other is not self and other.ray_folder == self.ray_folder for other in _LIVE):
            self.ray_folder = f"{self.ray_folder}-{self.name}"
        _make_room(self.args, self.backend, exclude=self)
        self.channel = kept if kept is not None else self.backend.channel()
        self._commands = itertools.count(getattr(self.channel, "first_command", 1))
        self.started_at = time.time()
        self._thread = threading.Thread(target=self._run, args=(self.channel, datasets), daemon=True,
                                        name=f"raytrainer-{self.name}")
        self._thread.start()
        _LIVE.add(self)
        _close_before_ray_exits()
        args, strategy = self.args, self.key[-1]
        workers = args.num_workers if args.min_workers in (None, args.num_workers) else \
            f"{args.min_workers} to {args.num_workers}"
        if not getattr(kept, "running", False):
            say(f"starting {workers} worker(s) on Ray Train ({strategy})")

    def _run(self, channel, datasets: dict | None) -> None:
        try:
            self.backend.launch(self.args, channel, self.ray_folder, datasets)
            self._ended = GroupFailed("the worker group's run ended")
        except BaseException as exc:  # kept for the driver's thread, which raises the user-facing error
            self._ended = exc

    def close(self, timeout: float = 60.0, keep: bool = True) -> None:
        """End the run: every rank's loop returns and Ray Train releases the workers and their placement
        group. Waits for a command in flight to end for ``timeout`` seconds, then aborts the run. A kept
        group (driver/keeper.py) is given back to its keeper for the next script instead, unless ``keep`` is
        False (its workers hold what another group needs)."""
        _LIVE.discard(self)
        self.stop_idle_timer()
        if self.channel is None:
            return
        channel, self.channel = self.channel, None
        channel.close() if keep else getattr(channel, "end", channel.close)()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("%s: the workers did not stop within %.0fs; aborting the run", self.name, timeout)
            self.backend.abort(channel)
            self._thread.join(timeout)
        channel.kill()
        self._ended = None  # Ray Train's error holds its controller's handle in its traceback
        from raytrainer.import_scratch import reap

        reap()  # the folders of this node's workers that a fault killed (import_scratch.py)

    def stop_idle_timer(self) -> None:
        """A Trainer holds the group again, or it closes: its idle timer (a thread) ends now."""
        timer, self.idle_timer = self.idle_timer, None
        if timer is not None:
            timer.cancel()

    # -- commands ---------------------------------------------------------------------------------------
    def run(self, trainer, spec: Spec, method: str, registry, datasets: dict | None = None) -> RankResult:
        """Run ``method`` on every rank of the group (started now if it is not yet); rank 0's result."""
        from raytrainer.driver.display import DriverDisplay, Pump

        if not self.started:
            self.start(datasets)
        command = next(self._commands)
        if _is_hosted(trainer):  # its ranks keep the trainer of each one that may call
            self.hosted[trainer._recipe.key] = trainer
            spec = dataclasses.replace(spec, keep=tuple(self.hosted))
        # the group's first command says when its workers are up, and its first step
        pump = Pump(self.channel, DriverDisplay(trainer), registry,
                    started_at=self.started_at if command == 1 else None)
        pump.start()
        started = time.time()
        self.busy = True
        try:
            size = self.channel.submit(command, Method(method), spec, self.args.num_workers)
            payload = getattr(getattr(trainer, "_recipe", None), "payload", None) or b""
            logger.debug("run spec: %d bytes, its payload %d bytes in the object store; command: %d bytes",
                         len(spec.trainer), len(payload), size)
            results = self._wait(command)
        except KeyboardInterrupt:
            logger.warning("interrupted: aborting %s on the workers", method)
            self._end_now()
            raise
        finally:
            self.busy, self.last_used = False, time.time()
            pump.stop()
        logger.debug("%s on %d workers took %.2fs", method, self.args.num_workers, time.time() - started)
        return results[0]

    def _wait(self, command: int) -> dict[int, RankResult]:
        while True:
            results = self.channel.wait_results(command, 0.5)
            if results is not None:
                return results
            if not self._thread.is_alive():
                results = self.channel.wait_results(command, 0)
                if results is not None:
                    return results
                raise self._failure()

    def _end_now(self, timeout: float = 30.0) -> None:
        """Abort the run through its controller and wait for it to end (Ctrl-C on the driver)."""
        _LIVE.discard(self)
        channel, self.channel = self.channel, None
        self.backend.abort(channel)
        self._thread.join(timeout)
        channel.kill()
        self._ended = None

    def _failure(self) -> BaseException:
        """The error to raise when the run ended during a command: the recorded deterministic failure, else
        the failing worker's own exception. The group is over; the next call starts another."""
        from raytrainer import failures

        ended, self._ended = self._ended, None
        fatal = self.channel.fatal()
        self.channel.kill()
        self.channel = None
        _LIVE.discard(self)
        if fatal:
            return failures.unpickled(fatal.error)
        return self.backend.failure(ended) or GroupFailed("the worker group's run ended during a command")


def _make_room(args, backend, exclude: WorkerGroup) -> None:
    """Idle groups of other Trainers hold their workers' resources; when the cluster lacks the CPUs or GPUs
    a new group needs, close idle ones, least recently used first, until it has them (a closed Trainer's
    next call starts a group again). Groups running a command or lent to a search trial stay."""
    idle = sorted((g for g in _LIVE if g is not exclude and g.alive and not g.busy and not g.lent),
                  key=lambda g: g.last_used)
    while idle and backend.short_of_resources(args):
        group = idle.pop(0)
        logger.info("closing the idle %s (%d workers) to make room for %d workers", group.name,
                    group.args.num_workers, args.num_workers)
        group.close(keep=False)
        for _ in range(50):  # Ray releases the placement group's resources asynchronously
            if not backend.short_of_resources(args):
                break
            time.sleep(0.1)


def _close_unreachable_groups() -> None:
    """Groups of Trainers nothing refers to any more hold workers until the garbage collector finalizes
    them; a new group may need those resources, so collect first."""
    if _LIVE:
        gc.collect()


def _close_live_groups() -> None:
    for group in list(_LIVE):
        group.close()


def _close_before_ray_exits() -> None:
    """At interpreter exit, close the live groups before Ray shuts down. Ray registers its shutdown with
    ``atexit`` when it is imported, and exit handlers run last-registered first: registered (again) now,
    after Ray's, this one runs first. Otherwise Ray would disconnect this process while a group's thread
    still waits inside Ray Train's run (a Trainer kept alive to the end, as scripts do): a race in which the
    driver can die with a segmentation fault at exit, after training succeeded."""
    atexit.unregister(_close_live_groups)
    atexit.register(_close_live_groups)


def attach(trainer, group: WorkerGroup) -> None:
    """Make ``group`` the Trainer's until its ``close()``, or until another Trainer of this process takes it
    while it is idle (``idle_group_for``). When the Trainer is garbage collected the group is left idle for
    the next one: for a hosted trainer too, whose ranks free the trainer they built for it at the group's
    next command (``WorkerGroup.hosted``)."""
    trainer.__dict__["_group"] = group
    group.owner = weakref.ref(trainer)
    group.stop_idle_timer()
    group.finalizer = weakref.finalize(trainer, _left_idle, group)
    group.finalizer.atexit = False  # at exit every live group closes (_close_before_ray_exits)


def detach(trainer) -> WorkerGroup | None:
    """Take the Trainer's group away from it, alive: closing the Trainer no longer closes it."""
    group = trainer.__dict__.pop("_group", None)
    if group is not None:
        if group.finalizer is not None:
            group.finalizer.detach()
        group.finalizer = group.owner = None
    return group


def _is_hosted(trainer) -> bool:
    return hasattr(type(trainer), "hosted_class")


def _holder(group: WorkerGroup):
    """The Trainer that holds ``group``, if it is alive."""
    return group.owner() if group.owner is not None else None


def _left_idle(group: WorkerGroup) -> None:
    """No Trainer holds ``group`` now: it waits ``IDLE_TIMEOUT_S`` for another, then closes."""
    group.finalizer = group.owner = None
    group.last_used = stamp = time.time()
    group.stop_idle_timer()  # one timer per idle group: N Trainers in turn leave one thread, not N
    timer = group.idle_timer = threading.Timer(IDLE_TIMEOUT_S, _close_if_still_idle,
                                               (weakref.ref(group), stamp))
    timer.daemon = True
    timer.name = f"raytrainer-idle-{group.name}"
    timer.start()


def _close_if_still_idle(ref, stamp: float) -> None:
    group = ref()
    if group is not None and group.owner is None and not group.busy and not group.lent \
            and group.last_used == stamp:
        logger.info("closing %s: idle for %.0fs with no Trainer", group.name, IDLE_TIMEOUT_S)
        group.close()


def idle_group_for(trainer, backend) -> WorkerGroup | None:
    """A live group of this process that is idle and has the shape ``trainer``'s arguments need (the same
    ``group_key``, the same kind of backend), taken from where it is: one no Trainer holds, most recently
    used first; else the one another Trainer used least recently -- that Trainer's next call takes an idle
    group again the same way, or starts one (a hosted trainer's ranks keep the trainer they built for it
    meanwhile, as one process would hold both: ``WorkerGroup.hosted``). ``None`` when there is none."""
    key = group_key(trainer.args)
    fits = [g for g in _LIVE if g.alive and not g.busy and not g.lent and g.key == key
            and g.backend == backend and _holder(g) is not trainer]
    free = sorted((g for g in fits if _holder(g) is None), key=lambda g: g.last_used)
    held = sorted((g for g in fits if _holder(g) is not None), key=lambda g: g.last_used)
    if not free and not held:
        return None
    group = free[-1] if free else held[0]
    if not free:
        logger.info("%s passes from one Trainer to another (warm workers of the same shape)", group.name)
        detach(_holder(group))
    group.finalizer = group.owner = None
    return group


def shutdown() -> None:
    """Close every worker group of this process now, idle ones included (Ray itself stays up). Groups
    otherwise end with their Trainer's ``close()``, after ``IDLE_TIMEOUT_S`` with no Trainer, or at exit."""
    _close_live_groups()


class GroupPool:
    """Live worker groups lent to search trials, one per trial running at a time: a trial borrows a group,
    runs its ``train`` (and ``evaluate``) on it, and gives it back for the next trial. The groups' Ray Train
    run folder is a folder of its own in the search's storage (``.raytrainer/group-<n>``: two live runs must
    not share one); raytrainer's own records do not depend on Ray's."""

    def __init__(self, search_args, label: str = ""):
        self.search_args = search_args
        self.label = label  # in the groups' run folder names: pools of other processes share the storage
        self._idle: list[WorkerGroup] = []
        self._lent: list[WorkerGroup] = []
        self._lock = threading.Lock()
        self._numbers = itertools.count()

    def lend(self, trainer) -> None:
        """Give a trial's Trainer a group that fits its arguments (one not yet started if none is idle)."""
        from raytrainer.storage import Storage

        args = trainer.args
        with self._lock:
            group = next((g for g in self._idle if g.usable_for(args)), None)
            if group is not None:
                self._idle.remove(group)
            unfit = [g for g in self._idle if not g.usable_for(args)]
            self._idle = [g for g in self._idle if g not in unfit]
        for g in unfit:  # their workers hold what the new group needs
            g.close(keep=False)
        if group is None:
            from raytrainer.driver.ray_train import RayBackend

            group = idle_group_for(trainer, RayBackend())  # a warm group of this process
        if group is None:
            # a Ray Train run folder of its own inside the search's (live runs must not share one)
            search = Storage.for_run(self.search_args)
            folder = search.state(f"group-{self.label}{next(self._numbers)}").root
            group = WorkerGroup(args, ray_folder=folder)
        with self._lock:
            self._lent.append(group)
        group.lent = True
        trainer.__dict__["_group"] = group

    def take_back(self, trainer) -> None:
        group = detach(trainer)  # launch() may have replaced the lent group (a failure, other arguments)
        if group is not None:
            group.lent = False
        with self._lock:
            self._lent = [g for g in self._lent if g.alive and g is not group]
            if group is not None and (group.alive or not group.started):
                self._idle.append(group)

    def close(self, idle: bool = True) -> None:
        """The search is over: its groups stay up, idle, for the next Trainer of this process (the final
        training run with the best hyperparameters), as a collected Trainer's do; ``idle=False``: they
        close now (a Tune trial's actor that ends)."""
        with self._lock:
            groups, self._idle, self._lent = self._idle + self._lent, [], []
        for group in groups:
            group.lent = False
            if group.alive and idle:
                _left_idle(group)
            else:
                group.close()
