"""Warm workers: the cost of evaluate() / predict() after train() on 2 workers, beyond the work itself.

The digits MLP (bench/_common.py), 1 epoch of training on 2 Ray workers (DDP), then, in the same process:

  warm      evaluate() and predict() on the Trainer's live worker group, ``--repeats`` times each
  second    evaluate() and predict() on a new Trainer holding the trained model while the first one is alive
            and idle: the group passes to it (a script's second Trainer, a notebook's next cell)
  cold      the same after the first Trainer's close(): a new worker group each (what every call cost before
            worker groups stayed up, and a second Trainer's first call before they were shared)
  local     transformers-style evaluation in this process (raytrainer with num_workers=0): the work itself

"overhead" is a call's wall time minus its own ``*_runtime`` metric (the evaluation loop on rank 0). Prints
a Markdown table and writes the raw numbers as JSON. Not a test: nothing asserts.

    python bench/bench_warm.py --out /tmp/bench-warm.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _timed(call, key: str) -> dict:
    start = time.perf_counter()
    out = call()
    wall = time.perf_counter() - start
    metrics = out if isinstance(out, dict) else out.metrics
    return {"wall_s": wall, "runtime_s": metrics[key], "overhead_s": wall - metrics[key]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cold-repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()

    import numpy as np
    import torch
    from _common import DictDataset, MLPClassifier, collate, write_digits
    from _machine import machine_info

    from raytrainer import Trainer, TrainingArguments

    workdir = tempfile.mkdtemp(prefix="bench-warm-")
    write_digits(os.path.join(workdir, "digits.npz"))
    d = np.load(os.path.join(workdir, "digits.npz"))
    x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
    train, test = DictDataset(x=x[:1400], labels=y[:1400]), DictDataset(x=x[1400:], labels=y[1400:])

    def args(name, workers=2):
        return TrainingArguments(output_dir=f"{workdir}/{name}", num_workers=workers, num_train_epochs=1,
                                 per_device_train_batch_size=16, per_device_eval_batch_size=128,
                                 save_strategy="no", report_to="none", disable_tqdm=True,
                                 remove_unused_columns=False)

    torch.manual_seed(0)
    trainer = Trainer(model=MLPClassifier(), args=args("warm"), train_dataset=train, eval_dataset=test,
                      data_collator=collate)
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    rows = {"warm evaluate": [], "warm predict": [], "second evaluate": [], "second predict": [],
            "cold evaluate": [], "cold predict": [], "local evaluate": [], "local predict": []}
    for _ in range(a.repeats):
        rows["warm evaluate"].append(_timed(trainer.evaluate, "eval_runtime"))
        rows["warm predict"].append(_timed(lambda: trainer.predict(test), "test_runtime"))
    model = trainer.model
    for i in range(a.repeats):  # each a new Trainer of the same shape; the first stays alive
        second = Trainer(model=model, args=args(f"second{i}"), eval_dataset=test, data_collator=collate)
        rows["second evaluate"].append(_timed(second.evaluate, "eval_runtime"))
        second = Trainer(model=model, args=args(f"secondp{i}"), eval_dataset=test, data_collator=collate)
        rows["second predict"].append(_timed(lambda s=second: s.predict(test), "test_runtime"))
    del second
    import raytrainer

    if hasattr(raytrainer, "shutdown"):  # an older checkout on PYTHONPATH may not have it (nor shared groups)
        raytrainer.shutdown()  # the group, wherever it is now
    trainer.close()
    for i in range(a.cold_repeats):
        with Trainer(model=model, args=args(f"cold{i}"), eval_dataset=test, data_collator=collate) as cold:
            rows["cold evaluate"].append(_timed(cold.evaluate, "eval_runtime"))
        with Trainer(model=model, args=args(f"coldp{i}"), eval_dataset=test, data_collator=collate) as cold:
            rows["cold predict"].append(_timed(lambda c=cold: c.predict(test), "test_runtime"))
    local = Trainer(model=model, args=args("local", workers=0), eval_dataset=test, data_collator=collate)
    for _ in range(a.repeats):
        rows["local evaluate"].append(_timed(local.evaluate, "eval_runtime"))
        rows["local predict"].append(_timed(lambda: local.predict(test), "test_runtime"))

    summary = {name: {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "runtime_s", "overhead_s")}
               for name, runs in rows.items() if runs}
    record = {"machine": machine_info(os.path.dirname(HERE)), "train_s": train_s, "runs": rows,
              "medians": summary}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=2)
    print(f"train() on 2 workers (group start included): {train_s:.1f} s")
    print("| call (2 workers unless local) | runs | wall, median (s) | its own runtime (s) | overhead (s) |")
    print("|---|---|---|---|---|")
    for name, m in summary.items():
        print(f"| {name} | {len(rows[name])} | {m['wall_s']:.2f} | {m['runtime_s']:.3f} | "
              f"{m['overhead_s']:.2f} |")


if __name__ == "__main__":
    main()
