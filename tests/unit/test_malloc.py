"""worker/malloc.py: with glibc's mmap threshold fixed, tensors of a few MiB freed after a step go back to
the OS; with glibc's dynamic threshold they stay resident in its heaps. Each case in a fresh process."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = """
import sys
import torch
from raytrainer.worker.malloc import return_freed_memory

def rss_mib():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024

if sys.argv[1] == "fixed":
    assert return_freed_memory()
big = [torch.ones(2 << 20) for _ in range(4)]  # 8 MiB each, mmapped: raises the dynamic threshold
del big
before = rss_mib()
step = [torch.ones((i % 7 + 1) << 18) for i in range(400)]  # 1-7 MiB each, ~1.6 GB in all
del step
print(rss_mib() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_tensors_of_a_few_mib_return_to_the_os_with_the_fixed_threshold():
    def kept(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    assert kept("dynamic") > 1000  # MiB still resident after every tensor was freed
    assert kept("fixed") < 50
