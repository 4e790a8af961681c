"""Which failures Ray Train may retry (``max_failures``), and which end the run at once.

Ray Train restarts the worker group after any worker failure until ``max_failures`` is spent; it cannot
tell a lost node from a bug. A retried bug fails again, after a worker-group start and a resume each time
-- forever with ``max_failures=-1``. raytrainer tells them apart where the exception is raised, on the
rank: a process or node loss raises nothing there (the actor is gone) or, on the ranks that survive it, an
error of the collective that lost its peer, and those are retried. Every other exception -- in the model's
forward, ``compute_loss``, ``compute_metrics``, a callback, the data, a non-finite loss
(``nonfinite_loss="error"``) -- is deterministic: the rank records it in the run's channel before it
raises. If Ray restarts the workers anyway, the new attempt sees the record and returns without training,
and the driver raises the recorded exception, with the rank, whatever ``max_failures`` says.
"""

from __future__ import annotations

import traceback

import cloudpickle

# Messages of the errors a collective raises when a peer process or its node went away.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket timeout",
              "nccl communicator was aborted", "nccl error", "timed out", "timeout")


class Terminated(RuntimeError):
    """A worker's process was sent SIGTERM (a scheduler ending the job, a VM or pod going away): every rank
    saved a checkpoint at the step they agreed on, committed it, and stopped (worker/signals.py). Retried
    per ``max_failures``, from that checkpoint."""


def retryable(exc: BaseException) -> bool:
    """True for what a process or node loss looks like from a surviving rank (and for interrupts and
    termination signals)."""
    import torch.distributed as dist

    if isinstance(exc, (KeyboardInterrupt, SystemExit, Terminated)):
        return True
    if isinstance(exc, getattr(dist, "DistError", ())):  # DistBackendError, DistNetworkError, ...
        return True
    try:
        import ray.exceptions

        if isinstance(exc, ray.exceptions.RayError):
            return True
    except ImportError:  # pragma: no cover - ray is a dependency
        pass
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, ConnectionError, OSError)) and any(m in text for m in _PEER_LOST)


def torn_down(world_size: int) -> bool:
    """True when this rank's process group is gone while it trained: Ray Train's controller, ending a group
    that lost a worker, destroys each surviving rank's process group from the actor's main thread
    (``on_shutdown``) while the rank's training thread runs. Whatever that thread raises next ("Default
    process group has not been initialized", a ValueError) is the lost worker's failure, to be retried."""
    import torch.distributed as dist

    return world_size > 1 and not dist.is_initialized()


#: The innermost frames of a worker's traceback that travel with its exception to the driver.
TRACEBACK_FRAMES = 30


def pickled(exc: BaseException, rank: int) -> bytes:
    """The exception as the driver will raise it: itself if it pickles, else a RuntimeError with its text.
    A pickled exception loses its traceback, so the worker's frames travel as a note: the driver's error
    shows where on the worker it was raised (the user's forward, loss or callback), below the message."""
    frames = "".join(traceback.format_tb(exc.__traceback__)[-TRACEBACK_FRAMES:])
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised on Ray Train worker rank {rank}; a deterministic failure: not retried)")
        if frames:
            exc.add_note(f"Traceback on worker rank {rank} (most recent call last):\n{frames.rstrip()}")
    try:
        return cloudpickle.dumps(exc)
    except Exception:
        return cloudpickle.dumps(RuntimeError(f"rank {rank}: {type(exc).__name__}: {exc}\n{frames}"))


def unpickled(data: bytes) -> BaseException:
    return cloudpickle.loads(data)
