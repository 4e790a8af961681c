"""What a line of the driver's console may be, for the tests that read it."""

from __future__ import annotations

import re

#: a line from Ray's modules or files
RAY_LINE = re.compile(r"(^|[\s\[(])ray\.[a-z_]|[/\\]ray[/\\]|RayDeprecationWarning|TrainingReport\(")

#: a line of raytrainer's console: its own (``raytrainer: ``, its logger's ``LEVEL raytrainer.x: ``), a
#: rank's forwarded record or print (``[rank1] ``), the driver's PrinterCallback dicts, or blank
OURS = re.compile(r"^(raytrainer: |\[rank\d+\] |\{'|(DEBUG|INFO|WARNING|ERROR|CRITICAL) raytrainer[\w.]*: "
                  r"|$)")


def not_ours(console: str, *allowed_prefixes: str) -> list[str]:
    """The lines of ``console`` that are neither raytrainer's nor start with one of ``allowed_prefixes`` (the
    script's own prints)."""
    return [line for line in console.splitlines()
            if not OURS.match(line) and not line.startswith(allowed_prefixes or ("\0",))]
