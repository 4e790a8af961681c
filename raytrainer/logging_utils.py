"""raytrainer's library logger and the driver-side sink for records forwarded by workers.

The ``raytrainer`` logger has its own stderr handler and does not propagate (as libraries in the HF
ecosystem do), so it prints even when the application configured no logging. Records that workers
forward arrive already filtered by their rank's level and already formatted; the driver prints them
through the ``raytrainer.workers`` logger, whose handler a user may replace.
"""

from __future__ import annotations

import logging
import sys

WORKER_FORMAT = "[rank%(rank)s] %(levelname)s %(name)s: %(message)s"
_library = logging.getLogger("raytrainer")
_workers = logging.getLogger("raytrainer.workers")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (it may be redirected later)."""

    def __init__(self):
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


def _stderr_handler(fmt: str) -> logging.Handler:
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(fmt))
    return handler


if not _library.handlers:
    _library.addHandler(_stderr_handler("%(levelname)s %(name)s: %(message)s"))
    _library.propagate = False
if not _workers.handlers:
    _workers.addHandler(_stderr_handler("%(message)s"))
    _workers.propagate = False
    _workers.setLevel(logging.DEBUG)


def say(message: str) -> None:
    """One line of raytrainer's own status on the driver's console (``raytrainer: ...`` on stderr): shown at
    the default level, and not when the ``raytrainer`` logger is set above WARNING."""
    if _library.isEnabledFor(logging.WARNING):
        from tqdm.auto import tqdm

        tqdm.write(f"raytrainer: {message}", file=sys.stderr)  # above a progress bar, which stays whole


def emit_worker_record(line) -> None:
    """Print one record a worker forwarded (a ``protocol.LogLine``; its level was checked on the worker)."""
    record = logging.makeLogRecord(
        {"name": "raytrainer.workers", "levelno": line.levelno,
         "levelname": logging.getLevelName(line.levelno), "msg": line.text}
    )
    _workers.handle(record)
