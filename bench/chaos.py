"""Chaos: one long 2-worker training run on a local 3-node Ray cluster (cluster/local-multinode.sh) that takes
faults at random steps drawn from a seed, and what it ends with, against an uninterrupted run of the same
script on the same cluster.

    .venv/bin/python bench/chaos.py --host ddp --faults 20 --seed 0      # prints the table
    (hosts: ddp, fsdp, zero3 -- raytrainer's Trainer -- and trl, TRL's SFTTrainer)

The faults, each as it comes on a real cluster:

- ``kill-worker``: SIGKILL to one rank's process (the OOM killer, a crashed process).
- ``kill-raylet``: SIGKILL to the raylet of a node that holds a rank, then the rest of the node's processes
  (the machine going away); a new node joins in its place, as an autoscaler's would.
- ``drain-node``: ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`` with a 10 s deadline on a node that
  holds a rank, then every process of the node SIGKILLed at the deadline (a spot reclaim); a new node joins.
- ``sigterm-node``: SIGTERM to every process of a node that holds a rank at once, the raylet too (a VM's
  shutdown, Slurm's scancel); what is left after 10 s is SIGKILLed; a new node joins.
- ``storage-full``: rank 0's next checkpoint write fails as a full disk does (ENOSPC, chaos_driver.py's
  ``FullDiskOnce``). The run ends naming the checkpoint; the script is run again (the disk freed).
- ``kill-driver``: SIGKILL to the driver script; it is run again.

The script is run with ``max_failures=-1`` and resumes from the output folder's latest checkpoint when run
again. At the end the run must have: the uninterrupted run's final weights (bitwise: the world size stays
2), every ``checkpoint-<step>`` of the save schedule committed with every file matching its manifest's
sha256, no ``*.tmp-*`` file in the output folder, nothing in the run's TMPDIR, no actor or placement
group alive on the cluster, and none of the run's processes (drivers, ranks) alive, once the workers
raytrainer keeps idle for a script's next run on a running cluster have ended (``KEEP_WORKERS_S`` after
the script: a script run again after a fault may take them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))  # the tiny model folder the tests use

from chaos_driver import KEEP_WORKERS_S, SAVE_STEPS  # noqa: E402

CLUSTER = os.path.join(ROOT, "cluster", "local-multinode.sh")
DRIVER = os.path.join(HERE, "chaos_driver.py")
HOSTS = ["ddp", "fsdp", "zero3", "trl"]  # raytrainer's Trainer by strategy; TRL's SFTTrainer
KINDS = ("kill-worker", "kill-raylet", "drain-node", "sigterm-node", "storage-full", "kill-driver")
NODE_KINDS = ("kill-raylet", "drain-node", "sigterm-node")
DRAIN_DEADLINE_S = 10
GONE_AFTER_S = 10  # a node given SIGTERM: what is left of it after this long is SIGKILLed
FIRST_FAULT_AFTER = 2 * SAVE_STEPS + 2  # a checkpoint is committed before the first fault
CLUSTER_SINGLETON = "_AutoscalingCoordinatorActor"
GAP = 6  # steps between two planned faults, at least
TAIL = 40  # steps after the last planned fault: a drained node's notice arrives some 25 steps after the drain
#: the run goes on while a drained node's notice comes and its checkpoint is agreed (about 25 steps at the
#: preemption check's cadence, which is set in seconds): the faults after a drain come that much later
DRAIN_STEPS = 25


@dataclass
class Fault:
    kind: str
    planned: int  # the step after which it is injected
    step: int = 0  # the last step rank 0 had finished when it was
    target: str = ""
    last: int = 0  # the last step the worker group it struck finished
    resumed_at: int = 0  # the step the next worker group started from
    redone: int = 0  # steps trained again
    pause_s: float = 0.0  # from the fault to the next worker group's first step
    notes: list = field(default_factory=list)


def plan(seed: int, faults: int) -> tuple[list[Fault], int]:
    """``faults`` faults, every kind at least once, at increasing random steps; and the run's length."""
    rng = random.Random(seed)
    kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(faults - len(KINDS))]
    rng.shuffle(kinds)
    out = [Fault(kind, FIRST_FAULT_AFTER + GAP * i + rng.randrange(GAP)) for i, kind in enumerate(kinds)]
    return out, FIRST_FAULT_AFTER + GAP * faults + TAIL + DRAIN_STEPS * kinds.count("drain-node")


class Cluster:
    """cluster/local-multinode.sh's nodes, this run's own (loopback IPs from ``ip_start``, its own ports)."""

    def __init__(self, nodes: int, ip_start: int, port_base: int, env: dict):
        self.state = tempfile.mkdtemp(prefix="rt-chaos-", dir="/tmp")  # short: Ray's socket paths
        self.ip_start = ip_start
        self.env = {**env, "RAY_MN_STATE": self.state, "RAY_MN_AUTH_MODE": "disabled", "RAY_MN_CPUS": "1",
                    "RAY_MN_IP_START": str(ip_start), "RAY_MN_WORKER_PORT_BASE": str(port_base),
                    "RAY_MN_VENV": os.path.dirname(os.path.dirname(sys.executable)),
                    "RAY_MN_LIFETIME": "5400"}
        self._script("up", str(nodes))
        self.address = self._read("address")
        self.replacing: threading.Thread | None = None  # a lost node's replacement, joining
        self.replace_error: Exception | None = None

    def wait_for_replacement(self) -> None:
        if self.replacing is not None:
            self.replacing.join()
            self.replacing = None
            if self.replace_error is not None:
                raise self.replace_error

    def _script(self, *args: str) -> str:
        done = subprocess.run(["bash", CLUSTER, *args], env=self.env, capture_output=True, text=True,
                              timeout=240)
        if done.returncode != 0:
            raise RuntimeError(f"local-multinode.sh {' '.join(args)}: {done.stdout}{done.stderr}")
        return done.stdout

    def _read(self, name: str) -> str:
        with open(os.path.join(self.state, name)) as f:
            return f.read().strip()

    def index_of(self, ip: str) -> int:
        return int(ip.rsplit(".", 1)[1]) - self.ip_start

    def head_ip(self) -> str:
        return f"127.0.0.{self.ip_start}"

    def pids(self, index: int) -> list[int]:
        session = self._read(f"node{index}.pid")
        found = subprocess.run(["pgrep", "-s", session], capture_output=True, text=True).stdout.split()
        return [int(p) for p in found]

    def raylet(self, index: int) -> int:
        session = self._read(f"node{index}.pid")
        found = subprocess.run(["pgrep", "-s", session, "-f", "raylet/raylet"], capture_output=True,
                               text=True).stdout.split()
        return int(found[0])

    def signal_node(self, index: int, sig: int) -> None:
        for pid in self.pids(index):
            _signal(pid, sig)

    def replace(self, index: int, tries: int = 3) -> None:
        """Node ``index`` is gone: whatever is left of it is SIGKILLed, and a new node joins with its IP --
        tried again, as an autoscaler would, when it does not start in time (a loaded machine)."""
        for attempt in range(1, tries + 1):
            self.signal_node(index, signal.SIGKILL)
            deadline = time.time() + 30
            while self.pids(index) and time.time() < deadline:
                time.sleep(0.2)
            os.remove(os.path.join(self.state, f"node{index}.pid"))
            shutil.rmtree(os.path.join(self.state, f"n{index}"), ignore_errors=True)
            try:
                self._script("add")
                return
            except RuntimeError as exc:
                if attempt == tries:
                    self.replace_error = exc
                    return
                print(f"node {index} did not start (try {attempt} of {tries}): {str(exc)[-300:]}", flush=True)

    def down(self) -> None:
        if self.replacing is not None:
            self.replacing.join(timeout=300)
        try:
            self._script("down")
        finally:
            shutil.rmtree(self.state, ignore_errors=True)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for this purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


class Run:
    """The driver script, run (and run again) as a user would, and what its ranks record."""

    def __init__(self, cluster: Cluster, work: str, host: str, steps: int, env: dict):
        self.cluster, self.work, self.host, self.steps, self.env = cluster, work, host, steps, env
        self.proc: subprocess.Popen | None = None
        self.launches, self.pids = 0, set()
        self.log = open(os.path.join(work, "driver.log"), "a")  # noqa: SIM115 (every launch appends)

    def launch(self) -> None:
        self.launches += 1
        self.log.write(f"\n==== launch {self.launches} at {time.strftime('%H:%M:%S')}\n")
        self.log.flush()
        command = [sys.executable, DRIVER, self.cluster.address, self.work, self.host, str(self.steps)]
        self.proc = subprocess.Popen(command, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=self.work, start_new_session=True)
        self.pids.add(self.proc.pid)

    def lines(self) -> list[tuple[int, int]]:
        path = os.path.join(self.work, "steps")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [(int(a), int(b)) for a, b in (line.split() for line in f if line.count(" ") == 1)]

    def ranks(self) -> list[dict] | None:
        found = []
        for rank in (0, 1):
            path = os.path.join(self.work, f"rank{rank}.json")
            if not os.path.exists(path):
                return None
            with open(path) as f:
                found.append(json.load(f))
        self.pids.update(info["pid"] for info in found)
        return found

    def wait(self, what: str, found, timeout: float = 600):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = found()
            if value:
                return value
            if self.proc is not None and self.proc.poll() is not None and what != "the driver's end":
                raise RuntimeError(f"the driver ended (rc {self.proc.returncode}) before {what}; "
                                   f"see {self.log.name}")
            time.sleep(0.05)
        raise RuntimeError(f"no {what} within {timeout:.0f} s; see {self.log.name}")

    def ended(self, timeout: float = 600) -> int:
        self.proc.wait(timeout=timeout)
        return self.proc.returncode

    def output_since_launch(self) -> str:
        with open(self.log.name) as f:
            return f.read().rsplit(f"==== launch {self.launches} ", 1)[-1]


def inject(fault: Fault, run: Run, ranks: list[dict], rng: random.Random) -> None:
    cluster = run.cluster
    if fault.kind == "kill-worker":
        rank = rng.randrange(2)
        fault.target = f"rank {rank} (pid {ranks[rank]['pid']})"
        _signal(ranks[rank]["pid"], signal.SIGKILL)
        return
    if fault.kind == "kill-driver":
        fault.target = f"driver (pid {run.proc.pid})"
        _signal(run.proc.pid, signal.SIGKILL)
        run.ended(60)
        run.launch()
        return
    if fault.kind == "storage-full":
        fault.target = "rank 0's next checkpoint write"
        open(os.path.join(run.work, "fail-next-save"), "w").close()
        code = run.ended()
        text = run.output_since_launch()
        assert code != 0 and "No space left on device" in text, f"rc {code}: {text[-3000:]}"
        fault.notes.append("the run ended naming the checkpoint; run again")
        run.launch()
        return
    cluster.wait_for_replacement()
    fault.step = run.lines()[-1][1]  # the run went on while the last lost node was replaced
    # a node that holds a rank, never the head (it holds the cluster's GCS, as a cloud's head node would)
    candidates = [(r, info) for r, info in enumerate(ranks) if info["ip"] != cluster.head_ip()]
    rank, info = rng.choice(candidates)
    index = cluster.index_of(info["ip"])
    fault.target = f"node {info['ip']} (rank {rank})"
    if fault.kind == "kill-raylet":
        _signal(cluster.raylet(index), signal.SIGKILL)
        time.sleep(2)
    elif fault.kind == "sigterm-node":
        cluster.signal_node(index, signal.SIGTERM)
        time.sleep(GONE_AFTER_S)
    else:
        done = subprocess.run(
            [os.path.join(os.path.dirname(sys.executable), "ray"), "drain-node", "--address", cluster.address,
             "--node-id", info["node_id"], "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
             "chaos: spot instance reclaimed", "--deadline-remaining-seconds", str(DRAIN_DEADLINE_S)],
            env=run.env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        time.sleep(DRAIN_DEADLINE_S + 1)
    # the node is replaced while the run goes on without it (a new node takes a while to join, longer on a
    # loaded machine): the next node fault waits for it, so the cluster has its 3 nodes again by then
    cluster.replacing = threading.Thread(target=cluster.replace, args=(index,), daemon=True)
    cluster.replacing.start()


def committed(out: str) -> dict[int, list[str]]:
    """step -> the problems of every ``checkpoint-<step>`` folder under ``out`` (an empty list: committed,
    every file present with its manifest's size and sha256)."""
    from raytrainer.checkpoint import MANIFEST, digest_files, step_of

    found = {}
    for name in sorted(os.listdir(out)):
        step = step_of(name)
        if step is None:
            continue
        folder = os.path.join(out, name)
        path = os.path.join(folder, MANIFEST)
        if not os.path.exists(path):
            found[step] = ["no manifest (not committed)"]
            continue
        with open(path) as f:
            files = json.load(f)["files"]
        missing = [n for n in files if not os.path.exists(os.path.join(folder, n))]
        digests = digest_files(folder, sorted(n for n in files if n not in missing))
        found[step] = [f"{n} is missing" for n in missing] + [
            f"{n}: sha256 {d['sha256'][:12]}, the manifest says {files[n]['sha256'][:12]}"
            for n, d in digests.items() if d["sha256"] != files[n]["sha256"]]
    return found


def leftovers(cluster: Cluster, run: Run, env: dict) -> dict:
    """What the run left: live actors and placement groups (the cluster's GCS tables), live processes of
    the run (its drivers and ranks), temporary files."""
    probe = ("import json, ray\n"
             f"ray.init(address={cluster.address!r}, logging_level='ERROR', log_to_driver=False)\n"
             "actors = [a['ActorClassName'] for a in ray._private.state.actors().values() "
             "if a['State'] != 'DEAD']\n"
             "pgs = [p['placement_group_id'] for p in ray.util.placement_group_table().values() "
             "if p['state'] != 'REMOVED']\n"
             "print('PROBE ' + json.dumps({'actors': actors, 'placement groups': pgs}))\n")
    # the script's workers stay up, idle, for KEEP_WORKERS_S after it ends (raytrainer's keeper), then end;
    # the GCS marks their actors dead a moment after
    time.sleep(KEEP_WORKERS_S + 10)
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    tables = json.loads(done.stdout.split("PROBE ", 1)[1].splitlines()[0])
    # Ray's autoscaling coordinator is the cluster's, not a run's: one named, detached actor that every job's
    # Ray Train (and Ray Data) asks for resources through. A second one would be a leak.
    coordinators = tables["actors"].count(CLUSTER_SINGLETON)
    tables["actors"] = [a for a in tables["actors"] if a != CLUSTER_SINGLETON] + \
        [CLUSTER_SINGLETON] * (coordinators - 1 if coordinators > 1 else 0)
    out = os.path.join(run.work, "out")
    tmp = [os.path.join(d, n) for d, _, names in os.walk(out) for n in names if ".tmp-" in n]
    return {**tables, "processes": sorted(p for p in run.pids if _alive(p)),
            "temporary files": tmp + sorted(os.listdir(env["TMPDIR"]))}


def final_weights(work: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(work, "out", "final", "model.safetensors"))


def chaos(host: str, faults: int, seed: int, ip_start: int = 40, port_base: int = 13000) -> dict:
    root = tempfile.mkdtemp(prefix=f"raytrainer-chaos-{host}-")
    from hosted_fixtures import write_tiny_lm

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1", RAY_TRAIN_ENABLE_PRINT_PATCH="0",
               RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S="1", TMPDIR=os.path.join(root, "tmp"),
               PYTHONPATH=os.pathsep.join([HERE, env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    os.makedirs(env["TMPDIR"])
    planned, steps = plan(seed, faults)
    rng = random.Random(seed + 1)
    cluster = Cluster(3, ip_start, port_base, env)
    started = time.monotonic()
    try:
        works = {}
        for name in ("uninterrupted", "chaos"):
            works[name] = os.path.join(root, name)
            os.makedirs(works[name])
            write_tiny_lm(os.path.join(works[name], "tiny-model"), dropout=0.0)
        reference = Run(cluster, works["uninterrupted"], host, steps, env)
        reference.launch()
        assert reference.ended(900) == 0, reference.output_since_launch()[-4000:]
        reference_s = time.monotonic() - started

        run = Run(cluster, works["chaos"], host, steps, env)
        run.launch()
        for fault in planned:
            def reached(f=fault):
                lines = run.lines()
                return run.ranks() is not None and lines and lines[-1][1] >= f.planned and lines[-1]

            pid, fault.step = run.wait(f"step {fault.planned}", reached)
            before, ranks = len(run.lines()), run.ranks()
            for rank in (0, 1):  # the next group's ranks write theirs again
                os.remove(os.path.join(run.work, f"rank{rank}.json"))
            t0 = time.monotonic()
            inject(fault, run, ranks, rng)

            def next_group(before=before, pid=pid):
                new = [(p, s) for p, s in run.lines()[before:] if p != pid]
                return new and run.ranks() is not None and new[0]

            try:
                _, first = run.wait(f"a worker group after {fault.kind}", next_group)
            except RuntimeError:
                if run.proc.poll() != 0:
                    raise
                # the run ended first: a drain's notice came after its last step, or the script run again
                # found the final checkpoint committed; the faults after this one are not injected
                fault.notes.append("the run ended before a new worker group started")
                fault.last = max(s for p, s in run.lines() if p == pid)
                break
            fault.pause_s = round(time.monotonic() - t0, 1)
            fault.resumed_at = first - 1
            fault.last = max(s for p, s in run.lines() if p == pid)
            fault.redone = max(fault.last - fault.resumed_at, 0)
            print(f"{fault.kind:13s} after step {fault.step:3d} ({fault.target}): resumed at step "
                  f"{fault.resumed_at}, {fault.redone} step(s) redone, {fault.pause_s} s", flush=True)
        code = run.ended(900)
        assert code == 0, run.output_since_launch()[-4000:]
        chaos_s = time.monotonic() - started - reference_s
        plain, chaotic = final_weights(works["uninterrupted"]), final_weights(works["chaos"])
        different = sorted(n for n in plain if n not in chaotic or not _equal(plain[n], chaotic[n]))
        checkpoints = committed(os.path.join(works["chaos"], "out"))
        return {"host": host, "seed": seed, "date": time.strftime("%Y-%m-%d"), "steps": steps,
                "faults": [asdict(f) for f in planned],
                "launches": run.launches, "weights differ": different,
                "schedule": list(range(SAVE_STEPS, steps + 1, SAVE_STEPS)), "checkpoints": checkpoints,
                "left": leftovers(cluster, run, env), "reference_s": round(reference_s, 1),
                "chaos_s": round(chaos_s, 1)}
    except BaseException:
        print(f"kept {root} (driver.log, steps, out/) to read", flush=True)
        root = None
        raise
    finally:
        cluster.down()
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)


def _equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def problems(result: dict) -> list[str]:
    """What the chaos run broke, in words; empty when it held."""
    out = []
    ended_first = [f for f in result["faults"] if not f["target"]]
    if ended_first:
        out.append(f"{len(ended_first)} of {len(result['faults'])} faults not injected: the run ended first "
                   "(a longer run, --faults fewer, or a less loaded machine)")
    if result["weights differ"]:
        out.append(f"final weights differ from the uninterrupted run's: {result['weights differ'][:5]}")
    checkpoints = {int(step): found for step, found in result["checkpoints"].items()}  # JSON: str keys
    missing = [s for s in result["schedule"] if s not in checkpoints]
    if missing:
        out.append(f"checkpoints of the save schedule missing: {missing}")
    out += [f"checkpoint-{s}: {'; '.join(p)}" for s, p in checkpoints.items() if p]
    out += [f"left after the run: {k} {v}" for k, v in result["left"].items() if v]
    return out


def table(result: dict) -> str:
    by_kind: dict[str, list[dict]] = {}
    for f in result["faults"]:
        if f["target"]:  # injected
            by_kind.setdefault(f["kind"], []).append(f)
    lines = ["| fault | injected | survived | steps redone | pause (s, median / max) |",
             "|---|---|---|---|---|"]
    for kind in KINDS:
        fs = by_kind.get(kind, [])
        if not fs:
            continue
        pauses = sorted(f["pause_s"] for f in fs)
        lines.append(f"| {kind} | {len(fs)} | {len(fs)} | {sum(f['redone'] for f in fs)} | "
                     f"{pauses[len(pauses) // 2]:.1f} / {pauses[-1]:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="ddp", choices=HOSTS)
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the result here too")
    a = parser.parse_args()
    result = chaos(a.host, a.faults, a.seed)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n{a.host}: {len(result['faults'])} faults over {result['steps']} steps, seed {a.seed}, "
          f"{result['launches']} launches of the script; uninterrupted {result['reference_s']} s, "
          f"with the faults {result['chaos_s']} s")
    print(table(result))
    broken = problems(result)
    held = "held: final weights bitwise equal, every checkpoint committed and whole, nothing left"
    print(held if not broken else "BROKEN:\n  " + "\n  ".join(broken))
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
