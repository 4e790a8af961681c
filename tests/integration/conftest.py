"""One local Ray instance for the whole integration session (Ray takes seconds to start on 2 cores).

It is started through raytrainer's own ``ensure_ray`` (the path a user without a cluster takes) and
stopped at the end of the session. Trainers in the tests then find Ray initialised and reuse it.
"""

from __future__ import annotations

import os
import sys

import pytest
from ci_tier import CI_TESTS

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def ray_session(s3_server):
    """The workers inherit the S3 test server's endpoint and (fake) credentials from the environment Ray
    starts with -- as a cluster's nodes hold theirs; the test process itself sets them per test."""
    import ray

    from raytrainer import TrainingArguments
    from raytrainer.driver.ray_runtime import ensure_ray

    saved = {key: os.environ.get(key) for key in s3_server.env}
    os.environ.update(s3_server.env)
    try:
        ensure_ray(TrainingArguments(output_dir="unused", num_workers=2))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def _integration(ray_session):
    """Each test is a script of its own: the worker groups it left idle end with it (raytrainer.shutdown)."""
    yield
    import raytrainer

    raytrainer.shutdown()


@pytest.hookimpl(tryfirst=True)  # before `-m "not full"` deselects
def pytest_collection_modifyitems(items):
    """The session's items, the unit tests' too (a conftest's hook sees them all): this folder's only."""
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        path = str(item.path)
        if os.path.dirname(path) != here:
            continue
        item.add_marker(pytest.mark.integration)
        if f"{os.path.basename(path)}::{item.nodeid.split('::', 1)[1]}" not in CI_TESTS:
            item.add_marker(pytest.mark.full)  # the full tier: ci_tier.py says what CI runs
        if not any(m.name == "timeout" for m in item.iter_markers()):
            item.add_marker(pytest.mark.timeout(420))  # CI's slowest without its own: 150 s, loaded


sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
sys.path.insert(0, os.path.dirname(__file__))

import cloudpickle  # noqa: E402
import models  # noqa: E402
import search_asha  # noqa: E402
import train_digits  # noqa: E402
import train_gpt2  # noqa: E402
import translate  # noqa: E402

# Ray workers cannot import test modules: ship the test models (and the examples') by value.
cloudpickle.register_pickle_by_value(models)
cloudpickle.register_pickle_by_value(search_asha)
cloudpickle.register_pickle_by_value(train_digits)
cloudpickle.register_pickle_by_value(train_gpt2)
cloudpickle.register_pickle_by_value(translate)
