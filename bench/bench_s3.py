"""Checkpoints in an S3 bucket: what each rank reads on resume, and how fast a bad storage_path is reported.

Runs against the test suite's S3 server (moto in a subprocess, tests/s3server.py), which attributes every
request to the process that made it. Two parts:

1. The driver's storage check (``Storage.check_writable``) against pyarrow's default client doing the same
   write, for a reachable bucket, a missing bucket and a refused endpoint: seconds to an answer (medians).
2. FSDP on 2 Ray workers: train and save to the bucket, then resume from the ``s3://`` checkpoint into a
   fresh output_dir; per rank, the requests and bytes it fetched, by file, against the checkpoint's files.

    python bench/bench_s3.py [--hidden 1024] [--repeats 3] [--md out.md]

Not a test: nothing asserts (tests/integration/test_s3.py does, on a smaller model).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import torch  # noqa: E402

from raytrainer import Trainer, TrainerCallback, TrainingArguments  # noqa: E402


class Wide(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        torch.manual_seed(0)
        layers = [torch.nn.Linear(64, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden),
                  torch.nn.Tanh(), torch.nn.Linear(hidden, 10)]
        self.net = torch.nn.Sequential(*layers)

    def forward(self, x, labels=None):
        logits = self.net(x)
        return torch.nn.functional.cross_entropy(logits, labels), logits


class RecordPid(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        with open(os.path.join(args.output_dir, f"pid-rank{args.process_index}"), "w") as f:
            f.write(str(os.getpid()))


def data(n: int = 256):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 64, generator=g)
    return [{"x": x[i], "labels": int(x[i, :10].argmax())} for i in range(n)]


def check_latency(server, repeats: int) -> list[tuple[str, float, float]]:
    import pyarrow.fs as pafs

    from raytrainer.storage import Storage

    server.create_bucket("bench-check")
    cases = [("reachable bucket", "s3://bench-check/run", server.endpoint),
             ("missing bucket", "s3://no-such-bucket-bench/run", server.endpoint),
             ("refused endpoint", "s3://bench-check/run", "http://127.0.0.1:9")]
    rows = []
    for name, uri, endpoint in cases:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        ours, default = [], []
        for _ in range(repeats):
            started = time.monotonic()
            try:
                Storage.from_uri(uri).check_writable()
            except ValueError:
                pass
            ours.append(time.monotonic() - started)
            started = time.monotonic()
            try:
                fs, path = pafs.FileSystem.from_uri(uri)
                with fs.open_output_stream(path + "/marker") as f:
                    f.write(b"ok")
            except OSError:
                pass
            default.append(time.monotonic() - started)
        rows.append((name, statistics.median(ours), statistics.median(default)))
    os.environ["AWS_ENDPOINT_URL"] = server.endpoint
    return rows


def resume_reads(server, hidden: int, work: str):
    from raytrainer.driver.ray_runtime import ensure_ray

    server.create_bucket("bench-resume")
    uri = "s3://bench-resume/runs/fsdp"
    base = {"num_workers": 2, "per_device_train_batch_size": 16, "max_steps": 6, "learning_rate": 1e-3,
            "optim": "adamw_torch", "save_strategy": "steps", "save_steps": 4, "disable_tqdm": True,
            "report_to": "none", "log_level": "warning", "fsdp": "full_shard auto_wrap",
            "fsdp_config": {"transformer_layer_cls_to_wrap": ["Linear"]}}
    ensure_ray(TrainingArguments(output_dir=work, num_workers=2))  # the workers inherit the S3 settings
    Trainer(model=Wide(hidden), args=TrainingArguments(output_dir=os.path.join(work, "a"), storage_path=uri,
                                                       **base), train_dataset=data()).train()
    files = {k.rsplit("checkpoint-4/", 1)[1]: size for k, size in server.list_objects("bench-resume").items()
             if "/checkpoint-4/" in k and not k.endswith("/")}
    server.clear_requests()
    fresh = os.path.join(work, "b")
    started = time.monotonic()
    Trainer(model=Wide(hidden), args=TrainingArguments(output_dir=fresh, **{**base, "save_strategy": "no"}),
            train_dataset=data(), callbacks=[RecordPid()]).train(resume_from_checkpoint=f"{uri}/checkpoint-4")
    elapsed = time.monotonic() - started
    pids = {int(open(os.path.join(fresh, f"pid-rank{r}")).read()): r for r in (0, 1)}  # noqa: SIM115
    per_rank = {r: {"requests": 0, "bytes": defaultdict(int)} for r in (0, 1)}
    for req in server.requests():
        rank = pids.get(req["pid"])
        if rank is None:
            continue
        per_rank[rank]["requests"] += 1
        if req["method"] == "GET" and req["key"] and "/checkpoint-4/" in req["key"]:
            per_rank[rank]["bytes"][req["key"].rsplit("checkpoint-4/", 1)[1]] += req["bytes_out"]
    return files, per_rank, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--md", default=None)
    opts = parser.parse_args()
    from s3server import S3Server

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    lines = []
    with S3Server() as server, tempfile.TemporaryDirectory(prefix="bench-s3-") as work:
        os.environ.update(server.env)
        lines += ["| storage_path | raytrainer's check (s) | pyarrow's default client, one write (s) |",
                  "|---|---|---|"]
        for name, ours, default in check_latency(server, opts.repeats):
            lines.append(f"| {name} | {ours:.2f} | {default:.2f} |")
        files, per_rank, elapsed = resume_reads(server, opts.hidden, work)
        total = sum(files.values())
        lines += ["", f"Checkpoint files ({total / 2**20:.2f} MiB in all): "
                  + ", ".join(f"`{n}` {s / 2**20:.2f} MiB" for n, s in sorted(files.items())), "",
                  f"Resume from the bucket on 2 FSDP workers took {elapsed:.1f} s (whole train() call).", "",
                  "| rank | requests | MiB read | own DCP file | other rank's DCP file | model.safetensors |",
                  "|---|---|---|---|---|---|"]
        for rank in (0, 1):
            got = per_rank[rank]["bytes"]
            own = got.get(f"optimizer_0/__{rank}_0.distcp", 0) / files[f"optimizer_0/__{rank}_0.distcp"]
            other_name = f"optimizer_0/__{1 - rank}_0.distcp"
            other = got.get(other_name, 0) / files[other_name]
            model = got.get("model.safetensors", 0) / files["model.safetensors"]
            lines.append(f"| {rank} | {per_rank[rank]['requests']} | {sum(got.values()) / 2**20:.2f} | "
                         f"{own:.0%} | {other:.1%} | {model:.0%} |")
    text = "\n".join(lines)
    print(text)
    if opts.md:
        with open(opts.md, "w") as f:
            f.write(text + "\n")
    import ray

    ray.shutdown()


if __name__ == "__main__":
    main()
