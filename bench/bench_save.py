#!/usr/bin/env python
"""raytrainer checkpoint-save benchmark: how long the training loop is blocked per save.

The same model (a deep MLP of ~25M float32 parameters, ~100 MB; with AdamW's two moments a full
checkpoint is ~300 MB) is trained for ``--saves`` x ``--save-steps`` steps on CPU with a save every
``--save-steps`` steps, three ways, each run in its own fresh process:

    hf         transformers.Trainer, output_dir local
    rt_local   raytrainer (num_workers=0), output_dir local (storage_path defaults to it)
    rt_remote  raytrainer (num_workers=0), storage_path="file://<another local folder>" standing in for
               remote storage: like any URI it takes raytrainer's remote path -- transformers' loop
               writes the checkpoint into output_dir (the model and optimizer files on a background
               thread where it can), then hashing and a pyarrow upload of each file on the commit's
               thread, the local copy removed after.

Blocking time is the wall time the training thread spends in checkpointing:

- hf: ``Trainer._save_checkpoint`` (model, optimizer, scheduler, RNG, trainer state, rotation).
- raytrainer (transformers' loop with the rank layer): ``Trainer._save_checkpoint`` (which first waits
  for the previous save's commit) plus every ``CommitCallback.wait`` outside it -- at each ``on_save``,
  and at the end of training, which waits for the last save's hashing (and upload) on the training
  thread.

Per run, blocking per save = total blocking time / number of saves; the table shows the median over
``--repeats`` runs (sides interleaved, order rotating). Bars (the issue): rt_remote <= 0.5x hf, and
rt_local <= 1.0x hf.

Usage:
    python bench/bench_save.py --quick                                  # smoke test, < 1 minute
    python bench/bench_save.py --repeats 3 --out /tmp/bench-save.json --md /tmp/bench-save.md

See bench/README.md (section "Checkpoint save benchmark").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MB = 1e6

SIDES = {
    "hf": "transformers.Trainer, local output_dir",
    "rt_local": "raytrainer, local output_dir",
    "rt_remote": "raytrainer, storage_path file:// (remote path: staging + pyarrow upload)",
}
DEFAULT_SIDES = ("hf", "rt_local", "rt_remote")
STORAGE_SIDES = ("rt_remote",)  # checkpoints under storage_dir, not output_dir
# (side, reference, bar): median blocking per save of side <= bar x reference's.
BARS = [("rt_remote", "hf", 0.5), ("rt_local", "hf", 1.0)]
HF_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json")
RT_FILES = (*HF_FILES, "training_args.json", "manifest.json")


# =====================================================================================================
# child: one training run in this process
# =====================================================================================================
def build_model(cfg: dict):
    import torch
    from torch import nn
    from torch.nn import functional as F

    class DeepMLP(nn.Module):
        """``depth`` square Linear layers of ``width`` (ReLU between), then a 10-way head."""

        def __init__(self, width: int, depth: int, n_classes: int = 10):
            super().__init__()
            layers = []
            for _ in range(depth):
                layers += [nn.Linear(width, width), nn.ReLU()]
            self.body = nn.Sequential(*layers)
            self.head = nn.Linear(width, n_classes)

        def forward(self, x, labels=None):
            logits = self.head(self.body(x))
            if labels is None:
                return {"logits": logits}
            return {"loss": F.cross_entropy(logits, labels), "logits": logits}

    torch.manual_seed(cfg["seed"])
    return DeepMLP(cfg["width"], cfg["depth"])


def build_dataset(cfg: dict):
    import torch
    from _common import DictDataset

    g = torch.Generator().manual_seed(cfg["seed"])
    n = cfg["batch_size"] * 8
    return DictDataset(x=torch.randn(n, cfg["width"], generator=g),
                       labels=torch.randint(0, 10, (n,), generator=g))


def common_args(cfg: dict) -> dict:
    """TrainingArguments fields that are the same for raytrainer and transformers."""
    return dict(
        output_dir=cfg["output_dir"],
        per_device_train_batch_size=cfg["batch_size"],
        max_steps=cfg["saves"] * cfg["save_steps"],
        learning_rate=1e-4,
        optim="adamw_torch",
        lr_scheduler_type="linear",
        save_strategy="steps",
        save_steps=cfg["save_steps"],
        save_only_model=False,
        eval_strategy="no",
        logging_strategy="steps",
        logging_steps=10**6,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        seed=cfg["seed"],
        use_cpu=True,
    )


class _Clock:
    """Blocking intervals of the training thread (a thread-local flag: no double counting)."""

    def __init__(self):
        self.local = threading.local()
        self.saves: list[dict] = []  # one per _save_checkpoint: {"step", "s", "wait_prev_s"}
        self.commits: list[dict] = []  # commits outside _save_checkpoint: {"step", "s", "pending"}
        self.background: list[dict] = []  # raytrainer's save thread: {"what", "s"}

    def inside(self) -> bool:
        return getattr(self.local, "inside", False)

    def timed_save(self, call, step: int):
        self.local.inside, self.local.wait_prev = True, 0.0
        t0 = time.perf_counter()
        try:
            return call()
        finally:
            self.saves.append({"step": step, "s": time.perf_counter() - t0,
                               "wait_prev_s": self.local.wait_prev})
            self.local.inside = False


def _instrument_raytrainer(clock: _Clock) -> None:
    import raytrainer.worker.hosted_commit as ckpt
    from raytrainer.storage import Storage

    wait, digest, upload = ckpt.CommitCallback.wait, ckpt.digest_files, Storage.upload_file
    step = {"n": 0}

    def on_save(self, args, state, control, **kwargs):  # which step a wait outside the save belongs to
        step["n"] = state.global_step
        return saved(self, args, state, control, **kwargs)

    saved = ckpt.CommitCallback.on_save

    def timed_wait(self):
        pending = self._thread is not None
        t0 = time.perf_counter()
        try:
            return wait(self)
        finally:
            dt = time.perf_counter() - t0
            if clock.inside():  # nested in save(): already in the _save_checkpoint interval
                clock.local.wait_prev += dt
            else:
                clock.commits.append({"step": step["n"], "s": dt, "pending": pending})

    def timed(fn, what):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock.background.append({"what": what, "s": time.perf_counter() - t0})
        return wrapper

    ckpt.CommitCallback.wait, ckpt.CommitCallback.on_save = timed_wait, on_save
    ckpt.digest_files = timed(digest, "hash")
    Storage.upload_file = timed(upload, "upload")


def run_child(cfg_path: str) -> None:
    with open(cfg_path) as f:
        cfg = json.load(f)
    import torch

    torch.set_num_threads(cfg["threads"])
    clock = _Clock()
    from _common import collate

    if cfg["side"] == "hf":
        import transformers

        class TimedTrainer(transformers.Trainer):
            def _save_checkpoint(self, *a, **k):
                return clock.timed_save(lambda: super(TimedTrainer, self)._save_checkpoint(*a, **k),
                                        self.state.global_step)

        args = transformers.TrainingArguments(report_to=[], **common_args(cfg))
    else:
        import raytrainer

        _instrument_raytrainer(clock)

        class TimedTrainer(raytrainer.Trainer):
            def _save_checkpoint(self, *a, **k):
                return clock.timed_save(lambda: super(TimedTrainer, self)._save_checkpoint(*a, **k),
                                        self.state.global_step)

        extra = {"storage_path": cfg["storage_path"]} if cfg.get("storage_path") else {}
        args = raytrainer.TrainingArguments(report_to="none", num_workers=0, **extra, **common_args(cfg))

    # Outside the timed train(): torch imports torch._dynamo (~2 s here) when the first optimizer is built;
    # transformers has imported it already, raytrainer has not. Warm it for both sides alike.
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    model = build_model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    trainer = TimedTrainer(model=model, args=args, train_dataset=build_dataset(cfg), data_collator=collate)
    t0 = time.perf_counter()
    out = trainer.train()
    wall = time.perf_counter() - t0
    record = {"side": cfg["side"], "n_params": n_params, "train_wall_s": wall, "global_step": out.global_step,
              "train_loss": out.training_loss, "saves": clock.saves, "commits": clock.commits,
              "background": clock.background, "torch_threads": torch.get_num_threads()}
    with open(cfg["result_path"], "w") as f:
        json.dump(record, f)


# =====================================================================================================
# driver
# =====================================================================================================
def verify(side: str, cfg: dict, run_dir: str, record: dict) -> dict:
    """Every expected checkpoint exists with its files (raytrainer: a matching manifest); fail loudly."""
    steps = [cfg["save_steps"] * (i + 1) for i in range(cfg["saves"])]
    root = cfg["storage_dir"] if side in STORAGE_SIDES else cfg["output_dir"]
    expected = HF_FILES if side == "hf" else RT_FILES
    problems, sizes = [], {}
    for step in steps:
        folder = os.path.join(root, f"checkpoint-{step}")
        if not os.path.isdir(folder):
            problems.append(f"{folder} is missing")
            continue
        present = {n: os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)}
        problems += [f"{folder}/{n} is missing" for n in expected if n not in present]
        sizes[f"checkpoint-{step}"] = sum(present.values())
        if side != "hf" and "manifest.json" in present:
            with open(os.path.join(folder, "manifest.json")) as f:
                manifest = json.load(f)
            if manifest.get("global_step") != step:
                problems.append(f"{folder}/manifest.json says global_step {manifest.get('global_step')}")
            for name, meta in manifest.get("files", {}).items():
                if present.get(name) != meta.get("size"):
                    problems.append(f"{folder}/{name}: {present.get(name)} bytes, manifest "
                                    f"{meta.get('size')}")
    if side == "rt_remote" and not any(b["what"] == "upload" for b in record["background"]):
        problems.append("no upload ran: the remote path was not taken")
    if side in STORAGE_SIDES:
        leftovers = [n for n in os.listdir(cfg["tmpdir"]) if n.startswith("raytrainer-checkpoint-")]
        problems += [f"staging folder left behind: {cfg['tmpdir']}/{n}" for n in leftovers]
        local = [n for n in os.listdir(cfg["output_dir"]) if n.startswith("checkpoint-")]
        problems += [f"checkpoint in the local output_dir instead of storage_path: {n}" for n in local]
    if problems:
        raise RuntimeError(f"side {side}: checkpoints are not as expected ({run_dir}):\n  "
                           + "\n  ".join(problems))
    return sizes


def blocking(record: dict) -> dict:
    saves = [s["s"] for s in record["saves"]]
    commits = [c["s"] for c in record["commits"]]
    total = sum(saves) + sum(commits)
    n = len(saves)
    final = record["commits"][-1]["s"] if record["commits"] and record["commits"][-1]["pending"] else 0.0
    return {"n_saves": n, "blocking_total_s": total, "blocking_per_save_s": total / n if n else None,
            "blocking_per_save_excl_final_commit_s": (total - final) / n if n else None,
            "save_call_median_s": statistics.median(saves) if saves else None,
            "save_call_max_s": max(saves) if saves else None,
            "wait_prev_total_s": sum(s.get("wait_prev_s", 0.0) for s in record["saves"]),
            "commit_outside_total_s": sum(commits), "final_commit_s": final}


def run_side(side: str, repeat: int, opts, workdir: str) -> dict:
    run_dir = tempfile.mkdtemp(prefix=f"{side}-r{repeat}-", dir=workdir)
    cfg = {"side": side, "seed": 42, "width": opts.width, "depth": opts.depth, "batch_size": opts.batch_size,
           "saves": opts.saves, "save_steps": opts.save_steps, "threads": opts.threads,
           "output_dir": os.path.join(run_dir, "out"), "tmpdir": os.path.join(run_dir, "tmp"),
           "storage_dir": os.path.join(run_dir, "remote"),
           "result_path": os.path.join(run_dir, "result.json")}
    if side in STORAGE_SIDES:
        cfg["storage_path"] = "file://" + cfg["storage_dir"]
    for key in ("output_dir", "tmpdir"):
        os.makedirs(cfg[key])
    cfg_path = os.path.join(run_dir, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update({
        "OMP_NUM_THREADS": str(opts.threads), "MKL_NUM_THREADS": str(opts.threads),
        "TMPDIR": cfg["tmpdir"],  # raytrainer's staging folders: same disk, checked for leftovers
        "PYTHONPATH": os.pathsep.join(p for p in (HERE, REPO, os.environ.get("PYTHONPATH")) if p),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
    })
    os.sync()  # earlier runs' dirty pages are written back before this run starts (untimed)
    log_path = os.path.join(run_dir, "log.txt")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", cfg_path], env=env,
                              stdout=log, stderr=subprocess.STDOUT, timeout=opts.timeout)
    process_wall = time.perf_counter() - t0
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"side {side} (repeat {repeat}) exited with {proc.returncode}; kept "
                           f"{run_dir}\n{tail}")
    with open(cfg["result_path"]) as f:
        record = json.load(f)
    sizes = verify(side, cfg, run_dir, record)
    record.update(blocking(record), repeat=repeat, process_wall_s=process_wall,
                  checkpoint_mb=statistics.median(sizes.values()) / MB)
    if not opts.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return record


def machine_info(workdir: str) -> dict:
    from _machine import machine_info as common

    fs = None
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        best = ""
        real = os.path.realpath(workdir)
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fs = mnt, f"{fstype} on {dev} ({mnt})"
    return {**common(REPO), "workdir_filesystem": fs}


def summarize(runs: list[dict]) -> dict:
    out = {}
    for side in SIDES:
        rs = [r for r in runs if r["side"] == side]
        if not rs:
            continue

        def med(key, rs=rs):
            vals = [r[key] for r in rs if r.get(key) is not None]
            return statistics.median(vals) if vals else None

        out[side] = {k: med(k) for k in ("blocking_per_save_s", "blocking_per_save_excl_final_commit_s",
                                         "blocking_total_s", "save_call_median_s",
                                         "save_call_max_s", "wait_prev_total_s", "commit_outside_total_s",
                                         "final_commit_s", "train_wall_s", "process_wall_s", "checkpoint_mb")}
        out[side]["runs"] = len(rs)
        bg = [b for r in rs for b in r.get("background", [])]
        for what in ("hash", "upload"):
            vals = [b["s"] for b in bg if b["what"] == what]
            out[side][f"background_{what}_median_s"] = statistics.median(vals) if vals else None
    return out


def bars(summary: dict) -> list[dict]:
    out = []
    for side, ref, bar in BARS:
        if side not in summary or ref not in summary:
            continue
        value, base = summary[side]["blocking_per_save_s"], summary[ref]["blocking_per_save_s"]
        ratio = value / base if base else None
        out.append({"side": side, "reference": ref, "bar": bar, "ratio": ratio,
                    "passed": ratio is not None and ratio <= bar})
    return out


def _f(v, digits=3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def markdown(summary: dict, lines_: list[dict], info: dict, opts, n_params: int | None) -> str:
    ref = summary.get("hf", {}).get("blocking_per_save_s")
    lines = [
        f"Date: {info['date']}  ",
        f"Machine: {info['cpu']}, nproc {info['nproc']}, {info['memory_gib']} GiB RAM, {info['os']}; "
        f"workdir on {info['workdir_filesystem']}  ",
        f"Software: Python {info['python']}, torch {info['torch']}, transformers {info['transformers']}, "
        f"pyarrow {info['pyarrow']}, safetensors {info['safetensors']}, "
        f"raytrainer {info['raytrainer_commit']}  ",
        f"Load average: start {info['load_average_at_start']}, end {info.get('load_average_at_end')}  ",
        f"Model: {opts.depth}+1 Linear layers of width {opts.width}, {n_params or 0:,} float32 parameters "
        f"({(n_params or 0) * 4 / MB:.0f} MB), AdamW (`adamw_torch`), `save_only_model=False`; batch "
        f"{opts.batch_size}, {opts.saves} saves every {opts.save_steps} steps, {opts.threads} torch "
        f"thread(s); medians over {opts.repeats} repeat(s), sides interleaved.  ",
        "The OS page cache is warm and write-back is asynchronous for all sides alike (no fsync by any side; "
        "`sync` before each run, untimed). rt_remote: storage_path file://, which raytrainer treats as "
        "remote (local staging; serialisation, hashing and a pyarrow copy in the background thread).",
        "",
        "| side | median blocking s per save | ratio to transformers | median total wall s (train) "
        "| checkpoint MB | final commit s (total) |",
        "|---|---|---|---|---|---|",
    ]
    for side, label in SIDES.items():
        s = summary.get(side)
        if s is None:
            continue
        value = s["blocking_per_save_s"]
        ratio = "-" if not ref or value is None else f"{value / ref:.2f}x"
        lines.append(f"| {side}: {label} | {_f(value)} | {ratio} | {_f(s['train_wall_s'], 2)} "
                     f"| {_f(s['checkpoint_mb'], 0)} | {_f(s['final_commit_s']) if side != 'hf' else '-'} |")
    lines.append("")
    for b in lines_:
        lines.append(f"- {'PASS' if b['passed'] else 'FAIL'}: {b['side']} blocking per save "
                     f"{_f(b['ratio'], 2)}x of {b['reference']} (bar <= {b['bar']}x)")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="~2M parameters, 2 saves, 1 repeat (smoke test)")
    p.add_argument("--sides", default=",".join(DEFAULT_SIDES), help=f"of {','.join(SIDES)}")
    p.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    p.add_argument("--width", type=int, default=None, help="default 1024 (512 with --quick)")
    p.add_argument("--depth", type=int, default=None, help="square layers; default 24 (8 with --quick)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--saves", type=int, default=None, help="default 5 (2 with --quick)")
    p.add_argument("--save-steps", type=int, default=None, help="default 10 (3 with --quick)")
    p.add_argument("--threads", type=int, default=1, help="torch / OMP threads in each run (default 1)")
    p.add_argument("--workdir", default=None, help="parent of the per-run folders (default: new /tmp folder)")
    p.add_argument("--keep", action="store_true", help="keep the per-run folders")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--md", default=None, help="also write the Markdown table here")
    opts = p.parse_args(argv)
    quick = {"repeats": 1, "width": 512, "depth": 8, "saves": 2, "save_steps": 3}
    full = {"repeats": 3, "width": 1024, "depth": 24, "saves": 5, "save_steps": 10}
    for key, value in (quick if opts.quick else full).items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    opts.sides = [s for s in opts.sides.split(",") if s]
    unknown = set(opts.sides) - set(SIDES)
    if unknown:
        p.error(f"unknown sides {sorted(unknown)}; choose from {list(SIDES)}")
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.child:
        run_child(opts.child)
        return 0
    own_workdir = opts.workdir is None
    workdir = tempfile.mkdtemp(prefix="bench-save-") if own_workdir else opts.workdir
    os.makedirs(workdir, exist_ok=True)
    info = machine_info(workdir)
    runs, ok = [], False
    try:
        for repeat in range(opts.repeats):
            k = repeat % len(opts.sides)
            for side in opts.sides[k:] + opts.sides[:k]:  # rotating order
                r = run_side(side, repeat, opts, workdir)
                print(f"[repeat {repeat}] {side}: blocking {r['blocking_per_save_s']:.3f} s/save "
                      f"(saves {[round(s['s'], 3) for s in r['saves']]}, outside commits "
                      f"{[round(c['s'], 3) for c in r['commits'] if c['pending']]}), "
                      f"train wall {r['train_wall_s']:.2f} s, checkpoint {r['checkpoint_mb']:.0f} MB",
                      flush=True)
                runs.append(r)
        ok = True
    finally:
        if ok and own_workdir and not opts.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not ok:
            print(f"failed; kept {workdir}", file=sys.stderr)
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    summary = summarize(runs)
    lines_ = bars(summary)
    n_params = runs[0]["n_params"] if runs else None
    md = markdown(summary, lines_, info, opts, n_params)
    print()
    print(md)
    result = {"machine": info, "options": {k: v for k, v in vars(opts).items() if k != "child"},
              "n_params": n_params, "summary": summary, "bars": lines_, "runs": runs}
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(result, f, indent=1)
    if opts.md:
        with open(opts.md, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
