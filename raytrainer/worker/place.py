"""Where a rank runs a command: in the driver's working directory and with the driver's import path, where
its node has them (a local cluster, or nodes sharing the driver's file system).

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
def as_on_the_driver(cwd: str | None, paths: tuple = ()):
    """Run the block in ``cwd`` with ``paths`` ahead on the import path, where this node has them."""
    here, saved = os.getcwd(), list(sys.path)
    moved = cwd is not None and os.path.isdir(cwd) and cwd != here
    if moved:
        os.chdir(cwd)
    sys.path[:0] = [p for p in paths if os.path.isdir(p) and p not in sys.path]
    try:
        yield
    finally:
        sys.path[:] = saved
        if moved:
            os.chdir(here)
