"""The driver <-> worker group channel: the command board (driver -> ranks), and the stream of log records,
progress and callback events, and each rank's result (ranks -> driver).

Ray Train v2 keeps only metrics reported with a checkpoint, so live output travels through this small
actor instead. Workers batch events and send them without waiting; the driver drains them a few times a
second. Results are copied into the actor's heap on arrival, so they outlive the worker that sent them.
"""

from __future__ import annotations

import asyncio
import copy

import ray


@ray.remote(num_cpus=0, max_restarts=0)
class Channel:
    """One per worker group. Besides the event stream it is the group's command board: the driver posts a
    command (a Trainer method and the reference of its spec), every rank waits for it here, and each rank's
    result is kept until the driver takes it. The per-command state (attempts, latest checkpoint, stop
    requests, evaluation decisions, results) starts afresh with each command.

    An asyncio actor: the ranks' waits for the next command are coroutines, so an idle group of 64 workers
    costs the actor 64 pending calls, not 64 polls a second; every method is short and never blocks."""

    def __init__(self):
        self._events: list = []
        self._changed = asyncio.Condition()
        self._command: tuple | None = None  # (id, method, [spec reference]) of the latest command
        self._expected = 0  # the results the latest command needs (the world size)
        self._closing = False
        self._controller = None  # Ray Train's controller actor, to abort the run (after_controller_start)
        self._reset_command_state()
        self._fatal: tuple[int, bytes] | None = None  # (rank, pickled exception) of a deterministic failure

    def _reset_command_state(self) -> None:
        self._results: dict = {}
        self._attempts = 0
        self._latest_checkpoint: str | None = None
        self._stop = False
        self._decisions: dict[tuple[int, int], bool] = {}  # (attempt, evaluation number) -> stop

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # -- the command board (driver -> ranks) --------------------------------------------------------------
    async def submit(self, command_id: int, method: str, spec: list, expected: int) -> None:
        """Post the next command. ``spec`` is a one-item list holding the spec's object reference (in a
        list, Ray hands the reference itself over instead of the bytes)."""
        self._reset_command_state()
        self._command, self._expected = (command_id, method, spec), expected
        await self._notify()

    async def close(self) -> None:
        """No more commands: each rank's loop returns, and the Ray Train run ends."""
        self._closing = True
        await self._notify()

    async def next_command(self, after: int, timeout: float) -> tuple | bool | None:
        """The command a rank should run next: the latest one, when it is newer than ``after`` and not yet
        answered by every rank (a group restarted between commands must not run the last one again).
        None: the group is closing, or an earlier attempt failed deterministically. False: nothing within
        ``timeout`` seconds (the rank asks again)."""

        def ready():
            if self._closing or self._fatal is not None:
                return True
            return (self._command is not None and self._command[0] > after
                    and len(self._results) < self._expected)

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(ready), timeout)
            except asyncio.TimeoutError:
                return False
        if self._closing or self._fatal is not None:
            return None
        return self._command

    async def wait_results(self, command_id: int, timeout: float) -> dict | None:
        """Every rank's result for ``command_id`` once all are in; None if not within ``timeout`` seconds."""

        def ready():
            return (self._command is not None and self._command[0] == command_id
                    and len(self._results) >= self._expected)

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(ready), timeout)
            except asyncio.TimeoutError:
                return None
        return self._results

    async def set_controller(self, controller) -> None:
        self._controller = controller

    async def controller(self):
        return self._controller

    # -- events and the run's bookkeeping (ranks -> driver) ---------------------------------------------
    async def put(self, events: list) -> None:
        self._events.extend(events)
        for kind, _rank, payload in events:
            if kind == "checkpoint":
                self._latest_checkpoint = payload["uri"]

    async def begin_attempt(self) -> tuple[int, str | None, bool]:
        """Called once per start of the current command (again after Ray Train restarted the workers):
        (attempt number, latest checkpoint the command committed so far, whether an earlier attempt ended in
        a deterministic failure -- then this one must not train)."""
        self._attempts += 1
        # the driver numbers evaluations per attempt from here on (a restarted run evaluates again)
        self._events.append(("attempt", 0, {"attempt": self._attempts - 1}))
        return self._attempts - 1, self._latest_checkpoint, self._fatal is not None

    async def record_fatal(self, rank: int, error: bytes) -> None:
        """A rank's deterministic failure (the first one counts): Ray may restart the workers, but
        raytrainer does not train again (driver/failures.py), and the group takes no more commands."""
        if self._fatal is None:
            self._fatal = (rank, error)
        await self._notify()

    async def fatal(self) -> tuple[int, bytes] | None:
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

    async def drain(self) -> list:
        events, self._events = self._events, []
        return events

    async def set_result(self, rank: int, command_id: int, payload) -> None:
        if self._command is not None and self._command[0] == command_id:
            self._results[rank] = copy.deepcopy(payload)
            await self._notify()

    async def results(self) -> dict:
        return self._results
