"""The worker -> driver stream: log records, progress and callback events, and each rank's result.

Ray Train v2 keeps only metrics reported with a checkpoint, so live output travels through this small
actor instead. Workers batch events and send them without waiting; the driver drains them a few times a
second. Results are copied into the actor's heap on arrival, so they outlive the worker that sent them.
"""

from __future__ import annotations

import copy
import time

import ray


@ray.remote(num_cpus=0, max_restarts=0)
class Channel:
    def __init__(self):
        self._events: list = []
        self._results: dict = {}
        self._attempts = 0
        self._latest_checkpoint: str | None = None
        self._stop = False
        self._decisions: dict[tuple[int, int], bool] = {}  # (attempt, evaluation number) -> stop
        self._fatal: tuple[int, bytes] | None = None  # (rank, pickled exception) of a deterministic failure

    def put(self, events: list) -> None:
        self._events.extend(events)
        for kind, _rank, payload in events:
            if kind == "checkpoint":
                self._latest_checkpoint = payload["uri"]

    def begin_attempt(self) -> tuple[int, str | None, bool]:
        """Called once per worker-group start: (attempt number, latest checkpoint committed so far, whether
        an earlier attempt ended in a deterministic failure -- then this one must not train)."""
        self._attempts += 1
        # the driver numbers evaluations per attempt from here on (a restarted run evaluates again)
        self._events.append(("attempt", 0, {"attempt": self._attempts - 1}))
        return self._attempts - 1, self._latest_checkpoint, self._fatal is not None

    def record_fatal(self, rank: int, error: bytes) -> None:
        """A rank's deterministic failure (the first one counts): Ray may restart the workers, but
        raytrainer does not train again (driver/failures.py)."""
        if self._fatal is None:
            self._fatal = (rank, error)

    def fatal(self) -> tuple[int, bytes] | None:
        return self._fatal

    def request_stop(self) -> None:
        """The driver asks the run to stop (a driver-side callback set ``should_training_stop``)."""
        self._stop = True

    def stop_requested(self) -> bool:
        return self._stop

    def decide_evaluation(self, attempt: int, index: int, stop: bool) -> None:
        """The driver's decision after its callbacks saw evaluation number ``index`` (1-based) of worker-group
        attempt ``attempt``: a restarted group never reads the decisions its predecessor was given."""
        self._decisions[(attempt, index)] = stop
        self._stop = self._stop or stop

    def evaluation_decision(self, attempt: int, index: int) -> bool | None:
        return self._decisions.get((attempt, index))

    def drain(self) -> list:
        events, self._events = self._events, []
        return events

    def set_result(self, rank: int, payload) -> None:
        self._results[rank] = copy.deepcopy(payload)

    def results(self) -> dict:
        return self._results


class ChannelClient:
    """Worker-side sender: buffers events and flushes every ``interval`` seconds or when asked."""

    def __init__(self, handle, rank: int, interval: float = 0.2):
        self.handle = handle
        self.rank = rank
        self.interval = interval
        self._buffer: list = []
        self._last = time.monotonic()

    def send(self, kind: str, payload, urgent: bool = False) -> None:
        self._buffer.append((kind, self.rank, payload))
        if urgent or time.monotonic() - self._last >= self.interval:
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            self.handle.put.remote(self._buffer)
            self._buffer = []
        self._last = time.monotonic()

    def begin_attempt(self) -> tuple[int, str | None, bool]:
        return ray.get(self.handle.begin_attempt.remote())

    def record_fatal(self, error: bytes) -> None:
        self.flush()
        ray.get(self.handle.record_fatal.remote(self.rank, error))

    def set_result(self, payload) -> None:
        refuse_weights(payload)
        self.flush()
        ray.get(self.handle.set_result.remote(self.rank, payload))


#: The most tensor bytes a result may carry through the channel: metrics and scalars, never a model.
MAX_RESULT_TENSOR_BYTES = 1 << 20


def refuse_weights(payload) -> None:
    """The channel carries events and small results; weights go through storage (raytrainer.final_weights).
    A result holding a module or more than MAX_RESULT_TENSOR_BYTES of torch tensors is a bug: refused here,
    on the worker, before a copy of a model reaches Ray's object store and the driver."""
    import torch

    total, stack = 0, [payload]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.nn.Module):
            raise RuntimeError(f"a worker result holds a {type(item).__name__} module: weights go through "
                               "storage, never the event channel")
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    if total > MAX_RESULT_TENSOR_BYTES:
        raise RuntimeError(f"a worker result holds {total} bytes of tensors (more than "
                           f"{MAX_RESULT_TENSOR_BYTES}): weights go through storage, never the event channel")
