"""Where and with what a benchmark ran (stdlib only: the benchmark drivers do not import torch)."""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import os
import platform
import subprocess


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(repo: str) -> dict:
    """Date, CPU, memory, OS, library versions and the raytrainer commit (``+dirty`` if edited)."""
    cpu, mem_kb = platform.processor() or platform.machine(), None
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    git = ["git", "-C", repo]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "raytrainer"], capture_output=True,
                           text=True).stdout.strip()
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(), "cpu": cpu, "logical_cpus": os.cpu_count(),
        "nproc": len(os.sched_getaffinity(0)),
        "memory_gib": round(mem_kb / 2**20, 1) if mem_kb else None,
        "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
        **{d: _version(d) for d in ("torch", "ray", "transformers", "pyarrow", "safetensors")},
        "raytrainer_commit": commit.strip() + ("+dirty" if dirty else ""),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def parse_trees(specs: list[str], error) -> dict[str, str]:
    """``--tree NAME=PATH`` values as {NAME: absolute PATH}; ``error`` (argparse's) refuses a value without a
    name or whose PATH holds no raytrainer package."""
    trees = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if not (name and path) or not os.path.isdir(os.path.join(path, "raytrainer")):
            error(f"--tree {spec!r}: give NAME=PATH, PATH holding a raytrainer package")
        trees[name] = os.path.abspath(path)
    return trees
