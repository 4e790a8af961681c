"""Soak: back-to-back short 2-worker runs in one driver process, measuring what each run leaves behind.

After every run (train with two checkpoints, then evaluate): the Ray actors and placement groups alive (Ray's
state API, this instance only), the driver's open file descriptors, threads and resident memory. A leak shows
as a count that grows with the run number; the report gives the first and last values and the growth per run
over the second half (after the one-time costs of the first runs: imports, Ray's own actors).

    .venv/bin/python bench/soak.py --runs 20          # prints the table
    (bench/reliability.py --soak 20 puts it in docs/reliability.md)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from raytrainer import Trainer, TrainingArguments  # noqa: E402

# The bound a soak must stay within, per run over the second half: anything above is a leak.
BOUNDS = {"actors": 0.0, "placement groups": 0.0, "open files": 0.5, "threads": 0.5, "driver RSS MiB": 2.0}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(8, 3)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def _data(n: int = 32) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return [{"x": x[i], "labels": int(i % 3)} for i in range(n)]


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _sample() -> dict:
    import ray  # the GCS's tables: Ray's State API needs the dashboard, which a local instance runs without

    return {
        "actors": len(ray._private.state.actors(actor_state_name="ALIVE")),
        "placement groups": sum(pg["state"] == "CREATED" for pg in ray.util.placement_group_table().values()),
        "open files": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "driver RSS MiB": _rss_mib(),
    }


def _one_run(out: str) -> float:
    args = TrainingArguments(output_dir=out, num_workers=2, max_steps=4, save_strategy="steps", save_steps=2,
                             per_device_train_batch_size=4, report_to="none", disable_tqdm=True,
                             log_level="warning")
    with Trainer(model=Net(), args=args, train_dataset=_data(), eval_dataset=_data(16)) as trainer:
        trainer.train()
        return trainer.evaluate()["eval_loss"]  # on the same worker group; the with-block closes it


def soak(runs: int) -> dict:
    from raytrainer.driver.ray_runtime import ensure_ray

    ensure_ray(TrainingArguments(output_dir=tempfile.gettempdir(), num_workers=2))
    samples, seconds = [], []
    with tempfile.TemporaryDirectory(prefix="raytrainer-soak-") as root:
        for i in range(runs):
            started = time.monotonic()
            loss = _one_run(os.path.join(root, f"run-{i}"))
            seconds.append(time.monotonic() - started)
            time.sleep(1.0)  # Ray records actor deaths asynchronously
            samples.append(_sample())
            print(f"run {i + 1}/{runs}: {seconds[-1]:.1f}s eval_loss={loss:.4f} {samples[-1]}", flush=True)
    half = samples[runs // 2:]
    report = {}
    for key, bound in BOUNDS.items():
        values = [s[key] for s in half]
        growth = (values[-1] - values[0]) / max(len(values) - 1, 1)
        report[key] = {"first": samples[0][key], "last": samples[-1][key], "growth_per_run": growth,
                       "bound": bound, "ok": growth <= bound}
    return {"runs": runs, "seconds_per_run": sum(seconds) / len(seconds), "report": report}


def markdown(result: dict) -> list[str]:
    verdict = "within" if all(r["ok"] for r in result["report"].values()) else "OUTSIDE"
    lines = [f"## Soak: {result['runs']} back-to-back 2-worker runs in one driver process, {verdict} the "
             "bounds",
             "",
             "Each run: `train()` (4 steps, 2 checkpoints) then `evaluate()`, "
             f"{result['seconds_per_run']:.1f} s on average. Counted after each run; growth per run is "
             "over the second half of the runs.",
             "",
             "| what | after run 1 | after the last run | growth per run | bound | |",
             "|---|---:|---:|---:|---:|---|"]
    for key, r in result["report"].items():
        lines.append(f"| {key} | {r['first']:.0f} | {r['last']:.0f} | {r['growth_per_run']:+.2f} | "
                     f"{r['bound']:g} | {'ok' if r['ok'] else 'LEAK'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    result = soak(parser.parse_args().runs)
    print("\n".join(markdown(result)))
    sys.exit(0 if all(r["ok"] for r in result["report"].values()) else 1)


if __name__ == "__main__":
    main()
