"""`raytrainer submit` / `raytrainer jobs` against a real Ray head with token authentication, started by
this test (cluster/local-multinode.sh with one node on 127.0.0.21, its own ports, temp dir and token;
stopped by session id). The command runs as a subprocess, as a user would run it."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time

import pytest
from local_cluster import ROOT, local_cluster, read

CLI = [sys.executable, "-m", "raytrainer.cli"]


@pytest.fixture(scope="module")
def head():
    token = secrets.token_hex(16)
    with local_cluster(1, "rt-job-", extra_env={"RAY_AUTH_TOKEN": token}, IP_START="21",
                       WORKER_PORT_BASE="27000", CPUS="3", DASHBOARD="true", AUTH_MODE="token") as state:
        yield read(state, "dashboard"), token, state


@pytest.fixture
def _integration():  # overrides the conftest's: these tests need no in-process Ray instance
    yield


def _cli(args, token, home, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH_TOKEN", "RAY_ADDRESS"))}
    env.update(HOME=str(home), OMP_NUM_THREADS="1")  # HOME: no ~/.ray/auth_token of the machine
    if token:
        env["RAY_AUTH_TOKEN"] = token
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(300)
def test_submit_with_token_auth_and_the_job_commands(head, tmp_path):
    """Token auth and `raytrainer jobs`, on a short job. The demo itself is submitted with token auth by
    examples/local_cluster_job.sh (tests/integration/test_examples_on_workers.py)."""
    address, token, _ = head
    denied = _cli(["submit", "--address", address, "--", "python", "-c", "print('never runs')"], None,
                  tmp_path)
    assert denied.returncode == 2
    assert "Unauthorized" in denied.stderr and "never runs" not in denied.stdout
    wrong = _cli(["jobs", "list", "--address", address], "not-the-token", tmp_path)
    assert wrong.returncode == 2 and "Forbidden" in wrong.stderr

    # --working-dir travels (the job runs in a copy of examples/) and --env reaches the job
    job = "import os; print('job sees', os.environ['RAYTRAINER_TEST'], os.path.isfile('train_digits.py'))"
    done = _cli(["submit", "--address", address, "--working-dir", "examples", "--submission-id", "short-1",
                 "--env", "RAYTRAINER_TEST=41", "--", "python", "-c", job], token, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "job sees 41 True" in done.stdout  # the job's logs, streamed
    assert "job short-1 SUCCEEDED" in done.stderr

    listed = _cli(["jobs", "list", "--address", address], token, tmp_path)
    assert listed.returncode == 0
    assert any(line.split()[:2] == ["short-1", "SUCCEEDED"] for line in listed.stdout.splitlines())
    status = _cli(["jobs", "status", "short-1", "--address", address], token, tmp_path)
    assert status.stdout.startswith("SUCCEEDED")
    logs = _cli(["jobs", "logs", "short-1", "--address", address], token, tmp_path)
    assert "job sees 41 True" in logs.stdout


@pytest.mark.timeout(300)
def test_exit_status_follows_the_job(head, tmp_path):
    address, token, _ = head
    failed = _cli(["submit", "--address", address, "--", "python", "-c", "import sys; sys.exit(7)"], token,
                  tmp_path)
    assert failed.returncode == 7 and "FAILED" in failed.stderr

    started = _cli(["submit", "--address", address, "--no-wait", "--submission-id", "sleeper", "--",
                    "python", "-c", "import time; time.sleep(120)"], token, tmp_path)
    assert started.returncode == 0 and started.stdout.strip() == "sleeper"
    assert _cli(["jobs", "stop", "sleeper", "--address", address], token, tmp_path).returncode == 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = _cli(["jobs", "status", "sleeper", "--address", address], token, tmp_path).stdout
        if status.startswith("STOPPED"):
            break
        time.sleep(1)
    assert status.startswith("STOPPED")
