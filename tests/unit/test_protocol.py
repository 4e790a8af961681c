"""The driver <-> worker contract is raytrainer/protocol.py: the docs show its table, every event kind and
payload class is one of its messages, and every method of the channel actor carries one of them."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib

import pytest

from raytrainer import protocol

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "architecture.md"

# the channel actor's methods (driver/channel.py) and the message each carries
CHANNEL_METHODS = {
    "submit": "Command", "next_command": "Command", "close": "close",
    "put": "Event", "drain": "Event",
    "begin_attempt": "Attempt",
    "record_fatal": "Fatal", "fatal": "Fatal",
    "set_result": "RankResult", "wait_results": "RankResult",
    "request_stop": "stop request", "stop_requested": "stop request",
    "decide_evaluation": "evaluation decision", "evaluation_decision": "evaluation decision",
    "grow_when_ready": "growth request", "growth_requested": "growth request",
    "growth_committed": "growth request",
    # not worker messages: the driver's handles on Ray Train's controller, to abort a run, and on the worker
    # group's placement group, to remove it if the controller dies first
    "set_controller": None, "controller": None, "set_placement_group": None, "placement_group": None,
    # nor this: a kept group's keeper asks where the command board stands (driver/keeper.py)
    "command_state": None,
}


def test_the_architecture_docs_show_the_protocol_table():
    assert protocol.markdown_table() in DOCS.read_text(), (
        "docs/architecture.md's protocol table differs from raytrainer/protocol.py; paste "
        "`python -c 'from raytrainer import protocol; print(protocol.markdown_table())'`")


def test_every_event_kind_and_payload_class_is_a_message():
    names = {m.name for m in protocol.MESSAGES}
    for kind in protocol.Kind:
        assert f"Event({kind.name})" in names or kind is protocol.Kind.ATTEMPT, kind
    payloads = {m.payload for m in protocol.MESSAGES if m.payload is not None}
    classes = {obj for _, obj in inspect.getmembers(protocol, inspect.isclass)
               if dataclasses.is_dataclass(obj) and obj.__module__ == protocol.__name__}
    assert classes - payloads == {protocol.Event}  # the envelope of the Event(...) messages


def test_every_channel_method_carries_a_message():
    pytest.importorskip("ray")
    from raytrainer.driver.channel import Channel

    actor_class = Channel.__ray_metadata__.modified_class
    methods = {name for name, _ in inspect.getmembers(actor_class, inspect.isfunction)
               if not name.startswith("_")}
    assert methods == set(CHANNEL_METHODS), "a channel method was added or removed: update protocol.py"
    names = {m.name for m in protocol.MESSAGES} | {"Event"}
    assert {v for v in CHANNEL_METHODS.values() if v} <= names


def test_messages_round_trip_and_the_module_imports_neither_torch_nor_ray():
    import subprocess
    import sys

    import cloudpickle

    code = "import sys, raytrainer.protocol; print(sorted({'torch', 'ray'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"
    event = protocol.Event(protocol.Kind.LOG, 1, protocol.LogLine(20, "[rank1] hello"))
    assert cloudpickle.loads(cloudpickle.dumps(event)) == event
    result = protocol.RankResult(4, {"eval_loss": 0.5})
    assert cloudpickle.loads(cloudpickle.dumps(result)) == result
