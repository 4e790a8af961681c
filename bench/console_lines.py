"""How many lines a user's console gets, and how many of them are Ray's internals: the demo
(``examples/train_digits.py``, 2 workers) and a 2-trial Ray Tune search (2 workers per trial), each run
as a user runs it -- a fresh Python process, default log levels -- with stdout and stderr captured together.

    .venv/bin/python bench/console_lines.py              # both; prints the figures
    .venv/bin/python bench/console_lines.py --only tune

A line counts as Ray's internals when it comes from Ray's own machinery rather than from raytrainer or
the user's code: its log prefixes (``(raylet)``, ``(TrainController``, ``(RayTrainWorker``, ...), Tune's
status tables and trial banners, and Ray's logger names.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

RAY_INTERNAL = re.compile(
    r"\((raylet|TrainController|RayTrainWorker|PlacementGroupCleaner|RaytrainerTrial|pid=|autoscaler|"
    r"TunerInternal|_Inner|ImplicitFunc)|\bray\.(tune|train|_private|util)\b|Trial status:|Trial \w+ "
    r"(started|completed|finished)|Current time: |Logical resource usage|Result\(|"
    r"Tune Status|TuneController|PreemptionWatcher|Reporting training result|╭|╰|│")

TUNE_SEARCH = textwrap.dedent('''
    import sys
    import torch
    from torch import nn
    from ray import tune
    from raytrainer import Trainer, TrainingArguments

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.linear = nn.Linear(8, 3)

        def forward(self, x, labels=None):
            logits = self.linear(x)
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    data = [{"x": x[i], "labels": int(i % 3)} for i in range(64)]
    args = TrainingArguments(output_dir=sys.argv[1], num_workers=2, max_steps=8, eval_strategy="steps",
                             eval_steps=4, save_strategy="no", per_device_train_batch_size=8,
                             report_to="none")
    trainer = Trainer(model_init=lambda trial: Net(), args=args, train_dataset=data, eval_dataset=data[:16])
    best = trainer.hyperparameter_search(hp_space=lambda _: {"learning_rate": tune.grid_search([0.1, 0.01])},
                                         n_trials=1, backend="ray", max_concurrent_trials=1)
    print("best run:", best.run_id, best.objective)
''')


_BAR = re.compile(r"^\s*\d+%\|")


def _as_a_terminal_keeps_them(text: str) -> list[str]:
    """The lines a terminal would show: a progress bar redrawn in place ("\r", or again after each line
    printed above it) is one line."""
    kept: list[str] = []
    for line in (part.rsplit("\r", 1)[-1] for part in text.split("\n")):
        if not line.strip():
            continue
        if _BAR.match(line) and kept and _BAR.match(kept[-1]):
            kept[-1] = line
        else:
            kept.append(line)
    return kept


def run(cmd: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    lines = _as_a_terminal_keeps_them(proc.stdout) + _as_a_terminal_keeps_them(proc.stderr)
    internal = [line for line in lines if RAY_INTERNAL.search(line)]
    return {"returncode": proc.returncode, "lines": len(lines), "ray_internal": len(internal),
            "seconds": time.monotonic() - started, "sample": internal[:8], "tail": lines[-5:], "all": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["demo", "tune"])
    parser.add_argument("--show", action="store_true", help="print every console line")
    opts = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="raytrainer-console-") as tmp:
        if opts.only in (None, "demo"):
            results["demo"] = run([sys.executable, "examples/train_digits.py", "--output_dir",
                                   os.path.join(tmp, "demo")])
        if opts.only in (None, "tune"):
            script = os.path.join(tmp, "tune_search.py")
            with open(script, "w") as f:
                f.write(TUNE_SEARCH)
            results["tune"] = run([sys.executable, script, os.path.join(tmp, "tune")])
    for name, r in results.items():
        print(f"{name}: exit {r['returncode']}, {r['lines']} console lines, {r['ray_internal']} of them "
              f"Ray's internals, {r['seconds']:.0f} s")
        for line in r["sample"]:
            print("   internal:", line[:160])
        for line in r["all"] if opts.show else r["tail"]:
            print("   |", line[:160])
    sys.exit(0 if all(r["returncode"] == 0 for r in results.values()) else 1)


if __name__ == "__main__":
    main()
