"""A deterministic failure on a worker reaches the driver as the user's own exception, with the rank and the
worker's frames as notes (a pickled exception loses its traceback)."""

from __future__ import annotations

import threading

from raytrainer import failures


class Model:
    def forward(self, x):
        return self.compute_loss(x)

    def compute_loss(self, x):
        raise ValueError(f"labels missing from the batch {x!r}")


def _raised_on_a_worker(rank: int) -> BaseException:
    try:
        Model().forward("b7")
    except ValueError as exc:
        return failures.unpickled(failures.pickled(exc, rank))
    raise AssertionError("not raised")


def test_the_driver_gets_the_users_exception_with_the_workers_frames():
    exc = _raised_on_a_worker(rank=1)
    assert isinstance(exc, ValueError) and str(exc) == "labels missing from the batch 'b7'"
    rank_note, frames = exc.__notes__
    assert rank_note == "(raised on Ray Train worker rank 1; a deterministic failure: not retried)"
    assert frames.startswith("Traceback on worker rank 1 (most recent call last):")
    functions = [line.rsplit(" in ", 1)[1] for line in frames.splitlines() if line.startswith("  File ")]
    assert functions == ["_raised_on_a_worker", "forward", "compute_loss"]  # outermost first, as Python
    assert 'raise ValueError(f"labels missing from the batch {x!r}")' in frames  # the failing line itself


def test_an_exception_that_does_not_pickle_arrives_as_its_text_and_frames():
    class Unpicklable(RuntimeError):
        def __init__(self):
            super().__init__("a lock inside")
            self.lock = threading.Lock()

    try:
        raise Unpicklable()
    except Unpicklable as exc:
        arrived = failures.unpickled(failures.pickled(exc, 0))
    assert type(arrived) is RuntimeError
    assert str(arrived).startswith("rank 0: Unpicklable: a lock inside\n")
    assert "test_an_exception_that_does_not_pickle_arrives_as_its_text_and_frames" in str(arrived)


def test_a_process_group_torn_down_under_a_training_rank_is_a_lost_workers_failure_not_the_users(tmp_path):
    """Ray Train ends a group that lost a worker by destroying each surviving rank's process group from the
    actor's main thread while its training thread runs: the thread's next collective (transformers'
    ``store_flos`` at a save, seen in a chaos run) raises a ValueError, which must be retried, not raised
    on the driver as a deterministic failure."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert not failures.torn_down(2)
    finally:
        dist.destroy_process_group()
    try:
        dist.get_world_size()
    except ValueError as exc:
        raised = exc
    else:
        raise AssertionError("torch no longer raises when the default group is gone")
    assert "Default process group has not been initialized" in str(raised)
    assert not failures.retryable(raised)  # alone it reads as the user's error
    assert failures.torn_down(2) and not failures.torn_down(1)  # one rank has no group to lose
