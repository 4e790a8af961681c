"""A real local multi-node Ray cluster for one test module or test (cluster/local-multinode.sh): its own
loopback IPs, ports, temp dirs and state folder, started with ``up`` and stopped by session id with
``down``. The tests that use it run their drivers as subprocesses, so the shared Ray instance of the
pytest session is not disturbed (a process can attach to one Ray cluster only)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "cluster", "local-multinode.sh")


@contextlib.contextmanager
def local_cluster(nodes: int, prefix: str, extra_env: dict | None = None, up_timeout: float = 180,
                  **settings: str):
    """Yields the cluster's state folder (``address``, ``dashboard``, ``node<i>.pid`` in it). ``settings``
    are the script's ``RAY_MN_*`` variables without the prefix (``IP_START="12"``); ``extra_env`` is what
    else the nodes' environment holds (credentials, a token)."""
    state = tempfile.mkdtemp(prefix=prefix, dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, **(extra_env or {}), "RAY_MN_STATE": state, "RAY_MN_AUTH_MODE": "disabled",
           "RAY_MN_VENV": os.path.dirname(os.path.dirname(sys.executable)), "RAY_MN_LIFETIME": "900"}
    env.update({f"RAY_MN_{k}": v for k, v in settings.items()})
    up = subprocess.run(["bash", SCRIPT, "up", str(nodes)], env=env, capture_output=True, text=True,
                        timeout=up_timeout)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield state
    finally:
        subprocess.run(["bash", SCRIPT, "down"], env=env, capture_output=True, timeout=60)
        shutil.rmtree(state, ignore_errors=True)


def read(state: str, name: str) -> str:
    with open(os.path.join(state, name)) as f:
        return f.read().strip()
