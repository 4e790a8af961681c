"""Two ranks of a gloo group in two spawned processes, for the collectives raytrainer's rank code runs."""

from __future__ import annotations


def run_two_ranks(target, store: str, timeout: float = 120.0) -> list:
    """``target(rank, store, results)`` in a process per rank (``store``: a file path for the group's
    ``file://`` rendezvous; ``results``: a queue each rank puts one item into). Every rank must exit 0
    within ``timeout`` seconds (a rank left waiting in a collective does not); returns the items."""
    import queue
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, store, results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    items, deadline = [], time.monotonic() + timeout
    # Taken while the ranks run: a rank that put a large item exits only once it is read.
    while len(items) < len(procs) and time.monotonic() < deadline:
        try:
            items.append(results.get(timeout=1))
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]  # None: still running
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0, 0], f"a rank hung or failed in a collective: exit codes {codes}"
    return items
