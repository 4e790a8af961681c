"""What a line of the driver's console may be, for the tests that read it."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import tempfile

#: a line from Ray's modules or files
RAY_LINE = re.compile(r"(^|[\s\[(])ray\.[a-z_]|[/\\]ray[/\\]|RayDeprecationWarning|TrainingReport\(")

#: a line of raytrainer's console: its own (``raytrainer: ``, its logger's ``LEVEL raytrainer.x: ``), a
#: rank's forwarded record or print (``[rank1] ``), the driver's PrinterCallback dicts, or blank
OURS = re.compile(r"^(raytrainer: |\[rank\d+\] |\{'|(DEBUG|INFO|WARNING|ERROR|CRITICAL) raytrainer[\w.]*: "
                  r"|$)")


def not_ours(console: str, *allowed_prefixes: str) -> list[str]:
    """The lines of ``console`` that are neither raytrainer's, nor start with one of ``allowed_prefixes`` (the
    script's own prints), nor are printed by this environment's ``import transformers.trainer`` alone (a
    script of plain transformers prints them too: bitsandbytes 0.50, pulled in by peft, logs a line at
    import on a CPU with AVX512-BF16)."""
    noise = set(import_noise())
    return [line for line in console.splitlines() if not OURS.match(line) and line not in noise
            and not line.startswith(allowed_prefixes or ("\0",))]


@functools.cache
def import_noise() -> tuple[str, ...]:
    """What ``import transformers.trainer`` prints in a fresh interpreter of this environment."""
    done = subprocess.run([sys.executable, "-c", "import transformers.trainer"], capture_output=True,
                          text=True, timeout=300, cwd=tempfile.gettempdir())
    return tuple(line for line in (done.stdout + done.stderr).splitlines() if line.strip())
