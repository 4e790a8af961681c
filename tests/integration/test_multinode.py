"""Multi-node semantics on a real local multi-node Ray cluster (cluster/local-multinode.sh: two Ray nodes
on 127.0.0.12 and 127.0.0.13 of this machine). The cluster is this test's own (own ports, temp dirs and
state folder; stopped by session id); the training driver is a subprocess, so the shared Ray instance of
the pytest session is not disturbed (a process can attach to one Ray cluster only).

Checks: node ranks 0 and 1 on distinct node IPs; log_on_each_node (each node's local main logs at
log_level when true, only the global main when false) in the driver's captured output; save_on_each_node
with both nodes' files in one committed checkpoint; HSDP's replicas across the nodes (parallelism_config);
a hub push and tensorboard logging done once, from the driver, with the hub token nowhere in output or
files."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
from console_lines import not_ours
from local_cluster import ROOT, local_cluster, read
from models import rng_files

DRIVER = os.path.join(os.path.dirname(__file__), "multinode_driver.py")
TOKEN = "hf_multinode_secret_7c1d"  # the driver's hub_token


@pytest.fixture(scope="module")
def cluster(s3_server):
    """Two nodes with the dashboard (Jobs API), holding the S3 test server's endpoint and credentials in
    their environment, as a cluster's nodes hold theirs (instance roles, secrets)."""
    with local_cluster(2, "rt-mn-", extra_env=s3_server.env, IP_START="12", WORKER_PORT_BASE="25000",
                       CPUS="2", DASHBOARD="true", LIFETIME="1200") as state:
        yield {"address": read(state, "address"), "dashboard": read(state, "dashboard")}


@pytest.fixture
def _integration():  # overrides the conftest's: this test needs no in-process Ray instance
    yield


@pytest.mark.timeout(600)
def test_two_nodes_ranks_logging_and_saving(cluster, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from raytrainer.checkpoint import CheckpointReader

    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1", RAY_TRAIN_ENABLE_PRINT_PATCH="0",
               PYTHONFAULTHANDLER="1")  # a crash prints every thread's stack
    proc = subprocess.run([sys.executable, DRIVER, cluster["address"], str(work)], env=env,
                          capture_output=True, text=True, timeout=480, cwd=str(work))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    result = json.loads(output.split("RESULT ", 1)[1].splitlines()[0])

    # node ranks: one worker per node (STRICT_SPREAD), node ranks 0 and 1 on distinct IPs
    ranks = [json.load(open(p)) for p in sorted(glob.glob(str(work / "each-node-rank*.json")))]  # noqa: SIM115
    assert sorted(r["node_rank"] for r in ranks) == [0, 1]
    assert len({r["ip"] for r in ranks}) == 2 and {r["ip"] for r in ranks} <= {"127.0.0.12", "127.0.0.13"}
    assert all(r["local_rank"] == 0 for r in ranks)

    # log_on_each_node=True: each node's local main (ranks 0 and 1) logs its INFO line;
    # log_on_each_node=False: rank 1 is a replica (warning level), only rank 0's line arrives.
    each = [line for line in output.splitlines() if "RANKINFO each-node" in line]
    main_only = [line for line in output.splitlines() if "RANKINFO main-only" in line]
    assert sorted(json.loads(line.split("each-node ", 1)[1])["rank"] for line in each) == [0, 1]
    assert [json.loads(line.split("main-only ", 1)[1])["rank"] for line in main_only] == [0]
    assert len(glob.glob(str(work / "main-only-rank*.json"))) == 2  # rank 1 did run

    # save_on_each_node: one committed checkpoint in the shared storage, files from both nodes
    reader = CheckpointReader(str(work / "each-node" / "checkpoint-6"))
    assert {"model.safetensors", *rng_files(0, 1, of_a_new_process=True)} <= set(reader.files)
    for name in reader.files:
        reader.read(name)  # verifies each file against the manifest's sha256

    # the driver pushed the final model once; tensorboard got each logged loss once
    assert result["global_step"] == 6 and result["pushed_is_final"]
    assert result["state_api"] is True  # this cluster runs the dashboard (test_preemption_multinode's: not)

    # on a running cluster too, every line of the console is raytrainer's or the script's own (RESULT), the
    # worker's failure included: raised in the script, not printed by Ray
    assert result["failed"] == "the user's callback failed on rank 1 at step 3"
    assert not_ours(output, "RESULT ") == [], "\n".join(not_ours(output, "RESULT "))
    assert output.count("raytrainer: connected to the Ray cluster at") == 1
    runs = glob.glob(str(work / "tb" / "events.out.tfevents.*"))
    assert len(runs) == 1
    acc = EventAccumulator(str(work / "tb"))
    acc.Reload()
    losses = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in losses] == [2, 4, 6]
    assert [v for _, v in losses] == pytest.approx(result["logged_losses"], rel=1e-6)

    # HSDP (parallelism_config dp_replicate=2 x dp_shard=2 on 2 nodes of 2 workers): each rank's replicate
    # group spans both nodes, its shard group lies within its own node -- read from the parameters' mesh
    meshes = [json.load(open(p)) for p in sorted(glob.glob(str(work / "mesh-rank*.json")))]  # noqa: SIM115
    assert [m["rank"] for m in meshes] == [0, 1, 2, 3]
    for m in meshes:
        ips = m["ips"]
        assert m["dims"] == ["dp_replicate", "dp_shard_cp"], m
        assert len(m["dp_replicate"]) == 2 and len({ips[r] for r in m["dp_replicate"]}) == 2, m
        assert len(m["dp_shard_cp"]) == 2 and {ips[r] for r in m["dp_shard_cp"]} == {ips[m["rank"]]}, m

    # the hub token: not in the driver's output, the rank logs, checkpoints, the hub copy or event files
    assert TOKEN not in output
    for root, _, names in os.walk(work):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                assert TOKEN.encode() not in f.read(), os.path.join(root, name)


@pytest.mark.timeout(600)
def test_submit_the_docs_example_with_checkpoints_in_a_bucket(cluster, s3_bucket, tmp_path):
    """docs/cluster.md's example: `raytrainer submit ... -- python train_digits.py --num_workers 2
    --storage_path s3://...` on two nodes; the job's driver and both workers reach the bucket through their
    nodes' environment (the submitting process passes no credential). A second job resumes from the
    bucket's latest committed checkpoint and trains one more epoch."""
    uri = f"{s3_bucket.uri}/runs/digits"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "AWS_"))}
    env.update(OMP_NUM_THREADS="1", HOME=str(tmp_path))

    def submit(epochs: int, *extra: str):
        cmd = [sys.executable, "-m", "raytrainer.cli", "submit", "--address", cluster["dashboard"],
               "--working-dir", "examples", "--", "python", "train_digits.py", "--num_workers", "2",
               "--placement_strategy", "STRICT_SPREAD", "--storage_path", uri, "--save_strategy", "epoch",
               "--num_train_epochs", str(epochs), "--output_dir", f"/tmp/rt-mn-demo-{s3_bucket.name}",
               "--disable_tqdm", "true", *extra]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        per_epoch = json.loads(proc.stdout.split("test accuracy per epoch: ")[1].splitlines()[0])
        return proc.stdout, per_epoch

    _, first = submit(5)  # the demo exits 1 below 90% test accuracy: 5 epochs are past it
    committed = s3_bucket.committed("runs/digits")  # manifests match the bucket's objects
    steps = sorted(m["global_step"] for m in committed.values())
    assert len(steps) == 5 and steps == [steps[0] * e for e in range(1, 6)]

    _, resumed = submit(6, "--resume_from_checkpoint", "latest")
    committed = s3_bucket.committed("runs/digits")
    assert sorted(m["global_step"] for m in committed.values()) == [*steps, 6 * steps[0]]
    # the first five evaluations came back from the checkpoint's log history, not from training again
    assert len(resumed) == 6 and resumed[:5] == first and resumed[5] > 0.9
