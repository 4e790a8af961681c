#!/usr/bin/env python
"""`raytrainer consolidate`: peak memory against the model's size.

Writes a DCP checkpoint of a plain model (``--layers`` x ``Linear(2048, 2048)``, fp32: 16 MiB each) in the
layout of FSDP's final weights (``{"model": state_dict}``), then, each in a fresh process, consolidates it
into safetensors files of ``--max-shard-size`` and records the process's peak RSS (``ru_maxrss``) beside the
RSS it had just before the call (imports done): sampled every 2 ms from /proc/self/status by a thread,
anonymous memory (``RssAnon``: what the process allocated; file pages it read are the kernel's cache), since
``ru_maxrss`` in a child process started by a process that held the model reports the parent's peak.
Not a test: nothing asserts.

    python bench/bench_consolidate.py --layers 32 --max-shard-size 64MB --out /tmp/consolidate.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _rss_mib() -> float:
    """This process's anonymous resident memory (MiB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


class _Peak(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.done = _rss_mib(), threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.002):
            self.peak = max(self.peak, _rss_mib())


def _child(folder: str, out: str, max_shard_size: str) -> None:
    import huggingface_hub  # noqa: F401  (what consolidate imports, imported before measuring)
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    from raytrainer.consolidate import consolidate

    before = _rss_mib()
    sampler = _Peak()
    sampler.start()
    start = time.perf_counter()
    written = consolidate(folder, out, max_shard_size)
    seconds = time.perf_counter() - start
    sampler.done.set()
    sampler.join()
    peak = max(sampler.peak, _rss_mib())
    print(json.dumps({"rss_before_mib": before, "peak_rss_mib": peak, "seconds": seconds,
                      "files": len(written)}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--max-shard-size", default="64MB")
    p.add_argument("--out", default=None)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        _child(*a.child)
        return

    import torch
    import torch.distributed.checkpoint as dcp

    sys.path.insert(0, HERE)
    from _machine import machine_info

    work = tempfile.mkdtemp(prefix="bench-consolidate-")
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(a.layers)])
    size_mib = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(work, "final-model"), no_dist=True)
    del model
    rows = []
    for shard in (a.max_shard_size, "100GB"):
        out = os.path.join(work, f"out-{shard}")
        result = subprocess.run([sys.executable, __file__, "--child", os.path.join(work, "final-model"), out,
                                 shard], capture_output=True, text=True, check=True)
        row = json.loads(result.stdout.strip().splitlines()[-1])
        row.update(max_shard_size=shard, model_mib=size_mib,
                   growth_mib=row["peak_rss_mib"] - row["rss_before_mib"])
        rows.append(row)
    record = {"machine": machine_info(os.path.dirname(HERE)), "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=2)
    print("| max shard size | model (MiB) | files | RssAnon before (MiB) | peak | growth / model | s |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        print(f"| {r['max_shard_size']} | {r['model_mib']:.0f} | {r['files']} | {r['rss_before_mib']:.0f} | "
              f"{r['peak_rss_mib']:.0f} | {r['growth_mib'] / r['model_mib']:.2f}x | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
