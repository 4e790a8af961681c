"""A process's own folder for the temporary folders that importing a trainer's classes makes.

wandb, which TRL's trainer modules import when it is installed, makes two temporary folders
(``tmp...wandb-media``, ``tmp...wandb-artifacts``) as it is imported and removes them only at a normal
interpreter exit. A Ray worker ends without one (Ray Train kills its processes; a fault kills them
harder), so every TRL worker left two empty folders in its node's temporary folder, on every run. While a
trainer's classes are unpickled or looked up, ``tempfile`` makes its folders under
``<tmp>/raytrainer-imports-<pid>-<start time>`` instead. That folder goes when its process ends in order
(the worker's loop returning, the interpreter exiting), and otherwise when a later raytrainer process on the
node (a new worker, the driver closing a group, the script run again) finds its process gone. The process's
start time in the name keeps a recycled PID from protecting a dead process's folder.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile

import psutil

PREFIX = "raytrainer-imports-"

#: This process's folder, once made (one per process).
_OWN: list[str] = []


def _name(pid: int) -> str:
    return f"{PREFIX}{pid}-{int(psutil.Process(pid).create_time() * 100)}"


@contextlib.contextmanager
def imports_in_own_folder():
    """While this is entered, ``tempfile``'s folders and files go under this process's own folder."""
    if not _OWN:
        base = tempfile.gettempdir()
        reap(base)
        path = os.path.join(base, _name(os.getpid()))
        os.makedirs(path, exist_ok=True)
        _OWN.append(path)
        atexit.register(remove_own)
    saved = tempfile.tempdir
    tempfile.tempdir = _OWN[0]
    try:
        yield
    finally:
        tempfile.tempdir = saved


def remove_own() -> None:
    """Remove this process's folder: it is ending (what its imports made there is no longer needed)."""
    while _OWN:
        shutil.rmtree(_OWN.pop(), ignore_errors=True)


def reap(base: str | None = None) -> list[str]:
    """Remove the folders in ``base`` (this node's temporary folder) whose process is gone; the names
    removed."""
    base = base or tempfile.gettempdir()
    gone = []
    for name in os.listdir(base):
        if not name.startswith(PREFIX):
            continue
        try:
            alive = _name(int(name[len(PREFIX):].split("-")[0])) == name
        except ValueError:  # not one of ours
            continue
        except psutil.AccessDenied:  # another user's live process
            alive = True
        except psutil.Error:  # no such process
            alive = False
        if not alive:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            gone.append(name)
    return gone
