"""A node drained for preemption on a real local multi-node Ray cluster (cluster/local-multinode.sh: three
nodes on 127.0.0.16-18 of this machine, the test's own): ``ray drain-node --reason
DRAIN_NODE_REASON_PREEMPTION`` on the node of one of a 2-worker run's ranks, then the node's processes
killed, as a spot reclaim does; or SIGTERM to the node, as a Kubernetes eviction. Ray Train's watcher gives
notice, every rank saves at the same step, the checkpoint is committed and the ranks wait; the node goes,
Ray restarts the group on the two nodes left (not counted against ``max_failures=0``) and the run resumes
from that checkpoint and finishes. Each case has a fresh 3-node cluster: the first loses a node."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from local_cluster import local_cluster, read
from models import rng_files

DRIVER = os.path.join(os.path.dirname(__file__), "preemption_driver.py")
IP_START = 16
SIGTERM_DRAIN_S = 8  # a node given SIGTERM drains itself for this long, then stops (as a pod evicted)
DRAIN_DEADLINE_S = 15  # ray drain-node's deadline: the node's processes are SIGKILLed once it has passed


@pytest.fixture
def cluster():
    with local_cluster(3, "rt-pre-", up_timeout=240, IP_START=str(IP_START), WORKER_PORT_BASE="28000",
                       CPUS="1", DRAIN_TIMEOUT_S=str(SIGTERM_DRAIN_S)) as state:
        yield {"address": read(state, "address"), "state": state}


@pytest.fixture
def _integration():  # overrides the conftest's: this test needs no in-process Ray instance
    yield


def _wait_for(what: str, found, proc, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"the driver ended before {what}: {proc.communicate()[0][-6000:]}")
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout:.0f}s")


def _kill_node(state: str, index: int) -> None:
    """Every process of node ``index`` (one session), SIGKILLed: the machine going away."""
    with open(os.path.join(state, f"node{index}.pid")) as f:
        session = f.read().strip()
    pids = subprocess.run(["pgrep", "-s", session], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.timeout(600)
# the SIGTERM case is the same notice from another source
@pytest.mark.parametrize("how", ["drain-node", "sigterm"])
def test_a_preempted_node_s_rank_saves_with_the_others_before_it_goes_and_the_run_resumes_there(
        cluster, tmp_path, how):
    """``drain-node``: ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`` (a 15 s deadline), then the
    node's processes SIGKILLed once the deadline has passed, as a spot reclaim does. ``sigterm``: the
    node's ``ray start`` gets SIGTERM, as Kubernetes evicting a pod: Ray drains the node for
    SIGTERM_DRAIN_S, then stops it."""
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1", RAY_TRAIN_ENABLE_PRINT_PATCH="0",
               RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S="1", PYTHONFAULTHANDLER="1")
    # A node given SIGTERM stops its processes at its drain deadline, and Ray records "expected termination:
    # received SIGTERM", a failure to Ray Train unless its controller restarted the group at that deadline
    # first (a race, lost on a loaded machine): that case gets max_failures=1. A node taken after its
    # deadline is a preemption to Ray.
    max_failures = 0 if how == "drain-node" else 1
    command = [sys.executable, DRIVER, cluster["address"], str(work), str(max_failures)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(work))
    try:
        def both_ranks():
            files = [work / f"rank{r}.json" for r in (0, 1)]
            return all(f.exists() for f in files) and [json.loads(f.read_text()) for f in files]

        ranks = _wait_for("both ranks' first step", both_ranks, proc, 300)
        head_ip = f"127.0.0.{IP_START}"
        # a rank on a node other than the head (the head holds the cluster; a cloud would not take it)
        where = next(info for info in ranks if info["ip"] != head_ip)
        node_index = int(where["ip"].rsplit(".", 1)[1]) - IP_START
        noticed_after = int((work / "steps").read_text().split()[-1])  # the last step rank 0 finished
        if how == "drain-node":
            drain = subprocess.run(
                [os.path.join(os.path.dirname(sys.executable), "ray"), "drain-node", "--address",
                 cluster["address"], "--node-id", where["node_id"], "--reason",
                 "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot instance reclaimed",
                 "--deadline-remaining-seconds", str(DRAIN_DEADLINE_S)], env=env, capture_output=True,
                text=True, timeout=60)
            deadline = time.time() + DRAIN_DEADLINE_S
            assert drain.returncode == 0, drain.stdout + drain.stderr
        else:
            _sigterm_node(cluster["state"], node_index)

        def committed():
            return sorted(p.parent.name for p in (work / "out").glob("checkpoint-*/manifest.json"))

        saved = _wait_for("a committed checkpoint", committed, proc, 120)
        if how == "drain-node":  # the machine goes at its deadline, as a reclaimed spot instance does
            time.sleep(max(deadline + 1 - time.time(), 0))
            _kill_node(cluster["state"], node_index)
        output = proc.communicate(timeout=420)[0]
        (tmp_path / "driver.log").write_text(output)  # kept by pytest, to read when an assertion fails
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-6000:]
    # raytrainer connected to the cluster: Ray's own actors' lines stay in the cluster's log folders
    ray_lines = re.findall(r"\((?:TrainController|RayTrainWorker|PlacementGroupCleaner) pid=.*", output)
    assert not ray_lines, ray_lines[:5]
    assert f"connected to the Ray cluster at {cluster['address']}" in output
    result = json.loads(output.split("RESULT ", 1)[1].splitlines()[0])
    assert result["global_step"] == 60
    # a cluster without the dashboard serves no State API: Ray Train's placement-group cleaner, a detached
    # actor that would poll it forever once a driver is killed, is not started (the chaos run found it left)
    assert result["state_api"] is False

    # one checkpoint, taken on the notice (save_steps=1000 would take none), at the same step on every rank
    assert len(saved) == 1, saved
    step = int(saved[0].split("-")[1])
    assert f"every rank saves a checkpoint at step {step}, then waits for the node to go" in output
    files = {p.name for p in (work / "out" / saved[0]).iterdir()}
    assert {*rng_files(0, 1, of_a_new_process=True), "model.safetensors"} <= files
    # the restart resumed from it, on the two nodes left (drain-node: without counting as a failure)
    assert f"resuming from {work / 'out' / saved[0]}" in output
    lines = [line.split() for line in (work / "steps").read_text().splitlines()]
    attempts = list(dict.fromkeys(pid for pid, _ in lines))
    assert len(attempts) == 2, attempts  # rank 0 ran in two worker processes: the first group, the restart
    first = [int(s) for pid, s in lines if pid == attempts[0]]
    second = [int(s) for pid, s in lines if pid == attempts[1]]
    assert second[0] == step + 1 and second[-1] == 60  # from the checkpoint on, to the end
    assert noticed_after <= step <= first[-1]  # saved after the notice, before the node went
    redone = first[-1] - step
    assert redone == 0, (step, first[-1])  # the ranks waited from the commit to the restart
    print(f"{how}: noticed after step {noticed_after}, saved at step {step}, the first group's last step "
          f"{first[-1]}: {redone} step(s) trained again")


def _sigterm_node(state: str, index: int) -> None:
    """SIGTERM to node ``index``'s ``ray start --block`` (the child of the ``timeout`` whose pid the
    cluster script keeps): what Kubernetes sends a pod's main process when it evicts it."""
    with open(os.path.join(state, f"node{index}.pid")) as f:
        wrapper = f.read().strip()
    (child,) = subprocess.run(["pgrep", "-P", wrapper], capture_output=True, text=True).stdout.split()
    os.kill(int(child), signal.SIGTERM)
