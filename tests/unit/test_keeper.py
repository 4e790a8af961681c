"""A kept group's shape (driver/keeper.py) and what a warm worker forgets between two scripts
(worker/entry.py), without Ray: tests/integration/test_kept_workers.py runs the scripts."""

from __future__ import annotations

import sys

import pytest

from raytrainer import TrainingArguments
from raytrainer.driver import keeper


def _args(tmp_path, **overrides):
    return TrainingArguments(**{"output_dir": str(tmp_path / "out"), "num_workers": 2, "report_to": "none",
                                **overrides})


def test_the_name_changes_with_each_part_of_the_shape(tmp_path, monkeypatch):
    base = keeper.keeper_name(_args(tmp_path))
    assert base == keeper.keeper_name(_args(tmp_path, learning_rate=1.0))  # not the group's shape
    monkeypatch.setenv("SOME_UNRELATED_VARIABLE", "1")
    assert base == keeper.keeper_name(_args(tmp_path))
    assert base.startswith(keeper.PREFIX)
    others = {keeper.keeper_name(_args(tmp_path, num_workers=3)),
              keeper.keeper_name(_args(tmp_path, resources_per_worker={"CPU": 2})),
              keeper.keeper_name(_args(tmp_path, fsdp="full_shard"))}
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # a variable that changes how a library runs
    others.add(keeper.keeper_name(_args(tmp_path)))
    monkeypatch.delenv("HF_HOME")
    monkeypatch.chdir(tmp_path)  # another working directory
    others.add(keeper.keeper_name(_args(tmp_path)))
    monkeypatch.setattr(keeper.getpass, "getuser", lambda: "someone-else")  # never another user's
    others.add(keeper.keeper_name(_args(tmp_path)))
    assert base not in others and len(others) == 6


def test_the_field_is_checked_on_the_driver(tmp_path):
    with pytest.raises(ValueError, match=r"keep_workers_s.*-1.*>= 0.*--keep_workers_s 300"):
        _args(tmp_path, keep_workers_s=-1)
    assert _args(tmp_path).keep_workers_s == 300.0


def test_a_warm_worker_forgets_the_last_scripts_own_modules(tmp_path, monkeypatch):
    from raytrainer.worker.entry import ProcessState

    (tmp_path / "user_module_of_a_script.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fresh = ProcessState()
    import json  # noqa: F401  (installed: stays)

    import user_module_of_a_script

    assert user_module_of_a_script.VALUE == 1
    (tmp_path / "user_module_of_a_script.py").write_text("VALUE = 2\n")  # the user edits it between runs
    fresh.forget_scripts_modules()
    assert "user_module_of_a_script" not in sys.modules
    assert "json" in sys.modules and "raytrainer.worker.entry" in sys.modules
    import user_module_of_a_script as again

    assert again.VALUE == 2
    sys.modules.pop("user_module_of_a_script", None)


def test_the_arguments_start_nothing_without_an_address_that_answers(tmp_path, monkeypatch):
    """The early start (driver/ray_train.start_early) asks nothing of Ray unless an address is given and
    something listens there: arguments are made everywhere, and a bad address is the first call's error."""
    import socket

    from raytrainer.driver import ray_train

    calls = []
    monkeypatch.setattr("raytrainer.driver.ray_runtime.ensure_ray", lambda args: calls.append(args))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    _args(tmp_path)  # no address
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    _args(tmp_path, ray_address=f"127.0.0.1:{port}")
    _args(tmp_path, ray_address="ray://127.0.0.1:10001")  # Ray Client: never kept
    _args(tmp_path, ray_address="auto", keep_workers_s=0)
    assert calls == []
    assert not ray_train._answers(f"127.0.0.1:{port}") and not ray_train._answers("no-port")
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    try:
        assert ray_train._answers(f"127.0.0.1:{listening.getsockname()[1]}")
    finally:
        listening.close()
