"""The rank's side of its worker group's channel (driver/channel.py): waiting for commands, sending events
in batches, recording a deterministic failure, handing back the rank's result."""

from __future__ import annotations

import threading
import time

import cloudpickle
import ray

from raytrainer.protocol import Attempt, Command, Event, Fatal, Kind, RankResult


class ChannelClient:
    """A rank's end of the channel: buffers events and flushes every ``interval`` seconds or when asked;
    every other call is one round trip to the channel actor (raytrainer.protocol lists the messages). Events
    may be sent from several threads (a hosted trainer's checkpoint commit sends from its own)."""

    def __init__(self, handle, rank: int, interval: float = 0.2):
        self.handle = handle
        self.rank = rank
        self.interval = interval
        self._buffer: list = []
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def send(self, kind: Kind, payload, urgent: bool = False) -> None:
        with self._lock:
            self._buffer.append(Event(kind, self.rank, payload))
        if urgent or time.monotonic() - self._last >= self.interval:
            self.flush()

    def flush(self) -> None:
        with self._lock:  # submitted in order (``remote`` only queues the call)
            if self._buffer:
                self.handle.put.remote(self._buffer)
                self._buffer = []
            self._last = time.monotonic()

    def begin_attempt(self, world_size: int | None = None) -> Attempt:
        return ray.get(self.handle.begin_attempt.remote(world_size))

    def record_fatal(self, error: bytes) -> None:
        self.flush()
        ray.get(self.handle.record_fatal.remote(Fatal(self.rank, error)))

    def set_result(self, command_id: int, result: RankResult) -> None:
        refuse_weights([result.output, result.state, result.callbacks])
        self.flush()
        # pickled here: the channel actor keeps bytes, never importing what a result holds (driver/channel.py)
        ray.get(self.handle.set_result.remote(self.rank, command_id, cloudpickle.dumps(result)))

    def stop_requested(self):
        """The stop flag, asked without waiting: an object reference (``ray.wait`` / ``ray.get`` it)."""
        return self.handle.stop_requested.remote()

    def growth_requested(self):
        """How many growths the run's scaling policy asked for, without waiting: an object reference."""
        return self.handle.growth_requested.remote()

    def growth_committed(self, count: int, step: int) -> None:
        ray.get(self.handle.growth_committed.remote(count, step))

    def evaluation_decision(self, attempt: int, index: int) -> bool | None:
        return ray.get(self.handle.evaluation_decision.remote(attempt, index))

    def next_command(self, after: int, poll: float = 60.0) -> Command | None:
        """Wait for the group's next command (None: the group is closing). The wait is a pending call on the
        channel actor, renewed every ``poll`` seconds."""
        self.flush()
        while (command := ray.get(self.handle.next_command.remote(after, poll))) is False:
            pass
        return command


#: The most tensor bytes a result may carry through the channel: metrics and scalars, never a model.
MAX_RESULT_TENSOR_BYTES = 1 << 20


def tensor_bytes(payload) -> int:
    """The bytes of torch tensors in ``payload`` (through dicts, lists and tuples); a module is refused."""
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
    return total


def refuse_weights(payload) -> None:
    """The channel carries events and small results; weights go through storage (raytrainer.final_weights).
    A result holding a module or more than MAX_RESULT_TENSOR_BYTES of torch tensors is a bug: refused here,
    on the worker, before a copy of a model reaches Ray's object store and the driver."""
    total = tensor_bytes(payload)
    if total > MAX_RESULT_TENSOR_BYTES:
        raise RuntimeError(f"a worker result holds {total} bytes of tensors (more than "
                           f"{MAX_RESULT_TENSOR_BYTES}): weights go through storage, never the event channel")
