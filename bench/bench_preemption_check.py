#!/usr/bin/env python
"""What listening for Ray's preemption notice costs a training step (worker/preemption.py).

Two processes on a gloo group, as two CPU workers. Each side runs ``--steps`` steps of the bench digits
MLP's DDP update (64-256-256-10, batch 32, AdamW; DDP's gradient all-reduce on the training group) and,
per side, after each step:
- ``none``: nothing (what a run without the check pays);
- ``notice``: raytrainer's check as it runs (``PreemptionCallback.on_step_end``: an all-reduce of the
  notice count started on a gloo side group and read at the next check; every step for the first 8 steps,
  then about once a second);
- ``notice_every_step``: the same check forced at every step (its raw cost per check);
- ``blocking``: the same flag all-reduced and read at once on the training group (what a check through
  ``sync_control`` would cost).
The sides alternate, ``--repeats`` times, in the same two processes; the table gives each side's median
ms/step on rank 0 and the ratio to ``none``.

    python bench/bench_preemption_check.py --repeats 5 --out bench/results/preemption-check-DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _rank(rank: int, world: int, port: int, steps: int, repeats: int, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch import nn
    from transformers import TrainerControl, TrainerState

    from raytrainer.rank_context import RankContext
    from raytrainer.worker.preemption import PreemptionCallback
    from raytrainer.worker.session import RankSession

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    ctx = RankContext(world_size=world, rank=rank)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    session = RankSession(ctx)
    callback = PreemptionCallback(session, notice=lambda: None)
    every_step = PreemptionCallback(session, notice=lambda: None)
    every_step.every = 1
    state, control = TrainerState(), TrainerControl()

    def check(side: str) -> None:
        if side == "notice":
            callback.on_step_end(None, state, control)
        elif side == "notice_every_step":
            every_step.on_step_end(None, state, control)
        elif side == "blocking":
            ctx.any_flags([False, False, False, False, False, False])

    times: dict[str, list[float]] = {"none": [], "notice": [], "notice_every_step": [], "blocking": []}
    for _ in range(repeats):
        for side in times:
            per_step = []
            for _ in range(steps):
                started = time.perf_counter()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                state.global_step += 1
                check(side)
                per_step.append(time.perf_counter() - started)
            times[side].append(statistics.median(per_step[steps // 10:]) * 1000)
    callback.on_train_end(None, state, control)
    every_step.on_train_end(None, state, control)
    if rank == 0:
        print(f"raytrainer's cadence: a check every {callback.every} steps", flush=True)
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out")
    opts = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_rank, args=(r, 2, port, opts.steps, opts.repeats, queue)) for r in range(2)]
    for p in procs:
        p.start()
    times = queue.get(timeout=900)
    for p in procs:
        p.join()
    medians = {side: statistics.median(v) for side, v in times.items()}
    print("| side | ms/step (median of runs) | x none |")
    print("|---|---:|---:|")
    for side, ms in medians.items():
        print(f"| {side} | {ms:.3f} | {ms / medians['none']:.3f} |")
    if opts.out:
        from bench._machine import machine_info

        with open(opts.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "machine": machine_info(os.path.dirname(HERE)),
                       "steps": opts.steps, "repeats": opts.repeats, "runs_ms_per_step": times,
                       "median_ms_per_step": medians}, f, indent=1)


if __name__ == "__main__":
    main()
