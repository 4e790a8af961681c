"""Where a rank runs a command: in the driver's working directory and with the driver's import path, where
its node has them (a local cluster, or nodes sharing the driver's file system), and with the trackers'
settings of the driver's environment.

A relative path in a script -- ``from_pretrained("model")`` in ``model_init``, a data file, a reward
module beside the script -- then means on every rank what it means on the driver, as under torchrun, where
every rank starts in the script's directory. A node without that directory (``raytrainer submit`` uploads
the working directory; Ray starts each worker in its copy) keeps the worker where Ray put it.
"""

from __future__ import annotations

import contextlib
import os
import sys


def driver_place() -> tuple[str, tuple[str, ...]]:
    """This process's working directory and its import path outside the Python installation (the script's
    folder, what the script added)."""
    installed = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    paths: list[str] = []
    for entry in sys.path:
        full = os.path.realpath(entry or os.getcwd())
        if not any(full == p or full.startswith(p + os.sep) for p in installed) and full not in paths:
            paths.append(full)
    return os.getcwd(), tuple(paths)


@contextlib.contextmanager
def as_on_the_driver(cwd: str | None, paths: tuple = (), environ: tuple = ()):
    """Run the block in ``cwd`` with ``paths`` ahead on the import path, where this node has them, and with
    the driver's ``environ`` pairs (its trackers' settings, integrations.TRACKER_ENV) set."""
    here, saved, saved_env = os.getcwd(), list(sys.path), {k: os.environ.get(k) for k, _ in environ}
    moved = cwd is not None and os.path.isdir(cwd) and cwd != here
    if moved:
        os.chdir(cwd)
    sys.path[:0] = [p for p in paths if os.path.isdir(p) and p not in sys.path]
    os.environ.update(dict(environ))
    try:
        yield
    finally:
        sys.path[:] = saved
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if moved:
            os.chdir(here)
