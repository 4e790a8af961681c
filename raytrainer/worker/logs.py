"""Log routing on a rank: main vs replica levels, forwarding to the driver, one log file per rank.

On each rank the root and ``raytrainer`` loggers get ``args.get_process_log_level()`` (``log_level`` on
the main process, ``log_level_replica`` elsewhere; ``log_on_each_node`` decides whether each node's local
main counts as main). transformers' library logger (which keeps its own handler and does not propagate)
is routed the same way once transformers' logging is loaded, and gets the level only where it is set
explicitly: ``passive`` leaves transformers' verbosity as it is, as transformers.Trainer does. On Ray
workers, records that pass -- and what the rank's Python code prints -- are forwarded to the driver's
console (Ray's own records only at ``debug``), and the records are written to
``<output_dir>/logs/rank-<r>.log``; in the driver's own process
(``num_workers=0``) they go to the application's handlers and ``output_dir`` holds what transformers'
would. Everything is restored when the call ends, so the in-process run leaves the application's logging
as it found it.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import sys

from raytrainer.logging_utils import WORKER_FORMAT
from raytrainer.protocol import Kind, LogLine

_RAY_TQDM_TOKEN = "__ray_tqdm_magic_token__"


class _ForwardHandler(logging.Handler):
    def __init__(self, channel, rank: int):
        super().__init__()
        self.channel = channel
        self.setFormatter(logging.Formatter(WORKER_FORMAT))
        self.rank = rank

    def emit(self, record: logging.LogRecord) -> None:
        if _RAY_TQDM_TOKEN in str(record.msg):  # Ray's own progress-bar protocol: leave it to Ray
            print(record.getMessage(), flush=True)
            return
        try:
            record.rank = self.rank
            # a message of several lines stays whole on the console: its blank edges dropped (transformers
            # logs "\n***** Running Evaluation *****") and every further line (a traceback's) under the
            # rank's prefix
            shown = copy.copy(record)
            shown.msg, shown.args = record.getMessage().strip("\n"), None
            text = self.format(shown).replace("\n", f"\n[rank{self.rank}] ")
            self.channel.send(Kind.LOG, LogLine(record.levelno, text),
                              urgent=record.levelno >= logging.WARNING)
        except Exception:
            self.handleError(record)


class _ForwardStream(io.TextIOBase):
    """A rank's ``sys.stdout`` / ``sys.stderr`` while it runs a call: each complete line goes to the driver's
    console through the channel, as Ray's log_to_driver would carry it -- which raytrainer's local Ray
    instance turns off, to keep Ray's own output off the console (driver/ray_runtime.py). Output written to
    the file descriptors by C code (a compiler, NCCL) stays in Ray's log files."""

    def __init__(self, channel, rank: int, original):
        self.channel, self.rank, self.original, self._partial = channel, rank, original, ""
        self._sending = False  # output written while a line is being sent goes to the original stream

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if self._sending or _RAY_TQDM_TOKEN in text:  # Ray's own progress-bar protocol: left to Ray
            return self.original.write(text)
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        self._sending = True
        try:
            for line in lines:
                self.channel.send(Kind.LOG, LogLine(logging.INFO, f"[rank{self.rank}] {line}"))
        finally:
            self._sending = False
        return len(text)

    def flush(self) -> None:
        if self._partial:
            self.write("\n")
        self.channel.flush()


@contextlib.contextmanager
def _library_progress_bars_off():
    """transformers' and huggingface_hub's progress bars off on a worker ("Writing model shards" at each save,
    "Loading weights", downloads): the console's one bar is the driver's. Put back as they were after."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def rank_logging(args, rank: int, channel=None, driver_hf_level: int | None = None):
    """Apply the rank's log level; forward to ``channel`` (None: in the driver's own process).

    With a ``passive`` log_level the main rank takes transformers' verbosity from the driver as it was when
    the call was sent (``driver_hf_level``: the spec's, driver/spec.py), as if it had run the script's
    ``transformers.logging.set_verbosity_info()`` itself: under torchrun every rank runs the script.
    """
    level = args.get_process_log_level()
    levels = {logging.getLogger(): level, logging.getLogger("raytrainer"): level}
    hf = _transformers_logger()
    chosen = args.log_level if args.should_log else args.log_level_replica
    if chosen != "passive":
        levels[hf] = level
    elif args.should_log and driver_hf_level is not None:
        levels[hf] = driver_hf_level
    else:
        levels[hf] = hf.level or _transformers_default_level()
    loggers = list(levels)
    saved = [(lg, lg.level, list(lg.handlers)) for lg in loggers]

    added = []
    if channel is not None:  # a worker: its file, and the driver's console
        log_dir = os.path.join(args.output_dir, "logs")
        os.makedirs(log_dir, exist_ok=True)
        file_handler = logging.FileHandler(os.path.join(log_dir, f"rank-{rank}.log"))
        file_handler.setFormatter(logging.Formatter("%(asctime)s " + WORKER_FORMAT))
        file_handler.addFilter(_RankFilter(rank))
        forward = _ForwardHandler(channel, rank)
        if level > logging.DEBUG:
            forward.addFilter(_without_ray_internals)
        added = [file_handler, forward]
    streams = contextlib.ExitStack()
    if channel is not None:  # print() and warnings of the rank's Python code reach the driver's console
        streams.enter_context(_library_progress_bars_off())
        streams.enter_context(contextlib.redirect_stdout(_ForwardStream(channel, rank, sys.stdout)))
        streams.enter_context(contextlib.redirect_stderr(_ForwardStream(channel, rank, sys.stderr)))
    try:
        for lg in loggers:
            lg.setLevel(levels[lg])
            if lg.propagate and lg is not logging.getLogger():
                continue  # transformers' logger before transformers configured it: the root's handlers
            if channel is not None:
                # On a worker our handlers replace the process's stream handlers: the driver prints.
                for h in list(lg.handlers):
                    lg.removeHandler(h)
            for h in added:
                lg.addHandler(h)
        yield
    finally:
        for lg, lvl, handlers in saved:
            for h in added:
                lg.removeHandler(h)
            lg.setLevel(lvl)
            for h in handlers:
                if h not in lg.handlers:
                    lg.addHandler(h)
        for h in added:
            h.close()
        streams.close()


def driver_transformers_level() -> int | None:
    """transformers' verbosity in this process (the driver's), or None where its logging is not loaded."""
    hf_logging = sys.modules.get("transformers.utils.logging")
    return hf_logging.get_verbosity() if hf_logging is not None else None


def _transformers_logger() -> logging.Logger:
    """transformers' library root logger -- configured (its own handler, no propagation) if transformers'
    logging is loaded in this process; else left unconfigured (its records reach the root's handlers), so
    that a run that does not use transformers does not import it."""
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        hf_logging.get_verbosity()  # configures the library's root logger if nothing has yet
    return logging.getLogger("transformers")


def _transformers_default_level() -> int:
    """The verbosity transformers starts with: TRANSFORMERS_VERBOSITY, else warning."""
    name = os.environ.get("TRANSFORMERS_VERBOSITY", "warning").lower()
    return getattr(logging, name.upper(), logging.WARNING) if name in _HF_LEVELS else logging.WARNING


_HF_LEVELS = ("debug", "info", "warning", "error", "critical")


def _without_ray_internals(record: logging.LogRecord) -> bool:
    """Ray's own records stay off the driver's console (they go to the rank's log file): Ray Train logs
    every reported checkpoint at INFO, on a logger named after its file (``getLogger(__file__)``), whose
    records reach the root's handlers whatever the rank's level. Shown with ``log_level="debug"``."""
    if record.name == "ray" or record.name.startswith("ray."):
        return False
    ray = sys.modules.get("ray")
    ray_dir = os.path.dirname(getattr(ray, "__file__", None) or "") if ray is not None else ""
    return not (ray_dir and record.pathname.startswith(ray_dir + os.sep))


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True
