"""The driver <-> worker group channel: the command board (driver -> ranks), and the stream of log records,
progress and callback events, and each rank's result (ranks -> driver).

Ray Train v2 keeps only metrics reported with a checkpoint, so live output travels through this small
actor instead. Workers batch events and send them without waiting; the driver drains them a few times a
second. Each rank's result reaches the actor pickled (bytes, kept in its heap, so they outlive the worker that
sent them) and is unpickled on the driver: the actor never imports what a result holds (transformers'
``TrainOutput``, which brings torch: 400 MB more in a process that only relays).
"""

from __future__ import annotations

import asyncio
import pickle
import time

import ray

from raytrainer.elastic import GROWTH_HOLD_S
from raytrainer.protocol import Attempt, Command, Event, Fatal, Kind, Method, RankResult, Spec


@ray.remote(num_cpus=0, max_restarts=0)
class Channel:
    """One per worker group. Besides the event stream it is the group's command board: the driver posts a
    command (a Trainer method and the reference of its spec), every rank waits for it here, and each rank's
    result is kept until the driver takes it. The per-command state (attempts, latest checkpoint, stop
    requests, evaluation decisions, results) starts afresh with each command.

    An asyncio actor: the ranks' waits for the next command are coroutines, so an idle group of 64 workers
    costs the actor 64 pending calls, not 64 polls a second; every method is short and never blocks."""

    def __init__(self):
        self._events: list[Event] = []
        self._changed = asyncio.Condition()
        self._command: Command | None = None  # the latest command
        self._expected = 0  # the results the latest command needs (the world size)
        self._closing = False
        self._controller = None  # Ray Train's controller actor, to abort the run (after_controller_start)
        self._placement_group = None  # the current worker group's (after_worker_group_start)
        self._reset_command_state()
        self._fatal: Fatal | None = None  # the first deterministic failure of a rank

    def _reset_command_state(self) -> None:
        self._results: dict[int, bytes] = {}  # rank -> its RankResult, pickled
        self._attempts = 0
        self._world_size: int | None = None  # the current attempt's
        self._latest_checkpoint: str | None = None
        self._parts: dict[str, int] = {}  # a hosted trainer's checkpoints: parts in storage so far, by URI
        self._stop = False
        self._decisions: dict[tuple[int, int], bool] = {}  # (attempt, evaluation number) -> stop
        self._growth = 0  # growths an elastic run's scaling policy asked the ranks to checkpoint for
        self._growth_committed = 0  # ... and those the ranks checkpointed for, waiting for the restart
        self._committed_at = float("-inf")
        self._growth_step: int | None = None

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # -- the command board (driver -> ranks) --------------------------------------------------------------
    async def submit(self, command: Command, expected: int) -> None:
        """Post the next command; ``expected`` ranks will answer it."""
        self._reset_command_state()
        self._command, self._expected = command, expected
        await self._notify()

    async def close(self) -> None:
        """No more commands: each rank's loop returns, and the Ray Train run ends."""
        self._closing = True
        await self._notify()

    async def next_command(self, after: int, timeout: float) -> Command | bool | None:
        """The command a rank should run next: the latest one, when it is newer than ``after`` and not yet
        answered by every rank (a group restarted between commands must not run the last one again).
        None: the group is closing, or an earlier attempt failed deterministically. False: nothing within
        ``timeout`` seconds (the rank asks again)."""

        def ready():
            if self._closing or self._fatal is not None:
                return True
            return (self._command is not None and self._command.id > after
                    and len(self._results) < self._expected)

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(ready), timeout)
            except asyncio.TimeoutError:
                return False
        if self._closing or self._fatal is not None:
            return None
        return self._command

    async def command_state(self) -> tuple[int, bool]:
        """The latest command's id (0: none yet), and whether its ranks are still running it."""
        if self._command is None:
            return 0, False
        return self._command.id, len(self._results) < self._expected and self._fatal is None

    async def wait_results(self, command_id: int, timeout: float) -> dict[int, bytes] | None:
        """Every rank's result for ``command_id`` once all are in (pickled); None if not within ``timeout``
        seconds."""

        def ready():
            return (self._command is not None and self._command.id == command_id
                    and len(self._results) >= self._expected)

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(ready), timeout)
            except asyncio.TimeoutError:
                return None
        return self._results

    # -- an elastic run's growth, at a checkpoint boundary (driver/scaling_policy.py) ---------------------
    async def grow_when_ready(self) -> bool:
        """The scaling policy (in Ray Train's controller) has room for more workers: whether the group may
        be restarted bigger now -- no ``train`` in flight, or the ranks have committed a checkpoint for it
        and wait -- else the ranks are asked for that checkpoint (``growth_requested``)."""
        command = self._command
        training = (command is not None and command.method is Method.TRAIN
                    and len(self._results) < self._expected and self._fatal is None)
        if not training:
            return True
        waiting = time.monotonic() - self._committed_at < GROWTH_HOLD_S  # the ranks hold that long
        whole = (self._latest_checkpoint or "").rstrip("/").endswith(f"checkpoint-{self._growth_step}")
        if self._growth_committed >= self._growth > 0 and waiting:
            return whole  # (a hosted trainer's checkpoint is whole once its last part is in storage)
        if self._growth == self._growth_committed:  # none asked for, or the ranks went on: ask (again)
            self._growth += 1
        return False

    async def growth_requested(self) -> int:
        """How many growths the ranks were asked to checkpoint for (rank 0 polls it without waiting)."""
        return self._growth

    async def growth_committed(self, count: int, step: int) -> None:
        """Rank 0: the checkpoint for growth number ``count``, of step ``step``, is committed; the ranks
        wait."""
        self._growth_committed, self._committed_at = max(self._growth_committed, count), time.monotonic()
        self._growth_step = step

    async def set_controller(self, controller) -> None:
        self._controller = controller

    async def controller(self):
        return self._controller

    async def set_placement_group(self, group) -> None:
        self._placement_group = group

    async def placement_group(self):
        return self._placement_group

    # -- events and the run's bookkeeping (ranks -> driver) ---------------------------------------------
    async def put(self, events: list[Event]) -> None:
        self._events.extend(events)
        for event in events:
            if event.kind is Kind.CHECKPOINT:
                self._latest_checkpoint = event.payload.uri
            elif event.kind is Kind.CHECKPOINT_PART:  # whole once every part is in storage
                part = event.payload
                self._parts[part.uri] = self._parts.get(part.uri, 0) + 1
                if self._parts[part.uri] == part.parts:
                    self._latest_checkpoint = part.uri

    async def begin_attempt(self, world_size: int | None = None) -> Attempt:
        """Called by rank 0 once per start of the current command (again after Ray Train restarted the
        workers), with the group's world size."""
        self._attempts += 1
        previous, self._world_size = self._world_size, world_size
        if world_size:  # an elastic run's group may hold fewer workers than its most
            self._expected = world_size
        attempt = Attempt(self._attempts - 1, self._latest_checkpoint, self._fatal is not None, world_size,
                          previous)
        # the driver numbers evaluations per attempt from here on (a restarted run evaluates again)
        self._events.append(Event(Kind.ATTEMPT, 0, attempt))
        return attempt

    async def record_fatal(self, fatal: Fatal) -> None:
        """A rank's deterministic failure (the first one counts): Ray may restart the workers, but
        raytrainer does not train again (failures.py), and the group takes no more commands."""
        if self._fatal is None:
            self._fatal = fatal
        await self._notify()

    async def fatal(self) -> Fatal | None:
        return self._fatal

    async def request_stop(self) -> None:
        """The driver asks the run to stop (a driver-side callback set ``should_training_stop``)."""
        self._stop = True

    async def stop_requested(self) -> bool:
        return self._stop

    async def decide_evaluation(self, attempt: int, index: int, stop: bool) -> None:
        """The driver's decision after its callbacks saw evaluation number ``index`` (1-based) of worker-group
        attempt ``attempt``: a restarted group never reads the decisions its predecessor was given."""
        self._decisions[(attempt, index)] = stop
        self._stop = self._stop or stop

    async def evaluation_decision(self, attempt: int, index: int) -> bool | None:
        return self._decisions.get((attempt, index))

    async def drain(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    async def set_result(self, rank: int, command_id: int, result: bytes) -> None:
        """A rank's ``RankResult``, pickled by the rank (worker/channel_client.py)."""
        if self._command is not None and self._command.id == command_id:
            self._results[rank] = result
            await self._notify()


class RayChannel:
    """The driver's end of a group's ``Channel`` actor: each call one round trip (the pump, the command
    board, the group's end). ``actor`` is what the workers get (worker/channel_client.py)."""

    def __init__(self):
        # On the driver's node, as Ray Train places its controller: a worker node may be preempted or lost,
        # and the channel (the command board, the checkpoint registry) must outlive the group's restart.
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        self.actor = Channel.options(scheduling_strategy=here).remote()

    @classmethod
    def of(cls, actor) -> RayChannel:
        """The driver's end of a channel actor made elsewhere (a kept group's: driver/keeper.py)."""
        channel = cls.__new__(cls)
        channel.actor = actor
        return channel

    def submit(self, command_id: int, method: Method, spec: Spec, expected: int) -> int:
        """Post a command; its spec goes to the object store once (the command carries its reference).
        Returns the command's size, pickled (a few hundred bytes: the spec goes by reference)."""
        import cloudpickle

        command = Command(command_id, method, [ray.put(spec)])
        ray.get(self.actor.submit.remote(command, expected))
        return len(cloudpickle.dumps(command))

    def wait_results(self, command_id: int, timeout: float) -> dict[int, RankResult] | None:
        results = ray.get(self.actor.wait_results.remote(command_id, timeout))
        return None if results is None else {rank: pickle.loads(b) for rank, b in results.items()}

    def drain(self) -> list[Event]:
        return ray.get(self.actor.drain.remote())

    def request_stop(self) -> None:
        self.actor.request_stop.remote()

    def decide_evaluation(self, attempt: int, index: int, stop: bool) -> None:
        self.actor.decide_evaluation.remote(attempt, index, stop)

    def fatal(self) -> Fatal | None:
        return ray.get(self.actor.fatal.remote())

    def controller(self):
        return ray.get(self.actor.controller.remote(), timeout=10)

    def placement_group(self):
        return ray.get(self.actor.placement_group.remote(), timeout=10)

    def close(self) -> None:
        """No more commands (each rank's loop returns); quietly nothing when Ray or the actor is gone."""
        if not ray.is_initialized():
            return
        try:
            ray.get(self.actor.close.remote(), timeout=10)
        except Exception:  # the channel is gone: the run is ending or ended
            pass

    def kill(self) -> None:
        if ray.is_initialized():
            ray.kill(self.actor)
