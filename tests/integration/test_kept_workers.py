"""Worker groups that outlive the script on a running Ray cluster (driver/keeper.py): scripts run one after
another as a user runs them -- separate driver processes connected to a one-node cluster of 3 CPUs -- and
what Ray holds between them read from its tables."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from local_cluster import local_cluster, read

SCRIPT = textwrap.dedent('''
    import hashlib, json, os, sys, time
    import ray
    import torch
    from torch import nn
    from raytrainer import Trainer, TrainerCallback, TrainingArguments

    out, keep, pace, workers = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    prepare, refuse = float(sys.argv[5]), sys.argv[6] == "1"

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

        def forward(self, x, labels=None):
            logits = self.net(x)
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

    class Pids(TrainerCallback):
        """On each rank: its process id in a file, then (pace) a slow step."""
        def on_train_begin(self, args, state, control, **kwargs):
            import psutil

            with open(os.path.join(out, f"pid-{args.process_index}"), "w") as f:
                f.write(f"{os.getpid()} {psutil.Process().create_time()}")

        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(pace)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g)
    data = [{"x": x[i], "labels": int((x[i, 0] > 0) + (x[i, 1] > 0))} for i in range(64)]
    args = TrainingArguments(output_dir=out, num_workers=workers, max_steps=6, per_device_train_batch_size=4,
                             learning_rate=0.05, save_strategy="no", logging_steps=1, report_to="none",
                             disable_tqdm=True, keep_workers_s=keep,
                             **({"eval_strategy": "steps", "eval_steps": 2} if refuse else {}))
    time.sleep(prepare)  # the script loads its model and data: the workers start meanwhile
    print("TRAINER", time.time(), flush=True)
    trainer = Trainer(model=Net(), args=args, train_dataset=data, callbacks=[Pids()])  # refuse: no eval set
    print("JOB", ray.get_runtime_context().get_job_id() if ray.is_initialized() else "", flush=True)
    trainer.train()
    weights = b"".join(t.detach().numpy().tobytes() for t in trainer.model.state_dict().values())
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print("RESULT", json.dumps({"losses": losses, "weights": hashlib.sha256(weights).hexdigest()}))
''')

EMPTY = {"actors": [], "groups": []}  # no live actor, no placement group

PROBE = textwrap.dedent('''
    import json, ray
    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    # (Ray's own cluster-wide autoscaling coordinator, a detached actor Ray Train makes on any cluster it
    # runs on, with a keeper or without, and keeps for every later run, is Ray's)
    actors = [a["ActorClassName"] for a in ray._private.state.actors(actor_state_name="ALIVE").values()
              if a["ActorClassName"] != "_AutoscalingCoordinatorActor"]
    groups = [i for i, g in ray.util.placement_group_table().items() if g["state"] != "REMOVED"]
    print(json.dumps({"actors": sorted(actors), "groups": groups}))
''')


def _run(folder, address: str, name: str, keep: float = 60, pace: float = 0.0, wait: bool = True,
         workers: int = 2, refused: bool = False, prepare: float = 0.0, refuse: bool = False):
    """The script, run from ``folder`` (its working directory) with ``output_dir`` ``folder/name``."""
    os.makedirs(folder, exist_ok=True)
    (folder / "train.py").write_text(SCRIPT)
    os.makedirs(folder / name, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_ADDRESS": address}
    command = [sys.executable, "train.py", name, str(keep), str(pace), str(workers), str(prepare),
               "1" if refuse else "0"]
    if not wait:
        return subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert (done.returncode != 0) == (refused or refuse), done.stdout[-2000:] + done.stderr[-4000:]
    return done


def _result(done) -> dict:
    return json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])


def _pids(folder) -> list[int]:
    return [int((folder / f"pid-{rank}").read_text().split()[0]) for rank in range(2)]


def _created(folder) -> list[float]:
    """When each rank's process was made (``time.time()``)."""
    return [float((folder / f"pid-{rank}").read_text().split()[1]) for rank in range(2)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _cluster_state(address: str) -> dict:
    probe = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, "RAY_ADDRESS": address},
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-3000:]
    return json.loads(probe.stdout.strip().splitlines()[-1])


def _until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(1)
    return condition()


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(1, "rt-keep-", IP_START="31", WORKER_PORT_BASE="31000", CPUS="3") as state:
        yield read(state, "address")


@pytest.mark.timeout(900)
def test_the_next_script_of_the_same_shape_trains_on_the_workers_the_last_one_left(tmp_path, cluster):
    """Two runs of one script: the second trains on the first's worker processes (the same PIDs) and its
    losses and weights equal the first's, on a fresh group, bit for bit. A script from another working
    directory gets a fresh group (the idle one, of another shape, ends to make room on this 3-CPU
    cluster); a group kept 3 s ends after them with its actors, placement group and processes."""
    first = _run(tmp_path / "here", cluster, "first")
    second = _run(tmp_path / "here", cluster, "second")
    assert _pids(tmp_path / "here" / "second") == _pids(tmp_path / "here" / "first")
    assert "taking the warm workers" in second.stderr + second.stdout
    assert "taking the warm workers" not in first.stderr + first.stdout
    assert _result(second) == _result(first)
    assert len(_result(first)["losses"]) == 6

    elsewhere = _run(tmp_path / "elsewhere", cluster, "run", keep=3)
    assert set(_pids(tmp_path / "elsewhere" / "run")).isdisjoint(_pids(tmp_path / "here" / "first"))
    assert _result(elsewhere) == _result(first)
    assert not any(_alive(pid) for pid in _pids(tmp_path / "here" / "first"))  # ended to make room

    # kept 3 s: then nothing of it is left -- no actor (keeper, channel, Ray Train's), no placement group,
    # no worker process
    pids = _pids(tmp_path / "elsewhere" / "run")
    assert _until(lambda: _cluster_state(cluster) == EMPTY, 60), _cluster_state(cluster)
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.timeout(900)
def test_a_driver_killed_mid_run_leaves_nothing_and_the_next_script_trains(tmp_path, cluster):
    """A driver killed (SIGKILL) in the middle of ``train()`` on a kept group: the keeper notices its job
    died and aborts the run -- a run no driver follows would go on -- leaving no actor, placement group or
    worker process; the same script then trains from scratch as a first run does. A run the driver refuses
    (4 workers on 3 CPUs, no autoscaler) leaves no keeper behind."""
    shutil.rmtree(tmp_path / "here", ignore_errors=True)
    driver = _run(tmp_path / "here", cluster, "killed", pace=2.0, wait=False)
    assert _until(lambda: (tmp_path / "here" / "killed" / "pid-1").exists(), 240), driver.poll()
    time.sleep(2)
    pids = _pids(tmp_path / "here" / "killed")
    driver.send_signal(signal.SIGKILL)
    driver.wait(30)
    assert _until(lambda: _cluster_state(cluster) == EMPTY, 90), _cluster_state(cluster)
    assert _until(lambda: not any(_alive(pid) for pid in pids), 30)

    again = _run(tmp_path / "here", cluster, "again", keep=0)
    assert len(_result(again)["losses"]) == 6
    assert _cluster_state(cluster) == EMPTY  # keep_workers_s=0: ended with it

    refused = _run(tmp_path / "here", cluster, "refused", workers=4, refused=True)
    assert "No autoscaler can add a node" in refused.stderr, refused.stderr[-3000:]
    assert _cluster_state(cluster) == EMPTY


@pytest.mark.timeout(900)
def test_the_workers_start_while_the_script_prepares_and_a_refused_run_leaves_nothing(tmp_path, cluster):
    """``TrainingArguments(num_workers=2)`` on a running cluster starts the group: a script that then spends
    8 s preparing trains on worker processes made before it built its Trainer, and its first step comes
    soon after. A script whose Trainer the driver refuses (an evaluation asked without an evaluation set)
    after its arguments started the group leaves no actor, placement group or process."""
    assert _cluster_state(cluster) == EMPTY
    done = _run(tmp_path / "here", cluster, "early", keep=0.5, prepare=8.0)
    trainer_built = float(done.stdout.split("TRAINER ", 1)[1].split()[0])
    assert "while the script prepares" in done.stderr, done.stderr[-3000:]
    assert max(_created(tmp_path / "here" / "early")) < trainer_built
    assert len(_result(done)["losses"]) == 6
    assert _until(lambda: _cluster_state(cluster) == EMPTY, 60), _cluster_state(cluster)

    refused = _run(tmp_path / "there", cluster, "refused", prepare=2.0, refuse=True)
    assert "while the script prepares" in refused.stderr and "eval_dataset" in refused.stderr, \
        refused.stderr[-3000:]
    assert _cluster_state(cluster) == EMPTY
