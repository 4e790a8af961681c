"""Elastic runs (``num_workers=(2, 3)``) on a real local multi-node Ray cluster (cluster/local-multinode.sh:
1-CPU nodes on 127.0.0.19-21 of this machine, the test's own, fresh for each case).

- shrink: the run starts on three nodes and loses one mid-run -- every process of the node SIGKILLed, as a
  machine that goes without notice -- and finishes on the two left, from the last committed checkpoint;
- grow: the run starts on two nodes; a third joins mid-run (``local-multinode.sh add``) and the group grows
  to three at a checkpoint the ranks take for it, no step trained twice.

Counted in both: every sample of the epoch is trained exactly once in the run's history (the steps up to
the checkpoint the restart resumed from, then the restart's), each step trains the global batch of 12 (3
ranks x 4, or 2 ranks x 3 x 2 accumulation steps), and the final loss and weights match the same training
uninterrupted with the same global batch (the driver's own process, one rank of batch 12: the same global
batches in the same order, the epoch's permutation being the same for every world size). The
tolerance is float summation order only (1e-4 relative): the trajectory is the same arithmetic.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys

import pytest
from local_cluster import SCRIPT, local_cluster, read
from test_preemption_multinode import _kill_node, _wait_for

DRIVER = os.path.join(os.path.dirname(__file__), "elastic_driver.py")
IP_START = 19
SAMPLES, GLOBAL_BATCH = 360, 12
STEPS = SAMPLES // GLOBAL_BATCH
SETTINGS = {"IP_START": str(IP_START), "WORKER_PORT_BASE": "20000", "CPUS": "1"}


@pytest.fixture
def _integration():  # overrides the conftest's: this test needs no in-process Ray instance
    yield


def _steps(work) -> list[tuple[int, int, int]]:
    """Rank 0's steps so far: (pid, world size, step)."""
    return [step[:3] for step in _timed_steps(work)]


def _timed_steps(work) -> list[tuple]:
    path = work / "steps"
    if not path.exists():
        return []
    return [(*map(int, line.split()[:3]), float(line.split()[3])) for line in path.read_text().splitlines()]


def _pause(work, resumed_from: int) -> float:
    """Seconds from the first group's last step to the restart's first (the step after ``resumed_from``)."""
    steps = _timed_steps(work)
    pids = list(dict.fromkeys(s[0] for s in steps))
    return (next(s[3] for s in steps if s[0] == pids[1]) - [s[3] for s in steps if s[0] == pids[0]][-1])


@contextlib.contextmanager
def _driver(address: str, work, step_s: float, strategy: str = "ddp", host: str = "raytrainer"):
    """The elastic driver's process (killed on the way out if it is still running)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1", RAY_TRAIN_ENABLE_PRINT_PATCH="0",
               PYTHONFAULTHANDLER="1", RAYTRAINER_ELASTIC_RESIZE_CHECK_S="3")
    command = [sys.executable, DRIVER, address, str(work), str(step_s), strategy, host]
    proc = subprocess.Popen(command, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(work))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


def _finish(proc) -> tuple[str, dict]:
    output = proc.communicate(timeout=420)[0]
    assert proc.returncode == 0, output[-8000:]
    return output, json.loads(output.split("RESULT ", 1)[1].splitlines()[0])


def _check_history(work, output: str, result: dict, before: int, after: int) -> tuple[int, int]:
    """The run's history, checked: rank 0's steps on ``before`` workers, then on ``after`` from the
    checkpoint the restart resumed from; every sample once; the uninterrupted run's losses and weights, to
    1e-4. Returns (the step resumed from, the first group's last step)."""
    elastic, baseline = result["elastic"], result["baseline"]
    assert elastic["global_step"] == baseline["global_step"] == STEPS
    steps = _steps(work)
    pids = list(dict.fromkeys(pid for pid, _, _ in steps))
    assert len(pids) == 2, pids
    first = [(w, s) for pid, w, s in steps if pid == pids[0]]
    second = [(w, s) for pid, w, s in steps if pid == pids[1]]
    assert {w for w, _ in first} == {before} and {w for w, _ in second} == {after}
    resumed_from = second[0][1] - 1
    assert second[-1][1] == STEPS
    assert f"resuming from {work / 'out' / f'checkpoint-{resumed_from}'}" in output
    assert f"{'shrunk' if after < before else 'grown'} from {before} to {after} workers" in output
    history = [h for h in elastic["history"] if "world_size" in h]  # trainer.state's record of the change
    assert history == [{"world_size": after, "previous_world_size": before, "step": resumed_from,
                        "epoch": pytest.approx(resumed_from / STEPS)}], history

    seen: collections.Counter = collections.Counter()
    per_step: dict[tuple[int, int], int] = collections.defaultdict(int)  # (attempt, step) -> samples
    for path in work.glob("samples-*"):
        lines = [list(map(int, line.split())) for line in path.read_text().splitlines() if line.strip()]
        if not lines:
            continue
        attempt = 0 if lines[0][0] <= resumed_from else 1
        for step, *ids in lines:
            if attempt == 0 and step > resumed_from:
                continue  # trained again after the restart: not part of the run's history
            seen.update(ids)
            per_step[(attempt, step)] += len(ids)
    assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}, (
        f"{len(seen)} distinct samples, trained {collections.Counter(seen.values())} times")
    assert len(per_step) == STEPS and set(per_step.values()) == {GLOBAL_BATCH}, per_step

    for step, loss in baseline["losses"].items():
        assert elastic["losses"][step] == pytest.approx(loss, rel=1e-4, abs=1e-6), step
    for mine, theirs in zip(elastic["weights"], baseline["weights"]):
        assert mine == pytest.approx(theirs, rel=1e-4, abs=1e-6)
    return resumed_from, first[-1][1]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("strategy", "host"), [
    ("ddp", "raytrainer"), ("ddp", "transformers"), ("ddp", "trl"), ("fsdp", "raytrainer"),
    ("zero3", "raytrainer")])
def test_an_elastic_run_that_loses_a_node_finishes_on_the_rest_with_its_global_batch(tmp_path, strategy,
                                                                                      host):
    """DDP on raytrainer's Trainer; DDP on ``on_ray(transformers.Trainer)`` and on TRL's ``SFTTrainer``
    (transformers' loop: its batch size and accumulation set for each world size, its step-count skipping
    landing on the same rows because the global batch is the same), FSDP (its DCP shards resharded from 3
    ranks onto 2) and ZeRO-3 (DeepSpeed's universal checkpoint, with raytrainer's repair of its optimizer
    state: tests/unit/test_zero3_universal.py)."""
    work = tmp_path / "work"
    work.mkdir()
    with (local_cluster(3, "rt-ela-", up_timeout=240, **SETTINGS) as state,
          _driver(read(state, "address"), work, 0.3, strategy, host) as proc):
        def past_a_checkpoint():
            steps = _steps(work)
            saved = list((work / "out").glob("checkpoint-*/manifest.json"))
            return saved and steps and steps[-1][2] >= 12 and steps

        steps = _wait_for("a committed checkpoint and step 12", past_a_checkpoint, proc, 300)
        assert {world for _, world, _ in steps} == {3}, steps  # the cluster held all three at the start
        _kill_node(state, 2)  # not the head's node (it holds the cluster); a worker is on each
        killed_at = _steps(work)[-1][2]
        output, result = _finish(proc)
    resumed_from, last = _check_history(work, output, result, before=3, after=2)
    assert resumed_from % 5 == 0 and resumed_from <= killed_at <= last  # save_steps=5: the last one
    print(f"{strategy} ({host}): a node lost after step {killed_at}; resumed from checkpoint-{resumed_from} "
          f"on 2 workers; {last - resumed_from} step(s) trained again; "
          f"{_pause(work, resumed_from):.0f} s without a step")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("host", ["raytrainer", "transformers"])
def test_an_elastic_run_grows_onto_a_node_added_mid_run_at_a_checkpoint(tmp_path, host):
    """On raytrainer's Trainer and on ``on_ray(transformers.Trainer)``."""
    work = tmp_path / "work"
    work.mkdir()
    # 2 s a step: the cluster's autoscaling coordinator took 6 to 20 s to count the new node's CPU
    with (local_cluster(2, "rt-elg-", up_timeout=240, **SETTINGS) as state,
          _driver(read(state, "address"), work, 2.0, host=host) as proc):
        _wait_for("step 3", lambda: (s := _steps(work)) and s[-1][2] >= 3 and s, proc, 300)
        env = {**os.environ, "RAY_MN_STATE": state, "RAY_MN_AUTH_MODE": "disabled",
               "RAY_MN_VENV": os.path.dirname(os.path.dirname(sys.executable)), "RAY_MN_LIFETIME": "900",
               **{f"RAY_MN_{k}": v for k, v in SETTINGS.items()}}
        added = subprocess.run(["bash", SCRIPT, "add"], env=env, capture_output=True, text=True,
                               timeout=240)
        assert added.returncode == 0, added.stdout + added.stderr
        added_at = _steps(work)[-1][2]
        output, result = _finish(proc)
    resumed_from, last = _check_history(work, output, result, before=2, after=3)
    assert added_at <= resumed_from and last == resumed_from, (added_at, resumed_from, last)  # none redone
    assert "the cluster has room for more workers: every rank saves a checkpoint" in output
    print(f"{host}: a node added after step {added_at}; the group grew at checkpoint-{resumed_from}; "
          f"{last - resumed_from} step(s) trained again; {_pause(work, resumed_from):.0f} s without a step")
