"""Submit overhead: the demo run directly vs submitted with `raytrainer submit` to a local Ray head.

    python bench/bench_submit.py [--repeats 2] [--out results.json]

Sides (each a fresh process, in rotating order):
  direct   python examples/train_digits.py ...           (starts its own local Ray instance, as users do)
  submit   raytrainer submit --working-dir examples -- python train_digits.py ...
           to a Ray head already running (cluster/local-multinode.sh up 1, token auth, dashboard), as on a
           cluster: the head's start is not counted.
Both train the demo (2 workers, 8 epochs, logging every step). "first step" is the time from launching
the side's command to the first training log line (step 1) in its output; "wall" until the command exits.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _machine import machine_info  # noqa: E402

DEMO_ARGS = ["--disable_tqdm", "true", "--logging_steps", "1", "--num_workers", "2"]


def timed(cmd: list[str], env: dict, cwd: str) -> dict:
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    first, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if first is None and line.startswith("{'loss'"):
            first = time.monotonic() - start
    code = proc.wait()
    wall = time.monotonic() - start
    if code != 0 or first is None:
        raise RuntimeError(f"{cmd[:4]} exited {code}:\n{''.join(lines[-30:])}")
    return {"first_step_s": round(first, 2), "wall_s": round(wall, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out")
    opts = parser.parse_args()
    python = sys.executable
    state = tempfile.mkdtemp(prefix="rt-bench-", dir="/tmp")
    token = secrets.token_hex(16)
    cluster_env = {**os.environ, "RAY_MN_STATE": state, "RAY_MN_IP_START": "31", "RAY_MN_CPUS": "3",
                   "RAY_MN_WORKER_PORT_BASE": "29000", "RAY_MN_DASHBOARD": "true",
                   "RAY_MN_AUTH_MODE": "token",
                   "RAY_AUTH_TOKEN": token, "RAY_MN_VENV": os.path.dirname(os.path.dirname(python))}
    script = os.path.join(REPO, "cluster", "local-multinode.sh")
    subprocess.run(["bash", script, "up", "1"], env=cluster_env, check=True, capture_output=True)
    results: dict[str, list[dict]] = {"direct": [], "submit": []}
    try:
        with open(os.path.join(state, "dashboard")) as f:
            dashboard = f.read().strip()
        base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH_TOKEN"))}
        base.update(OMP_NUM_THREADS="1")
        for i in range(opts.repeats):
            order = ["direct", "submit"] if i % 2 == 0 else ["submit", "direct"]
            for side in order:
                out = tempfile.mkdtemp(prefix=f"rt-bench-{side}-")
                if side == "direct":
                    cmd = [python, "examples/train_digits.py", "--output_dir", out, *DEMO_ARGS]
                    env = {**base, "RAY_AUTH_MODE": "disabled"}
                else:
                    cmd = [python, "-m", "raytrainer.cli", "submit", "--address", dashboard, "--working-dir",
                           "examples", "--", "python", "train_digits.py", "--output_dir", out, *DEMO_ARGS]
                    env = {**base, "RAY_AUTH_TOKEN": token}
                results[side].append(timed(cmd, env, REPO))
                print(side, results[side][-1], flush=True)
    finally:
        subprocess.run(["bash", script, "down"], env=cluster_env, capture_output=True)
    summary = {side: {k: statistics.median(r[k] for r in runs) for k in ("first_step_s", "wall_s")}
               for side, runs in results.items()}
    overhead = summary["submit"]["first_step_s"] - summary["direct"]["first_step_s"]
    summary["overhead_first_step_s"] = round(overhead, 2)
    report = {"machine": machine_info(REPO), "runs": results, "median": summary}
    print(json.dumps(report["median"], indent=1))
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
