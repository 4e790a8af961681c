"""worker/signals.py: the first SIGTERM to a training rank's process is heard, not obeyed; Ray's side of it
pinned (the integration tests in test_guarantees.py send real signals to real workers)."""

from __future__ import annotations

import inspect

import pytest

from raytrainer.worker import signals


def test_rays_sigterm_handler_calls_the_module_global_raytrainer_replaces():
    """Ray's worker handles SIGTERM on the actor's main thread by calling
    ``raise_sys_exit_with_custom_error_message`` looked up in ``ray._private.worker``'s globals, with the
    message raytrainer recognises. If Ray changes either, a SIGTERM would end a worker unsaved again."""
    import ray._private.worker as ray_worker

    source = inspect.getsource(ray_worker.Worker.main_loop)
    assert "def sigterm_handler(signum, frame):" in source
    message = signals.RAY_SIGTERM_MESSAGE
    assert f'raise_sys_exit_with_custom_error_message(\n                "{message}"' in source
    assert "raise_sys_exit_with_custom_error_message" in ray_worker.__dict__
    handler = [c for c in ray_worker.Worker.main_loop.__code__.co_consts if inspect.iscode(c)
               and c.co_name == "sigterm_handler"]
    assert handler and "raise_sys_exit_with_custom_error_message" in handler[0].co_names  # a global lookup


def test_outside_a_ray_worker_nothing_is_replaced():
    """The driver's own process (``num_workers=0``) keeps its handlers."""
    import ray._private.worker as ray_worker

    before = ray_worker.raise_sys_exit_with_custom_error_message
    assert signals.listen() is None
    assert ray_worker.raise_sys_exit_with_custom_error_message is before


def test_the_first_sigterm_is_heard_and_any_other_exit_is_rays(monkeypatch):
    calls = []
    monkeypatch.setattr(signals, "_ray_exit", lambda message, exit_code=1: calls.append((message, exit_code)))
    listener = signals.Listener()
    monkeypatch.setattr(signals, "_listener", listener)
    assert signals._on_ray_exit(signals.RAY_SIGTERM_MESSAGE, exit_code=1) is None
    assert listener.received == "SIGTERM" and listener.at is not None and calls == []
    heard_at = listener.at
    assert signals._on_ray_exit(signals.RAY_SIGTERM_MESSAGE, exit_code=1) is None  # a later one: no change
    assert listener.at == heard_at and calls == []
    signals._on_ray_exit("some other reason", exit_code=2)
    assert calls == [("some other reason", 2)]
    monkeypatch.setattr(signals, "_listener", None)  # not training: Ray's exit
    signals._on_ray_exit(signals.RAY_SIGTERM_MESSAGE, exit_code=1)
    assert calls[-1] == (signals.RAY_SIGTERM_MESSAGE, 1)


def test_stop_listening_restores_rays_handling_and_obeys_a_signal_not_acted_on(monkeypatch):
    killed = []
    monkeypatch.setattr(signals.os, "kill", lambda pid, sig: killed.append(sig))
    acted = signals.Listener()
    acted.hear("SIGTERM")
    monkeypatch.setattr(signals, "_listener", acted)
    signals.stop_listening(acted, acted=True)
    assert signals._listener is None and killed == []
    late = signals.Listener()
    late.hear("SIGTERM")
    monkeypatch.setattr(signals, "_listener", late)
    signals.stop_listening(late, acted=False)  # training ended before the ranks agreed: the process ends
    assert signals._listener is None and killed == [signals.signal.SIGTERM]


@pytest.mark.parametrize("exc_type", ["Terminated"])
def test_a_termination_is_retried_per_max_failures_not_recorded_as_deterministic(exc_type):
    from raytrainer import failures

    assert failures.retryable(getattr(failures, exc_type)("rank 1's process received a SIGTERM"))
