"""An in-process worker-group backend for the driver's logic: no Ray, no workers.

``FakeBackend(script)`` stands where driver/ray_train.py's ``RayBackend`` stands (``WorkerGroup(args,
backend=...)``). Its "run" is a thread of this process that takes each command from a ``FakeChannel`` and
answers it by replaying the worker messages ``script[method]`` lists (raytrainer.protocol's classes: the
events a 2-rank group sends, then each rank's result) -- or by failing as a group does. Everything the
driver does with those messages is the real code: the pump, the display callbacks, the checkpoint
registry, failure classification, result absorption, the group's life.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from raytrainer import failures
from raytrainer.protocol import Command, Event, Fatal, Kind, Method, RankResult, Spec


@dataclass
class WaitForDecision:
    """A scripted step: rank 0 waits for the driver's decision on evaluation ``index`` (worker/stop.py)."""

    attempt: int = 0
    index: int = 1


@dataclass
class Fail:
    """A scripted ending: rank ``rank`` records ``error`` as deterministic (if ``fatal``), then the run ends
    with it, as a Ray Train run whose worker raised."""

    error: BaseException
    rank: int = 0
    fatal: bool = True


@dataclass
class Reply:
    """What the ranks send for one command: ``steps`` (Events, WaitForDecision) in order, then ``results``
    (rank -> RankResult), or ``fail``."""

    steps: list = field(default_factory=list)
    results: dict = field(default_factory=dict)
    fail: Fail | None = None


class FakeChannel:
    """The driver's channel API (driver/channel.py's ``RayChannel``) and the ranks' side of it, in-process."""

    def __init__(self):
        self._cond = threading.Condition()
        self.events: list[Event] = []
        self.command: Command | None = None
        self.results: dict[int, RankResult] = {}
        self.expected = 0
        self.closing = False
        self.fatal_failure: Fatal | None = None
        self.decisions: dict[tuple[int, int], bool] = {}
        self.stop = False
        self.killed = False

    # -- the driver's side ------------------------------------------------------------------------
    def submit(self, command_id: int, method: Method, spec: Spec, expected: int) -> int:
        with self._cond:
            self.command = Command(command_id, method, [spec])
            self.expected, self.results = expected, {}
            self.decisions, self.stop = {}, False
            self._cond.notify_all()
        return 0

    def wait_results(self, command_id: int, timeout: float):
        with self._cond:
            def done():
                return (self.command is not None and self.command.id == command_id
                        and len(self.results) >= self.expected)

            return dict(self.results) if self._cond.wait_for(done, timeout) else None

    def drain(self) -> list[Event]:
        with self._cond:
            events, self.events = self.events, []
            return events

    def request_stop(self) -> None:
        self.stop = True

    def decide_evaluation(self, attempt: int, index: int, stop: bool) -> None:
        with self._cond:
            self.decisions[(attempt, index)] = stop
            self.stop = self.stop or stop
            self._cond.notify_all()

    def fatal(self) -> Fatal | None:
        return self.fatal_failure

    def controller(self):
        return None

    def close(self) -> None:
        with self._cond:
            self.closing = True
            self._cond.notify_all()

    def kill(self) -> None:
        self.killed = True

    # -- the ranks' side ----------------------------------------------------------------------------
    def next_command(self, after: int) -> Command | None:
        with self._cond:
            self._cond.wait_for(lambda: self.closing or (self.command is not None
                                                         and self.command.id > after))
            return None if self.closing else self.command

    def put(self, event: Event) -> None:
        with self._cond:
            self.events.append(event)

    def wait_decision(self, attempt: int, index: int, timeout: float = 30.0) -> bool:
        with self._cond:
            if not self._cond.wait_for(lambda: (attempt, index) in self.decisions, timeout):
                raise TimeoutError(f"no decision on evaluation {index}")
            return self.decisions[(attempt, index)]

    def set_results(self, results: dict[int, RankResult]) -> None:
        with self._cond:
            self.results.update(results)
            self._cond.notify_all()


class FakeBackend:
    """Replays ``script`` (method name -> Reply, or a list of Replies taken in turn) for each command."""

    def __init__(self, script: dict):
        self.script = {k: list(v) if isinstance(v, list) else [v] for k, v in script.items()}
        self.prepared = 0  # groups started
        self.launched = 0
        self.commands: list[Command] = []
        self.decisions: list[bool] = []
        self.channels: list[FakeChannel] = []

    def prepare(self, args, datasets) -> None:
        self.prepared += 1

    def short_of_resources(self, args) -> bool:
        return False

    def channel(self) -> FakeChannel:
        self.channels.append(FakeChannel())
        return self.channels[-1]

    def launch(self, args, channel: FakeChannel, ray_folder: str, datasets) -> None:
        self.launched += 1
        done = 0
        while (command := channel.next_command(done)) is not None:
            self.commands.append(command)
            replies = self.script[command.method.value]
            reply = replies.pop(0) if len(replies) > 1 else replies[0]
            for step in reply.steps:
                if isinstance(step, WaitForDecision):
                    self.decisions.append(channel.wait_decision(step.attempt, step.index))
                else:
                    channel.put(step)
                    time.sleep(0.01)
            if reply.fail is not None:
                if reply.fail.fatal:  # as worker/entry.py records it
                    channel.fatal_failure = Fatal(reply.fail.rank, failures.pickled(reply.fail.error,
                                                                                    reply.fail.rank))
                raise reply.fail.error
            channel.set_results(reply.results)
            done = command.id

    def abort(self, channel: FakeChannel) -> None:
        channel.close()

    def failure(self, ended):
        return ended


def event(kind: Kind, payload, rank: int = 0) -> Event:
    return Event(kind, rank, payload)
