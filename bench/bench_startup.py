"""Where the seconds go between ``train()`` and the first optimizer step, 2 workers, a fresh process.

Timestamps (``time.time()``, one machine) from the driver and from each rank:

  Ray start          ``ray.init`` of a private local instance (raytrainer's ensure_ray)
  driver checks      ``train()`` called -> the worker group's run thread starts (preflight, pickling)
  Ray Train start    -> the worker processes exist (controller actor, placement group, worker actors)
  worker boot        -> the train function is entered (Ray's worker start, imports, Ray Train's worker
                     setup and the torch process group)
  command            -> the command is received (the spec reference, from the channel)
  spec               -> the spec is fetched and unpickled (the Trainer, model and data)
  first step         -> the first optimizer step ends (strategy setup, data loader, first batch)

then a warm ``train()`` on the same group, for the same breakdown without the start-up. Each rank's times
come from a callback (``on_step_end`` at step 1) and ``raytrainer.worker.entry.TIMES``. Prints a Markdown
table (the slower rank's times) and writes the raw numbers as JSON. Not a test: nothing asserts.

    python bench/bench_startup.py --out /tmp/bench-startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from raytrainer import TrainerCallback  # noqa: E402


class StartupProbe(TrainerCallback):
    """On every rank, at the end of step 1: the process's creation time and the loop's timestamps."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != 1:
            return
        import psutil

        from raytrainer.worker.entry import TIMES

        record = {"rank": args.process_index, "created": psutil.Process().create_time(), **TIMES,
                  "first_step": time.time()}
        with open(os.path.join(args.output_dir, f"startup-rank{args.process_index}.json"), "w") as f:
            json.dump(record, f)


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _phases(called: float, group_started: float, ranks: list[dict], cold: bool) -> dict:
    slowest = {k: max(r[k] for r in ranks) for k in ranks[0] if k != "rank"}
    phases = {"driver checks": group_started - called if cold else None}
    if cold:
        phases["Ray Train start"] = min(r["created"] for r in ranks) - group_started
        phases["worker boot"] = slowest["entry"] - min(r["created"] for r in ranks)
        phases["command"] = slowest["command"] - slowest["entry"]
    else:
        phases["command"] = slowest["command"] - called
    phases["spec"] = slowest["spec"] - slowest["command"]
    phases["first step"] = slowest["first_step"] - slowest["spec"]
    phases["total"] = slowest["first_step"] - called
    return phases


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    a = p.parse_args()

    import cloudpickle
    import numpy as np
    import torch
    from _common import DictDataset, MLPClassifier, collate, write_digits
    from _machine import machine_info

    from raytrainer import Trainer, TrainingArguments
    from raytrainer.driver.ray_runtime import ensure_ray

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    workdir = tempfile.mkdtemp(prefix="bench-startup-")
    write_digits(os.path.join(workdir, "digits.npz"))
    d = np.load(os.path.join(workdir, "digits.npz"))
    train = DictDataset(x=torch.from_numpy(d["x"]), labels=torch.from_numpy(d["y"]))

    def args(name):
        return TrainingArguments(output_dir=f"{workdir}/{name}", num_workers=2, max_steps=2,
                                 per_device_train_batch_size=16, save_strategy="no", report_to="none",
                                 disable_tqdm=True, remove_unused_columns=False)

    start = time.time()
    ensure_ray(args("ray"))
    ray_start = time.time() - start
    trainer = Trainer(model=MLPClassifier(), args=args("cold"), train_dataset=train, data_collator=collate,
                      callbacks=[StartupProbe()])
    rows = {}
    for name in ("cold", "warm"):
        trainer.args.output_dir = f"{workdir}/{name}"
        os.makedirs(trainer.args.output_dir, exist_ok=True)
        called = time.time()
        trainer.train()
        ranks = [_load(os.path.join(trainer.args.output_dir, f"startup-rank{r}.json")) for r in range(2)]
        rows[name] = _phases(called, trainer._group.started_at, ranks, cold=name == "cold")
    trainer.close()
    record = {"machine": machine_info(os.path.dirname(HERE)), "ray_start_s": ray_start, "phases": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=2)
    print(f"Ray start (ray.init, local instance): {ray_start:.2f} s")
    names = list(rows["cold"])
    print("| phase | first train() (s) | second train(), same group (s) |")
    print("|---|---|---|")
    for n in names:
        cells = [("-" if rows[k].get(n) is None else f"{rows[k][n]:.2f}") for k in ("cold", "warm")]
        print(f"| {n} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
