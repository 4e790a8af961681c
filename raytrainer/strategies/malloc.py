"""Under FSDP, memory a step frees goes back to the OS (glibc's mmap threshold fixed at 1 MiB).

glibc's ``malloc`` serves a block of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap`` and gives it
back to the OS when freed; smaller blocks come from its heaps, where freed memory stays resident for reuse.
The threshold is dynamic by default: each freed mmapped block raises it to that block's size, up to 32 MiB.
An FSDP step allocates and frees many tensors of 1-32 MiB (each unit's gathered parameters and unsharded
gradients, activations); after the first frees they all come from the heaps, which keep growing with
fragmentation. Measured on 2 CPU workers (bench/bench_fsdp_peak.py, docs/benchmarks.md): a 267M-parameter
causal LM under FSDP peaked at 4,177 MiB per worker, 3,336 MiB with the threshold fixed, steps no slower
(12.9 s against 13.5 s). Under DDP the same setting saved 6% of the peak but cost 7% of the step time (each
mmapped block's pages are faulted in anew), so it is FSDP's alone: a rank whose group shards with FSDP
(worker/hosted_sharding.py) sets it, once per process. A process whose allocator is
not glibc's (macOS, jemalloc or tcmalloc preloaded) or whose environment sets ``MALLOC_MMAP_THRESHOLD_``
itself is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
#: Blocks of at least this many bytes are mmapped, and unmapped when freed.
MMAP_THRESHOLD = 1 << 20


@functools.cache
def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD for this process; True if it was set. Once per process:
    ``find_library`` runs ``ldconfig``, and each FSDP setup (every ``train()``) asks."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or any(
            name in os.environ.get("LD_PRELOAD", "") for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return False
    name = ctypes.util.find_library("c")
    if not name or "libc.so" not in name:  # glibc only (musl and macOS have no such threshold)
        return False
    try:
        return bool(ctypes.CDLL(name).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False
