#!/usr/bin/env python
"""The training loop's own cost per step: raytrainer ``num_workers=0`` against a hand-written loop.

The digits MLP of bench_core (64-256-256-10, batch 32, fused AdamW, linear schedule, clipping at 1.0,
logging every 50 steps, no evaluation, no checkpoints, OMP_NUM_THREADS=1) for ``--epochs`` epochs (56
steps each), or with ``--workload bert`` bench_core's tiny BERT (``--bert-examples``, batch 32). Each run
is a fresh process; the sides alternate, ``--repeats`` times, and the table shows each side's median
ms/step (the median of the runs' median step times, steps after the first 10%) and CPU ms/step (the
process's CPU time over those steps, less disturbed by other work on the machine).

``--tree NAME=PATH`` adds a raytrainer side imported from another checkout (e.g. a ``git archive`` of an
earlier commit), so a change is measured before and after in one run. Each side also reports a hash of
its logged losses and final weights: equal hashes mean bitwise-equal training.

    python bench/bench_step.py --repeats 5
    python bench/bench_step.py --with transformers,one_loop --repeats 5   # beside transformers.Trainer
    python bench/bench_step.py --tree before=/tmp/rt-before --repeats 5 --out bench/results/x.json
    python bench/bench_step.py --profile /tmp/rt.prof      # cProfile one raytrainer run, print the top
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# -- one run, in a child process -------------------------------------------------------------------------
def _digest(logs: list, model) -> str:
    h = hashlib.sha256(json.dumps(logs, sort_keys=True).encode())
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class _HandClock:
    """What the hand loop tells its clock (bench/_common.hand_loop): each step's end, wall and CPU time."""

    def __init__(self):
        self.ends, self.cpu = [], []

    def mark(self, name: str) -> None:
        pass

    def mark_optimizer_step(self) -> None:
        pass

    def mark_step_end(self) -> None:
        self.ends.append(time.perf_counter())
        self.cpu.append(time.process_time())


def _hand(cfg: dict) -> dict:
    from _common import LOGGING_STEPS, hand_loop

    clock = _HandClock()
    model, step, sums, _rest = hand_loop(cfg, clock)
    logs = [{"loss": value / LOGGING_STEPS, "step": at} for at, value in sums]
    return {"step_ends": clock.ends, "cpu_ends": clock.cpu, "digest": _digest(logs, model), "steps": step}


def _raytrainer(cfg: dict) -> dict:
    """A Trainer's run: raytrainer's (``cfg["trainer"]``: "raytrainer", its loop as exported; "one_loop",
    raytrainer's Trainer on transformers' loop) or transformers' own ("transformers")."""
    from _common import build_dataset, build_model, collate, trainer_kwargs
    from transformers import TrainerCallback

    import raytrainer

    which = cfg.get("trainer", "raytrainer")
    if which == "transformers":
        from transformers import Trainer, TrainingArguments

        ray_fields = {}
    else:
        from raytrainer import Trainer, TrainingArguments

        ray_fields = {"num_workers": 0}
        if which == "one_loop":
            from raytrainer.one_loop import Trainer

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends, self.cpu, self.logs = [], [], []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())
            self.cpu.append(time.process_time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    kwargs = trainer_kwargs(cfg)
    args = TrainingArguments(output_dir=cfg["output_dir"], report_to="none", **ray_fields, **kwargs)
    clock = Clock()
    model = build_model(cfg)
    trainer = Trainer(model=model, args=args, train_dataset=build_dataset(cfg), data_collator=collate,
                      callbacks=[clock])
    prof = None
    if cfg.get("profile"):
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    out = trainer.train()
    if prof is not None:
        prof.disable()
        prof.dump_stats(cfg["profile"])
    logs = [{k: v for k, v in entry.items() if not k.startswith("train_")} for entry in clock.logs]
    logs.append({"train_loss": out.training_loss, "step": out.global_step})
    return {"step_ends": clock.ends, "cpu_ends": clock.cpu, "digest": _digest(logs, model),
            "steps": out.global_step,
            "raytrainer": os.path.dirname(os.path.dirname(raytrainer.__file__))}


def child(cfg_path: str) -> None:
    with open(cfg_path) as f:
        cfg = json.load(f)
    result = _hand(cfg) if cfg["side"] == "hand" else _raytrainer(cfg)
    ends, cpu = result.pop("step_ends"), result.pop("cpu_ends")
    k0 = max(5, len(ends) // 10)
    steps = [b - a for a, b in zip(ends[k0:], ends[k0 + 1:])]
    result["median_ms"] = 1000 * statistics.median(steps)
    result["mean_ms"] = 1000 * (ends[-1] - ends[k0]) / (len(ends) - 1 - k0)
    # the process's own CPU time per step: less disturbed than wall time by other work on the machine
    result["cpu_ms"] = 1000 * (cpu[-1] - cpu[k0]) / (len(cpu) - 1 - k0)
    with open(cfg["out"], "w") as f:
        json.dump(result, f)


# -- the driver ------------------------------------------------------------------------------------------
def run_side(side: str, src: str | None, cfg: dict, workdir: str) -> dict:
    cfg = {**cfg, "side": "hand" if side == "hand" else "raytrainer",
           "trainer": side if side in ("transformers", "one_loop") else "raytrainer",
           "out": os.path.join(workdir, "result.json"), "output_dir": os.path.join(workdir, "out")}
    path = os.path.join(workdir, "cfg.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (HERE, src or REPO, os.environ.get("PYTHONPATH")) if p))
    subprocess.run([sys.executable, os.path.abspath(__file__), "--child", path], env=env, check=True,
                   cwd=workdir)
    with open(cfg["out"]) as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workload", choices=("mlp", "bert"), default="mlp")
    p.add_argument("--epochs", type=int, default=None, help="default: 20 (mlp), 1 (bert)")
    p.add_argument("--bert-examples", type=int, default=2048)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                   help="also run raytrainer imported from PATH, as side NAME")
    p.add_argument("--with", dest="also", default="", metavar="SIDES",
                   help="also run these sides (comma-separated): transformers (transformers.Trainer in "
                        "one process), one_loop (raytrainer's Trainer on transformers' loop)")
    p.add_argument("--profile", metavar="FILE", help="cProfile one raytrainer run into FILE, print the top")
    p.add_argument("--out", help="write the raw results here (JSON)")
    p.add_argument("--check", type=float, metavar="RATIO",
                   help="exit 1 unless raytrainer's CPU time per step is within RATIO of the hand loop's "
                        "(hand / raytrainer >= RATIO): the full tier's per-step regression check")
    opts = p.parse_args()
    if opts.child:
        return child(opts.child)

    workdir = tempfile.mkdtemp(prefix="bench-step-")
    cfg = {"workload": opts.workload, "batch_size": 32, "lr": 1e-3}
    if opts.workload == "mlp":
        sys.path.insert(0, HERE)
        from _common import write_digits

        cfg.update(epochs=opts.epochs or 20, digits_path=os.path.join(workdir, "digits.npz"))
        write_digits(cfg["digits_path"])
    else:  # bench_core's tiny BERT
        cfg.update(epochs=opts.epochs or 1, examples=opts.bert_examples, vocab_size=1000, seq_len=64)
    if opts.profile:
        res = run_side("raytrainer", None, {**cfg, "profile": opts.profile}, workdir)
        print(f"profiled run: {res['median_ms']:.3f} ms/step (median, under cProfile)")
        import pstats

        pstats.Stats(opts.profile).sort_stats("tottime").print_stats(30)
        return None

    from _machine import parse_trees

    sides = {"hand": None, "raytrainer": None, **{name: None for name in opts.also.split(",") if name},
             **parse_trees(opts.tree, p.error)}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    load_start = os.getloadavg()
    for r in range(opts.repeats):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            res = run_side(name, sides[name], cfg, workdir)
            runs[name].append(res)
            print(f"repeat {r + 1} {name:12s} {res['median_ms']:.3f} ms/step, "
                  f"CPU {res['cpu_ms']:.3f} ms/step, digest {res['digest']}",
                  flush=True)
    hand = statistics.median(r["median_ms"] for r in runs["hand"])
    print(f"\n{opts.workload}, {cfg['epochs']} epochs ({runs['hand'][0]['steps']} steps), "
          f"{opts.repeats} repeats, load {load_start[0]:.2f} -> {os.getloadavg()[0]:.2f}\n")
    cpu_hand = statistics.median(r["cpu_ms"] for r in runs["hand"])
    best_hand = min(r["median_ms"] for r in runs["hand"])
    print("| side | ms/step (median) | hand loop / side | best run | hand loop / side | CPU ms/step (median) "
          "| hand loop / side | digest |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    summary = {}
    for name, rs in runs.items():
        med = statistics.median(r["median_ms"] for r in rs)
        mean = statistics.median(r["mean_ms"] for r in rs)
        cpu = statistics.median(r["cpu_ms"] for r in rs)
        best = min(r["median_ms"] for r in rs)  # the run least disturbed by other work
        digests = sorted({r["digest"] for r in rs})
        summary[name] = {"median_ms": med, "mean_ms": mean, "cpu_ms": cpu, "ratio": hand / med,
                         "best_ms": best, "best_ratio": best_hand / best,
                         "cpu_ratio": cpu_hand / cpu, "digests": digests, "src": sides[name],
                         "runs_median_ms": [r["median_ms"] for r in rs],
                         "runs_cpu_ms": [r["cpu_ms"] for r in rs]}
        print(f"| {name} | {med:.3f} | {hand / med:.2f}x | {best:.3f} | {best_hand / best:.2f}x "
              f"| {cpu:.3f} | {cpu_hand / cpu:.2f}x | {', '.join(digests)} |")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"config": cfg, "repeats": opts.repeats, "load_start": load_start,
                       "load_end": os.getloadavg(), "summary": summary, "runs": runs}, f, indent=1)
    if opts.check is not None:
        ratio = summary["raytrainer"]["cpu_ratio"]  # CPU time: what other work on the machine disturbs least
        verdict = "ok" if ratio >= opts.check else "REGRESSION"
        print(f"--check: raytrainer's CPU time per step is {ratio:.2f}x the hand loop's speed "
              f"(bar {opts.check:.2f}x): {verdict}")
        return 0 if ratio >= opts.check else 1
    return None


if __name__ == "__main__":
    sys.exit(main())
