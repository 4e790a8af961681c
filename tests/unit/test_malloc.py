"""strategies/malloc.py: with glibc's mmap threshold fixed, tensors of a few MiB freed after a step go back to
the OS; with glibc's dynamic threshold they stay resident in its heaps. Each case in a fresh process."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = """
import importlib.util
import sys
import threading

import torch

spec = importlib.util.spec_from_file_location("malloc", sys.argv[2])  # the module alone, not the package
malloc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(malloc)


def rss_mib():
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) // 1024


def a_step(kept):  # as a rank trains: on a thread of its own (its own glibc arena)
    big = [torch.ones(2 << 20) for _ in range(4)]  # 8 MiB each, mmapped: raises the dynamic threshold
    del big
    before = rss_mib()
    step = [torch.ones((i % 7 + 1) << 18) for i in range(400)]  # 1-7 MiB each, ~1.6 GB in all
    del step
    kept.append(rss_mib() - before)


if sys.argv[1] == "fixed":
    assert malloc.return_freed_memory()
kept = []
thread = threading.Thread(target=a_step, args=(kept,))
thread.start()
thread.join()
print(kept[0])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_tensors_of_a_few_mib_return_to_the_os_with_the_fixed_threshold():
    def kept(mode: str) -> int:
        import raytrainer.strategies.malloc as module

        out = subprocess.run([sys.executable, "-c", CHILD, mode, module.__file__], capture_output=True,
                             text=True, check=True)
        return int(out.stdout.split()[-1])

    assert kept("dynamic") > 1000  # MiB still resident after every tensor was freed
    assert kept("fixed") < 50
