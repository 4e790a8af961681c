#!/usr/bin/env python
"""raytrainer core benchmark: the same training run, side by side, each side in its own fresh process.

Workloads: an MLP classifier on sklearn's digits and a tiny BERT sequence classifier (from a config,
synthetic data). Sides:

    a       a hand-written PyTorch loop (1 process)
    b       raytrainer num_workers=0 (in the script's own process)
    c       raytrainer num_workers=1 (Ray started by the script)
    d       raytrainer num_workers=2 (Ray started by the script)
    d_warm  raytrainer num_workers=2 on a Ray instance that is already running (started by this driver)
    d_warm_nokeep  d_warm with keep_workers_s=0: the group the driver's own (no keeper, no early start)
    d_second  d_warm's script run a second time on that instance: the workers the first run left
            (``keep_workers_s``, driver/keeper.py); the first run is not measured
    e       transformers.Trainer, 1 process
    f       transformers.Trainer under torchrun, 2 processes (gloo)
    b@NAME  (also c@NAME, d@NAME, d_warm@NAME) that side, with raytrainer imported from the checkout given
            as ``--tree NAME=PATH`` (a ``git archive`` of another commit): a before/after in one run

Every side uses fused torch AdamW, a linear schedule without warmup, the same data, model, collator and
batch size per process, no evaluation, no checkpoints, logging every 50 steps, OMP_NUM_THREADS=1.

Usage:
    python bench/bench_core.py --quick --out /tmp/bench-quick.json          # smoke test, 10-15 min here
    python bench/bench_core.py --repeats 3 --out /tmp/bench-results.json --md /tmp/bench-results.md

See bench/README.md for what each column means.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MiB = 1024 * 1024

SIDES = {
    "a": "plain PyTorch loop",
    "b": "raytrainer, num_workers=0",
    "c": "raytrainer, num_workers=1",
    "d": "raytrainer, num_workers=2",
    "d_warm": "raytrainer, num_workers=2, Ray already running",
    "d_second": "raytrainer, num_workers=2, the second run on a running Ray",
    "d_warm_nokeep": "raytrainer, num_workers=2, Ray already running, keep_workers_s=0",
    "e": "transformers.Trainer, 1 process",
    "f": "transformers.Trainer, torchrun 2 processes",
}
HF_SIDES = ("e", "f")
WORLD = {"a": 1, "b": 1, "c": 1, "d": 2, "d_warm": 2, "d_second": 2, "d_warm_nokeep": 2, "e": 1, "f": 2}

# The performance lines of the issue: (workloads, side, reference, metric, bar, higher_is_better).
BARS = [
    (("mlp", "bert"), "b", "a", "samples_per_s", 0.95, True),
    (("mlp", "bert"), "c", "a", "samples_per_s", 0.95, True),
    (("bert",), "d", "f", "samples_per_s", 1.0, True),
    (("mlp", "bert"), "d", "f", "time_to_first_step_s", 1.5, False),
    (("mlp", "bert"), "d_warm", "f", "time_to_first_step_s", 1.5, False),  # issue 57: a first run there
    (("mlp", "bert"), "d_second", "f", "time_to_first_step_s", 0.5, False),
    (("mlp", "bert"), "d", "f", "peak_tree_rss_mib", 1.5, False),
    (("mlp", "bert"), "d_warm", "f", "peak_tree_rss_mib", 1.5, False),
]


# -- configuration ---------------------------------------------------------------------------------
def workload_configs(opts, workdir: str) -> dict[str, dict]:
    common = {"batch_size": 32, "lr": 1e-3, "prepare_s": opts.prepare_s}
    mlp = {**common, "workload": "mlp", "epochs": opts.mlp_epochs,
           "digits_path": os.path.join(workdir, "digits.npz")}
    bert = {**common, "workload": "bert", "epochs": opts.bert_epochs, "examples": opts.bert_examples,
            "vocab_size": 1000, "seq_len": 64}
    return {"mlp": mlp, "bert": bert}


def child_env(extra: dict | None = None, tree: str | None = None) -> dict:
    """A side's environment; ``tree``: a checkout whose raytrainer the side (and its Ray workers, which
    inherit the environment) imports instead of this one's."""
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "BENCH_T0", "BENCH_OUT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                "MASTER_PORT"):
        env.pop(key, None)
    env.update({
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (HERE, tree, REPO, os.environ.get("PYTHONPATH")) if p),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
    })
    env.update(extra or {})
    return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# -- memory sampling -----------------------------------------------------------------------------------
_PAGE = os.sysconf("SC_PAGE_SIZE")
_TICKS = os.sysconf("SC_CLK_TCK")


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def _stat(pid: int) -> tuple[int, float, int] | None:
    """(parent pid, user + system CPU seconds, start time in ticks) from /proc/<pid>/stat."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS, int(fields[19])


def _rss_bytes(pid: int) -> int | None:
    text = _read(f"/proc/{pid}/statm")
    return None if text is None else int(text.split()[1]) * _PAGE


def _pss_bytes(pid: int) -> int | None:
    text = _read(f"/proc/{pid}/smaps_rollup")
    for line in (text or "").splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return None


def _short_name(pid: int) -> str:
    """A readable name: Ray's process titles (``ray::RayTrainWorker``) as they are, else the program and
    its script or module."""
    cmd = [c for c in (_read(f"/proc/{pid}/cmdline") or "").split("\0") if c]
    if not cmd:
        return (_read(f"/proc/{pid}/comm") or "?").strip()
    if len(cmd) == 1 or not os.path.basename(cmd[0]).startswith("python"):
        return " ".join(cmd)[:60] if " " in cmd[0] or len(cmd) == 1 else os.path.basename(cmd[0])
    for i, arg in enumerate(cmd[1:], 1):
        if arg in ("-m", "-c") and i + 1 < len(cmd):
            return f"python {arg} {cmd[i + 1][:50]}"
        if not arg.startswith("-"):  # a script: name it and its first argument (a config, a subcommand)
            rest = [os.path.basename(a) for a in cmd[i + 1:i + 2] if not a.startswith("-")]
            return " ".join([os.path.basename(arg), *rest])
    return os.path.basename(cmd[0])


class TreeSampler(threading.Thread):
    """Samples the RSS of every process under ``roots`` (recursively) every ``interval`` seconds.

    Kept cheap, since it shares the CPUs with the run: RSS comes from /proc/<pid>/statm; new descendants
    are looked for (a scan of every /proc/<pid>/stat) every ``scan_every`` samples, which also reads CPU
    times; names every ``names_every`` samples. With ``pss_every`` > 0, PSS (shared pages divided among
    the processes sharing them: a sum of RSS counts libtorch's shared pages once per process) is read
    every ``pss_every`` samples; it costs the kernel a page-table walk per process (~5 ms each here). A
    process once seen stays sampled until it exits, even when re-parented (Ray's daemons).
    """

    def __init__(self, roots: list[int], interval: float, scan_every: int = 4, names_every: int = 20,
                 pss_every: int = 0):
        super().__init__(daemon=True, name="bench-sampler")
        self.roots = roots
        self.interval = interval
        self.scan_every = scan_every
        self.names_every = names_every
        self.pss_every = pss_every
        self.seen: dict[int, int] = {}  # pid -> start time (ticks), to tell a reused pid apart
        self.names: dict[int, str] = {}
        self.cpu_s: dict[int, float] = {}  # user + system CPU seconds per process, as last read
        self.cpu_timeline: list[tuple[float, dict[int, float]]] = []  # (time.time(), each process's so far)
        self.peak_tree_rss = 0
        self.peak_tree_pss = 0
        self.peak_proc_rss = 0
        self.peak_proc_pid: int | None = None
        self.at_peak: list[tuple[int, float]] = []  # (pid, RSS MiB) in the sample with the peak total
        self.max_procs = 0
        self.samples = 0
        self._stop_event = threading.Event()

    def scan(self) -> None:
        """Add the descendants of the roots; refresh CPU times; forget processes that have exited."""
        children: dict[int, list[int]] = {}
        stats = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                st = _stat(int(entry))
                if st is not None:
                    stats[int(entry)] = st
                    children.setdefault(st[0], []).append(int(entry))
        todo = [pid for pid in self.roots if pid in stats]
        while todo:
            pid = todo.pop()
            if self.seen.get(pid) != stats[pid][2]:
                self.seen[pid] = stats[pid][2]
            todo.extend(children.get(pid, ()))
        for pid in list(self.seen):
            if pid not in stats or stats[pid][2] != self.seen[pid]:
                del self.seen[pid]
            else:
                self.cpu_s[pid] = stats[pid][1]
        self.cpu_timeline.append((time.time(), dict(self.cpu_s)))

    def _cpu_snapshot(self, when: float) -> dict[int, float] | None:
        """Each process's CPU seconds at the first scan at or after ``when`` (None past the last)."""
        return next((cpu for t, cpu in self.cpu_timeline if t >= when), None)

    def cpu_at(self, when: float) -> float | None:
        """The tree's CPU seconds up to ``when``."""
        snap = self._cpu_snapshot(when)
        return None if snap is None else sum(snap.values())

    def cpu_by_process_at(self, when: float) -> list[tuple[str, float]]:
        """Each process's CPU seconds up to ``when``, by name, the busiest first."""
        snap = self._cpu_snapshot(when) or {}
        return sorted(((self.name(pid), round(cpu, 2)) for pid, cpu in snap.items()), key=lambda r: -r[1])

    def sample(self) -> None:
        if self.samples % self.scan_every == 0:
            self.scan()
        names = self.samples % self.names_every == 0
        pss = self.pss_every > 0 and self.samples % self.pss_every == 0
        total, pss_total, sizes = 0, 0, []
        for pid in list(self.seen):
            rss = _rss_bytes(pid)
            if rss is None:
                continue
            total += rss
            sizes.append((pid, rss))
            if rss > self.peak_proc_rss:
                self.peak_proc_rss, self.peak_proc_pid = rss, pid
            if pss:
                pss_total += _pss_bytes(pid) or 0
            if names:
                self.names[pid] = _short_name(pid)  # Ray workers take their actor's name after start
        if total > self.peak_tree_rss:
            self.peak_tree_rss = total
            self.at_peak = sorted(((pid, rss / MiB) for pid, rss in sizes), key=lambda item: -item[1])
        self.peak_tree_pss = max(self.peak_tree_pss, pss_total)
        self.max_procs = max(self.max_procs, len(sizes))
        self.samples += 1

    def run(self) -> None:
        while not self._stop_event.is_set():
            t = time.perf_counter()
            self.sample()
            self._stop_event.wait(max(0.0, self.interval - (time.perf_counter() - t)))

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.scan()  # final CPU times of what is still alive

    def name(self, pid: int | None) -> str:
        if pid not in self.names and pid is not None:
            self.names[pid] = _short_name(pid)
        return self.names.get(pid, "?")

    def alive(self) -> list[psutil.Process]:
        procs = []
        for pid, start in self.seen.items():
            st = _stat(pid)
            if st is not None and st[2] == start:
                with contextlib.suppress(psutil.Error):
                    procs.append(psutil.Process(pid))
        return procs


def kill_procs(procs: list[psutil.Process], grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds: only the processes given (ours, by PID)."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)


# -- a Ray instance that is already running (side d_warm) ------------------------------------------------
class RayHead:
    """`ray start --head --block` in its own session (127.0.0.2: Ray rewrites 127.0.0.1 here); stopped by
    signalling the processes of that session only (Ray workers change their process group, not session)."""

    def __init__(self, workdir: str, settle_s: float, tree: str | None = None):
        self.workdir = workdir
        self.settle_s = settle_s
        self.tree = tree  # a --tree checkout: the head's workers import its raytrainer, as the side does
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None

    def start(self, timeout: float = 180.0) -> None:
        ip = "127.0.0.2"
        port = free_port(ip)
        temp_dir = tempfile.mkdtemp(prefix="rbh", dir="/tmp")  # short: Ray's socket paths have a limit
        self.log_path = os.path.join(self.workdir, "logs", f"ray-head-{port}.log")
        ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
        cmd = [ray_bin, "start", "--head", "--block", f"--node-ip-address={ip}", f"--port={port}",
               "--num-cpus=2", "--num-gpus=0", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
               f"--dashboard-port={free_port()}", f"--dashboard-agent-listen-port={free_port(ip)}",
               f"--temp-dir={temp_dir}", "--disable-usage-stats"]
        env = child_env({"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
                         "RAY_DEDUP_LOGS": "0"}, self.tree)
        self.temp_dir = temp_dir
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.workdir)
        deadline = time.time() + timeout
        while True:
            with open(self.log_path) as f:
                if "block forever" in f.read():
                    break
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"the Ray head did not start; see {self.log_path}")
            time.sleep(0.25)
        self.address = f"{ip}:{port}"
        time.sleep(self.settle_s)  # "already running": let its start-up work finish

    def session_procs(self) -> list[psutil.Process]:
        if self.proc is None:
            return []
        out = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if os.getsid(p.pid) == self.proc.pid:
                    out.append(p)
        return out

    def usage(self) -> tuple[int, float]:
        """RSS bytes and CPU seconds used so far, summed over the head's processes."""
        rss, cpu = 0, 0.0
        for p in self.session_procs():
            with contextlib.suppress(psutil.Error):
                rss += p.memory_info().rss
                times = p.cpu_times()
                cpu += times.user + times.system
        return rss, cpu

    def stop(self) -> None:
        if self.proc is None:
            return
        kill_procs(self.session_procs(), grace=15.0)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=5)
        shutil.rmtree(getattr(self, "temp_dir", ""), ignore_errors=True)
        self.proc = None


# -- one side, one run -------------------------------------------------------------------------------------
def side_command(side: str, cfg_path: str) -> list[str]:
    py = sys.executable
    if side == "a":
        return [py, os.path.join(HERE, "_side_plain.py"), cfg_path]
    if side == "e":
        return [py, os.path.join(HERE, "_side_hf.py"), cfg_path]
    if side == "f":
        return [py, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
                "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                os.path.join(HERE, "_side_hf.py"), cfg_path]
    return [py, os.path.join(HERE, "_side_raytrainer.py"), cfg_path]


def steady_state(record: dict) -> tuple[float | None, float | None, int]:
    """Global samples/s between the end of step k0 (10% of the steps, at least 5) and the last step; and
    the same from the median step time of that stretch (less sensitive to a busy machine)."""
    ends = record["step_ends"]
    n = len(ends)
    k0 = max(5, math.ceil(0.1 * n))
    if n <= k0:
        return None, None, k0
    per_step = record["per_device_batch_size"] * record["world_size"]
    durations = [b - a for a, b in zip(ends[k0 - 1:], ends[k0:])]
    return (n - k0) * per_step / (ends[-1] - ends[k0 - 1]), per_step / statistics.median(durations), k0


def run_side(workload: str, cfg: dict, side: str, repeat: int, opts, workdir: str) -> dict:
    tag = f"{workload}-{side.replace('@', '-at-')}-r{repeat}"
    side, _, tree = side.partition("@")  # "d@before": side d, raytrainer from --tree before=PATH
    label = f"{side}@{tree}" if tree else side
    out_path = os.path.join(workdir, f"{tag}.json")
    log_path = os.path.join(workdir, "logs", f"{tag}.log")
    cfg = {**cfg, "output_dir": os.path.join(workdir, "out", tag),
           "num_workers": 0 if side in ("a", "b", "e", "f") else WORLD[side],
           **({"keep_workers_s": 0} if side == "d_warm_nokeep" else {})}
    head = None
    result: dict = {"workload": workload, "side": label, "repeat": repeat, "log": log_path}
    try:
        if side in ("d_warm", "d_second", "d_warm_nokeep"):
            head = RayHead(workdir, opts.warm_settle, opts.trees.get(tree))
            head.start()
            cfg["ray_address"] = head.address
        cfg_path = os.path.join(workdir, f"{tag}.config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        cmd = side_command(side, cfg_path)
        if side == "d_second":  # the first run, not measured: it leaves its workers for this one
            with open(log_path.replace(".log", "-first.log"), "w") as log:
                first = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       cwd=workdir, timeout=opts.timeout, env=child_env(
                                           {"BENCH_T0": repr(time.time()), "BENCH_OUT": out_path + ".first"},
                                           opts.trees.get(tree)))
            result["first_run_rc"] = first.returncode
        if head is not None:
            idle_rss, head_cpu_before = head.usage()
            result["ray_head_idle_rss_mib"] = idle_rss / MiB
        with open(log_path, "w") as log:
            t0 = time.time()
            env = child_env({"BENCH_T0": repr(t0), "BENCH_OUT": out_path}, opts.trees.get(tree))
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=workdir)
            roots = [proc.pid] + ([head.proc.pid] if head else [])
            pss_every = max(1, round(2.0 / opts.sample_interval)) if opts.pss else 0
            sampler = TreeSampler(roots, opts.sample_interval, pss_every=pss_every)
            sampler.start()
            try:
                rc = proc.wait(timeout=opts.timeout)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            wall = time.time() - t0
            sampler.stop()
        head_pids = {q.pid for q in head.session_procs()} if head else set()
        own = [p for p in sampler.alive() if p.pid not in head_pids]
        if own:  # processes of this run that outlived it: give them a moment, then stop them
            t_exit = time.time()
            _, own = psutil.wait_procs(own, timeout=opts.leftover_grace)
            result["exit_lag_s"] = time.time() - t_exit
            if own:
                result["leftover_processes"] = [sampler.name(p.pid) for p in own]
                kill_procs(own)
        result.update(rc=rc, wall_s=wall, peak_tree_rss_mib=sampler.peak_tree_rss / MiB,
                      peak_tree_pss_mib=sampler.peak_tree_pss / MiB if opts.pss else None,
                      peak_proc_rss_mib=sampler.peak_proc_rss / MiB,
                      peak_proc_name=sampler.name(sampler.peak_proc_pid),
                      max_processes=sampler.max_procs, memory_samples=sampler.samples,
                      tree_cpu_s=sum(sampler.cpu_s.values()) - (head_cpu_before if head else 0.0),
                      rss_at_peak_mib=[[sampler.name(pid), round(mib, 1)] for pid, mib in sampler.at_peak])
        if rc == 0 and os.path.exists(out_path):
            with open(out_path) as f:
                record = json.load(f)
            sps, sps_median_step, k0 = steady_state(record)
            final = next((log for log in reversed(record["logs"]) if "train_loss" in log), {})
            result.update(samples_per_s=sps, samples_per_s_median_step=sps_median_step,
                          time_to_first_step_s=record["time_to_first_step_s"],
                          # every process of the run, from the launch to the first step: on a machine of
                          # C cores the first step cannot come sooner than this / C
                          tree_cpu_s_to_first_step=sampler.cpu_at(t0 + record["time_to_first_step_s"]),
                          cpu_s_to_first_step_by_process=sampler.cpu_by_process_at(
                              t0 + record["time_to_first_step_s"]),
                          steps=len(record["step_ends"]), steady_from_step=k0,
                          world_size=record["world_size"], train_loss=final.get("train_loss"),
                          torch_threads=record.get("torch_threads"), marks_s=record.get("marks_s"),
                          raytrainer_file=record.get("raytrainer_file"))
            if record["world_size"] != WORLD[side]:
                result["error"] = f"world size {record['world_size']}, expected {WORLD[side]}"
        else:
            result["error"] = f"exit status {rc}" + ("" if os.path.exists(out_path) else ", no record")
    except Exception as exc:  # one failing side must not lose the others' numbers
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if head is not None:
            head.stop()
        shutil.rmtree(cfg["output_dir"], ignore_errors=True)
    status = "ok" if "error" not in result else f"FAILED ({result['error']}; log: {log_path})"
    print(f"  {tag:<22} wall {result.get('wall_s', float('nan')):6.1f}s  "
          f"first step {_fmt(result.get('time_to_first_step_s'), 1)}s "
          f"(CPU {_fmt(result.get('tree_cpu_s_to_first_step'), 1)}s)  "
          f"samples/s {_fmt(result.get('samples_per_s'), 0)}  "
          f"peak tree RSS {_fmt(result.get('peak_tree_rss_mib'), 0)} MiB  {status}", flush=True)
    if "error" in result and os.path.exists(log_path):
        with open(log_path) as f:
            print("    | " + "\n    | ".join(f.read().splitlines()[-15:]), flush=True)
    return result


# -- summary ---------------------------------------------------------------------------------------------
METRICS = ("samples_per_s", "samples_per_s_median_step", "time_to_first_step_s", "wall_s",
           "peak_tree_rss_mib", "peak_tree_pss_mib", "peak_proc_rss_mib", "tree_cpu_s",
           "tree_cpu_s_to_first_step", "train_loss")


def summarize(runs: list[dict]) -> dict:
    """Median of each metric over the successful repeats, per workload and side."""
    summary: dict = {}
    for run in runs:
        if "error" in run:
            continue
        entry = summary.setdefault(run["workload"], {}).setdefault(run["side"], {"n": 0})
        entry["n"] += 1
        for m in METRICS:
            if run.get(m) is not None:
                entry.setdefault("_values", {}).setdefault(m, []).append(run[m])
        entry["peak_proc_name"] = run.get("peak_proc_name")
    for sides in summary.values():
        for entry in sides.values():
            for m, values in entry.pop("_values", {}).items():
                entry[m] = statistics.median(values)
    return summary


def _fmt(value, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(value, ref) -> str:
    return "-" if value is None or not ref else f"{value / ref:.2f}x"


def _side_order(side: str) -> tuple[int, str]:
    return list(SIDES).index(side.partition("@")[0]), side


def machine_info() -> dict:
    from _machine import machine_info as common

    return common(REPO)


def markdown(summary: dict, info: dict, opts, configs: dict) -> str:
    lines = [
        f"Date: {info['date']}  ",
        f"Machine: {info['cpu']}, {info['logical_cpus']} logical CPUs, {info['memory_gib']} GiB, "
        f"{info['os']}  ",
        f"Software: Python {info['python']}, torch {info['torch']}, ray {info['ray']}, "
        f"transformers {info['transformers']}, raytrainer {info['raytrainer_commit']}  ",
        f"Settings: OMP_NUM_THREADS=1 in every process (1-process sides use 1 core, 2-process sides 2); "
        f"fused AdamW lr 1e-3, linear schedule, batch 32 per process; medians of {opts.repeats} "
        f"repeat(s) run in rotating order{' (--quick)' if opts.quick else ''}; load average (1, 5, 15 min) "
        f"{info['load_average_at_start']} at the start, {info.get('load_average_at_end')} at the end.",
        "",
    ]
    pss_head = " peak PSS tree (MiB) |" if opts.pss else ""
    for workload, sides in summary.items():
        cfg = configs[workload]
        if workload == "mlp":
            title = f"MLP on digits (1797 examples, {cfg['epochs']} epochs)"
        else:
            title = (f"Tiny BERT (2 layers, hidden 128, 2 heads, vocab 1000, seq 64; {cfg['examples']} "
                     f"examples, {cfg['epochs']} epoch(s))")
        ref = sides.get("a", {})
        lines += [
            f"### {title}", "",
            "| side | samples/s | x(a) | samples/s, median step | first step (s) | x(a) "
            "| CPU s to first step | wall (s) | x(a) | peak RSS tree (MiB) | x(a) |"
            f"{pss_head} max RSS one process (MiB) | x(a) | train loss |",
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|" + ("--:|" if opts.pss else ""),
        ]
        for side in sorted(sides, key=_side_order):
            e = sides[side]
            base, _, tree = side.partition("@")
            name = SIDES[base] + (f" ({tree})" if tree else "")
            lines.append(
                f"| ({side}) {name} | {_fmt(e.get('samples_per_s'), 0)} | "
                f"{_ratio(e.get('samples_per_s'), ref.get('samples_per_s'))} | "
                f"{_fmt(e.get('samples_per_s_median_step'), 0)} | {_fmt(e.get('time_to_first_step_s'), 1)} | "
                f"{_ratio(e.get('time_to_first_step_s'), ref.get('time_to_first_step_s'))} | "
                f"{_fmt(e.get('tree_cpu_s_to_first_step'), 1)} | "
                f"{_fmt(e.get('wall_s'), 1)} | {_ratio(e.get('wall_s'), ref.get('wall_s'))} | "
                f"{_fmt(e.get('peak_tree_rss_mib'), 0)} | "
                f"{_ratio(e.get('peak_tree_rss_mib'), ref.get('peak_tree_rss_mib'))} | "
                + (f"{_fmt(e.get('peak_tree_pss_mib'), 0)} | " if opts.pss else "")
                + f"{_fmt(e.get('peak_proc_rss_mib'), 0)} | "
                f"{_ratio(e.get('peak_proc_rss_mib'), ref.get('peak_proc_rss_mib'))} | "
                f"{_fmt(e.get('train_loss'), 4)} |")
        lines.append("")
    bar_lines = []
    for workloads, side, ref_side, metric, bar, higher in BARS:
        for workload in workloads:
            sides = summary.get(workload, {})
            value = sides.get(side, {}).get(metric)
            ref = sides.get(ref_side, {}).get(metric)
            if value is None or not ref:
                continue
            ratio = value / ref
            ok = ratio >= bar if higher else ratio <= bar
            bar_lines.append(f"| {workload} | {metric} ({side}) / ({ref_side}) | {ratio:.2f}x | "
                             f"{'>=' if higher else '<='} {bar}x | {'met' if ok else 'NOT met'} |")
    if bar_lines:
        lines += ["### Performance lines", "", "| workload | ratio | measured | line | |",
                  "|---|---|--:|--:|---|", *bar_lines, ""]
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------------
def _interrupt(signum, frame):
    raise KeyboardInterrupt
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="mlp,bert", help="comma-separated: mlp, bert")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated: {', '.join(SIDES)}")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side; medians are reported")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 1 repeat, MLP 1 epoch, BERT 1024 examples")
    p.add_argument("--out", default="bench-results.json", help="JSON file for the raw numbers")
    p.add_argument("--md", default=None, help="also write the Markdown table to this file")
    p.add_argument("--workdir", default=None, help="where configs, records and logs go (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work dir (logs) after a successful run")
    p.add_argument("--prepare-s", type=float, default=0.0,
                   help="seconds of Python work each script does after its TrainingArguments, before its "
                        "model and Trainer (data preparation; every rank under torchrun)")
    p.add_argument("--mlp-epochs", type=int, default=3)
    p.add_argument("--bert-examples", type=int, default=4096)
    p.add_argument("--bert-epochs", type=int, default=1)
    p.add_argument("--sample-interval", type=float, default=0.05, help="memory sampling period (s)")
    p.add_argument("--pss", action="store_true",
                   help="also sample PSS every 2 s (costs ~5 ms of kernel time per process per read)")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                   help="a raytrainer checkout for the sides b@NAME, c@NAME, d@NAME, d_warm@NAME")
    p.add_argument("--timeout", type=float, default=900, help="seconds before a side is stopped")
    p.add_argument("--warm-settle", type=float, default=5.0,
                   help="seconds the pre-started Ray head idles before side d_warm starts")
    p.add_argument("--leftover-grace", type=float, default=10.0,
                   help="seconds a finished run's processes get to exit before they are reported and killed")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.repeats = 1
        opts.mlp_epochs = 1
        opts.bert_examples = 1024
    opts.workloads = [w for w in opts.workloads.split(",") if w]
    opts.sides = [s for s in opts.sides.split(",") if s]
    for w in opts.workloads:
        if w not in ("mlp", "bert"):
            p.error(f"unknown workload {w!r}")
    from _machine import parse_trees

    opts.trees = parse_trees(opts.tree, p.error)
    for s in opts.sides:
        base, at, tree = s.partition("@")
        raytrainer_side = base in ("b", "c", "d", "d_warm", "d_second", "d_warm_nokeep")
        if base not in SIDES or (at and (not raytrainer_side or tree not in opts.trees)):
            p.error(f"unknown side {s!r} (a raytrainer side @ a --tree name: d@before)")
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    has_transformers = importlib.util.find_spec("transformers") is not None
    if not has_transformers:
        print("transformers is not installed (pip install -e '.[bench]'): skipping sides e, f and the BERT "
              "workload")
        opts.sides = [s for s in opts.sides if s not in HF_SIDES]
        opts.workloads = [w for w in opts.workloads if w != "bert"]
    workdir = opts.workdir or tempfile.mkdtemp(prefix="raytrainer-bench-")
    os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)
    configs = workload_configs(opts, workdir)
    if "mlp" in opts.workloads:
        sys.path.insert(0, HERE)
        from _common import write_digits

        write_digits(configs["mlp"]["digits_path"])
    info = machine_info()
    print(f"work dir {workdir}; {info['cpu']}, {info['logical_cpus']} CPUs; "
          f"load average {info['load_average_at_start']}")

    signal.signal(signal.SIGTERM, _interrupt)  # stop cleanly, children included, on SIGTERM as on Ctrl-C
    runs: list[dict] = []
    try:
        for repeat in range(opts.repeats):
            shift = repeat % len(opts.sides)
            order = opts.sides[shift:] + opts.sides[:shift]
            for workload in opts.workloads:
                print(f"repeat {repeat + 1}/{opts.repeats}, {workload}: {' '.join(order)}", flush=True)
                for side in order:
                    runs.append(run_side(workload, configs[workload], side, repeat, opts, workdir))
    except KeyboardInterrupt:
        print("interrupted: reporting what finished", flush=True)
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()

    summary = summarize(runs)
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    table = markdown(summary, info, opts, configs)
    with open(opts.out, "w") as f:
        json.dump({"machine": info, "settings": vars(opts), "workloads": configs, "summary": summary,
                   "runs": runs}, f, indent=2)
    if opts.md:
        with open(opts.md, "w") as f:
            f.write(table + "\n")
    print("\n" + table)
    print(f"raw numbers: {opts.out}")
    failed = [r for r in runs if "error" in r]
    if failed or opts.keep or opts.workdir:
        print(f"logs kept in {workdir}/logs")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
