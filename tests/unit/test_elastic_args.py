"""Elastic runs' arguments (raytrainer/elastic.py): the range as given, the global batch kept on every world
size in it, and what is refused on the driver before any worker starts."""

import pytest

from raytrainer import TrainingArguments
from raytrainer.elastic import batch_at, batch_for, parse_workers
from raytrainer.hf_argparser import HfArgumentParser


def _args(tmp_path, **kw):
    return TrainingArguments(output_dir=str(tmp_path), report_to="none", **kw)


@pytest.mark.parametrize("given, parsed", [(3, 3), ("3", 3), ("2:4", (2, 4)), (" 2 : 4 ", (2, 4)),
                                           ((2, 4), (2, 4)), ([1, 3], (1, 3)), ("2-4", None),
                                           (2.0, None), (True, None), ((2, 4, 6), None)])
def test_parse_workers(given, parsed):
    assert parse_workers(given) == parsed


def test_a_range_sets_min_and_max_and_num_workers_is_the_most(tmp_path):
    args = _args(tmp_path, num_workers=(2, 3), per_device_train_batch_size=4)
    assert (args.num_workers, args.min_workers, args.max_workers, args.elastic) == (3, 2, 3, True)
    assert args.given_values()["num_workers"] == (2, 3)  # a hosted rank builds them again from this
    fixed = _args(tmp_path, num_workers=2)
    assert (fixed.num_workers, fixed.min_workers, fixed.max_workers, fixed.elastic) == (2, 2, 2, False)


def test_a_range_without_restarts_is_warned_about(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="raytrainer.elastic"):
        _args(tmp_path, num_workers=(2, 3), per_device_train_batch_size=4)
    assert "max_failures=0: a node lost mid-run ends the run" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="raytrainer.elastic"):
        _args(tmp_path, num_workers=(2, 3), per_device_train_batch_size=4, max_failures=2)
    assert "max_failures" not in caplog.text


def test_the_command_line_takes_a_range_and_a_number(tmp_path):
    parser = HfArgumentParser(TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--num_workers", "2:3",
                                                  "--per_device_train_batch_size", "2"])
    assert (args.num_workers, args.min_workers, args.max_workers) == (3, 2, 3)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--num_workers", "2"])
    assert (args.num_workers, args.elastic) == (2, False)


@pytest.mark.parametrize("world, expected", [(3, (4, 1)), (2, (3, 2)), (1, (4, 3))])
def test_the_global_batch_is_kept_on_every_world_size(tmp_path, world, expected):
    args = _args(tmp_path, num_workers=(1, 3), per_device_train_batch_size=4)  # 12 samples a step
    batch, accumulation = batch_at(args, world)
    assert (batch, accumulation) == expected
    assert batch * accumulation * world == 12


def test_the_per_device_batch_never_grows():
    for total in range(1, 61):
        for world in range(1, 7):
            if total % world:
                continue
            batch, accumulation = batch_for(world, total, 4)
            assert batch <= 4 and batch * accumulation * world == total


def test_a_range_that_cannot_keep_the_global_batch_is_refused(tmp_path):
    with pytest.raises(ValueError) as err:
        _args(tmp_path, num_workers=(2, 4), per_device_train_batch_size=8)  # 32: 3 workers cannot split it
    message = str(err.value)
    assert "num_workers=(2, 4)" in message and "= 32" in message and "over 3 worker(s)" in message
    assert "multiple of 12" in message


@pytest.mark.parametrize("given, words", [((3, 2), "1 <= min < max"), ((0, 2), "1 <= min < max"),
                                          ("a:b", "a range of workers")])
def test_a_bad_range_is_refused(tmp_path, given, words):
    with pytest.raises(ValueError, match="num_workers") as err:
        _args(tmp_path, num_workers=given)
    assert words in str(err.value)


def test_auto_find_batch_size_is_refused_with_a_range(tmp_path):
    with pytest.raises(ValueError, match="auto_find_batch_size"):
        _args(tmp_path, num_workers=(1, 2), auto_find_batch_size=True)


# -- the driver's side: the channel's growth handshake and the console line ------------------------------
def _channel():
    pytest.importorskip("ray")
    from raytrainer.driver.channel import Channel

    return Channel.__ray_actor_class__()  # the actor's own class, run here without Ray


def _run(coroutine):
    import asyncio

    return asyncio.run(coroutine)


def test_a_group_grows_at_once_between_calls_and_after_a_committed_checkpoint_during_train(monkeypatch):
    from raytrainer.driver import channel as channel_module
    from raytrainer.protocol import CheckpointCommitted, Command, Event, Kind, Method

    channel = _channel()
    assert _run(channel.grow_when_ready()) is True  # no call yet: nothing to lose
    _run(channel.submit(Command(1, Method.TRAIN, []), 3))
    assert _run(channel.grow_when_ready()) is False  # training: the ranks are asked for a checkpoint
    assert _run(channel.growth_requested()) == 1
    assert _run(channel.grow_when_ready()) is False and _run(channel.growth_requested()) == 1  # asked once
    _run(channel.growth_committed(1, 13))
    assert _run(channel.grow_when_ready()) is False  # not whole yet: a hosted trainer's parts still arrive
    committed = CheckpointCommitted("checkpoint-13", 13, "/runs/out/checkpoint-13")
    _run(channel.put([Event(Kind.CHECKPOINT, 0, committed)]))
    assert _run(channel.grow_when_ready()) is True  # committed, and the ranks wait
    now = channel_module.time.monotonic()
    monkeypatch.setattr(channel_module.time, "monotonic", lambda: now + channel_module.GROWTH_HOLD_S + 1)
    assert _run(channel.grow_when_ready()) is False  # the ranks went on: a checkpoint is asked for again
    assert _run(channel.growth_requested()) == 2
    _run(channel.submit(Command(2, Method.EVALUATE, []), 3))
    assert _run(channel.grow_when_ready()) is True  # an evaluation is not resumed from a checkpoint


def test_the_results_a_call_waits_for_follow_the_group_s_world_size():
    from raytrainer.protocol import Command, Method, RankResult

    channel = _channel()
    _run(channel.submit(Command(1, Method.TRAIN, []), 3))  # submitted for the most workers
    first = _run(channel.begin_attempt(3))
    assert (first.number, first.world_size, first.previous_world_size) == (0, 3, None)
    again = _run(channel.begin_attempt(2))  # Ray Train restarted the group on two
    assert (again.number, again.world_size, again.previous_world_size) == (1, 2, 3)
    for rank in (0, 1):
        _run(channel.set_result(rank, 1, RankResult(30)))
    results = _run(channel.wait_results(1, 1.0))
    assert results is not None and sorted(results) == [0, 1]


@pytest.mark.parametrize("before, now, words", [(3, 2, "shrunk from 3 to 2 workers"),
                                                (2, 3, "grown from 2 to 3 workers")])
def test_the_console_says_how_the_group_changed(before, now, words):
    from raytrainer.driver.display import restart_line
    from raytrainer.protocol import Attempt

    line = restart_line(Attempt(1, "/runs/out/checkpoint-10", False, now, before), reached=12)
    assert words in line and "resuming from /runs/out/checkpoint-10" in line
    assert "2 step(s) are trained again" in line
    same = restart_line(Attempt(1, None, False, 2, 2), reached=3)  # a restart at the same size
    assert "shrunk" not in same and "grown" not in same
