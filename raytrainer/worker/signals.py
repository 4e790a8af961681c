"""A SIGTERM to a worker's process becomes a checkpoint at a step boundary, the same step on every rank.

Schedulers end a job by signalling its processes: Slurm's ``scancel``, a VM's shutdown, a pod's deletion
(SIGTERM first, SIGKILL after a grace period: 30 s by default in Slurm and Kubernetes). In a Ray worker the
signal meets Ray's handler (``Worker.main_loop``'s ``sigterm_handler``, on the actor's main thread), which
raises SystemExit there: the process then ends only when training ends (the interpreter joins the
training thread), and nothing is saved for the signal.

While a rank trains, raytrainer takes the first SIGTERM itself (``listening``): the preemption check
(worker/preemption.py) hears it as it hears Ray's preemption notice, every rank saves a checkpoint at the
step the ranks agree on, commits it, and stops with ``failures.Terminated``. Ray Train retries that per
``max_failures`` (the restart resumes from the checkpoint: no step is trained twice); with none left the
driver raises it, naming the checkpoint. Later SIGTERMs change nothing (a scheduler follows with SIGKILL
when its grace period ends). Outside training Ray's handler stands.

How: Ray's handler calls the module global ``ray._private.worker.raise_sys_exit_with_custom_error_message``.
A training thread cannot install a signal handler (``signal.signal`` works on the main thread only), but it
can replace that global; tests/unit/test_signals.py pins Ray's side. SIGINT is left as Ray leaves it: a Ray
worker blocks it (a Ctrl-C in the terminal of a local instance is the driver's to handle: it ends the run
through Ray Train's controller).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)

#: What Ray's SIGTERM handler says (``ray._private.worker.Worker.main_loop``).
RAY_SIGTERM_MESSAGE = "The process receives a SIGTERM."


class Listener:
    """The signals this process received while a rank trained: when the first came, and which."""

    def __init__(self):
        self.received: str | None = None
        self.at: float | None = None

    def hear(self, name: str) -> None:
        self.received, self.at = name, time.time()


_lock = threading.Lock()
_listener: Listener | None = None
_ray_exit = None  # Ray's own function, once replaced


def _on_ray_exit(message, exit_code=1, *args, **kwargs):
    """In place of Ray's exit on a signal (the main thread, in Ray's handler)."""
    listener = _listener
    if listener is not None and message == RAY_SIGTERM_MESSAGE:
        if listener.received is None:
            listener.hear("SIGTERM")
        return None  # a later one while saving for the first changes nothing (as transformers' JIT save)
    return _ray_exit(message, exit_code, *args, **kwargs)


def listen() -> Listener | None:
    """From now until ``stop_listening``, the first SIGTERM to this process is heard, not obeyed. None
    outside a Ray worker (the driver's own process with ``num_workers=0`` keeps its handlers)."""
    global _listener, _ray_exit
    try:
        import ray._private.worker as ray_worker
    except ImportError:  # pragma: no cover - ray is a dependency
        return None
    if ray_worker.global_worker.mode != ray_worker.WORKER_MODE:
        return None
    with _lock:
        if _ray_exit is None:
            _ray_exit = ray_worker.raise_sys_exit_with_custom_error_message
            ray_worker.raise_sys_exit_with_custom_error_message = _on_ray_exit
        _listener = Listener()
        return _listener


def stop_listening(listener: Listener | None, acted: bool) -> None:
    """Ray's handler again. A signal heard but not acted on (training ended first) is obeyed now: the
    process was asked to end."""
    global _listener
    with _lock:
        if listener is None or _listener is not listener:
            return
        _listener = None
    if listener.received and not acted:
        logger.warning("this worker's process received %s as training ended: it exits", listener.received)
        os.kill(os.getpid(), signal.SIGTERM)
