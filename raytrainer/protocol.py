"""The driver <-> worker contract: every message between the driver and the ranks of a worker group.

Nothing else crosses. The driver posts a ``Command`` on the group's channel (driver/channel.py); each rank
runs it and answers with a ``RankResult``. While a command runs, ranks send ``Event`` s (a ``Kind`` and its
payload) that the driver drains a few times a second; rank 0 asks for its ``Attempt`` at each start of the
command (again after Ray Train restarted the workers), and reads the driver's stop requests and evaluation
decisions. A rank whose error is deterministic records a ``Fatal`` so that no restart trains again. Weights
never cross here: they go through storage (raytrainer.final_weights, the checkpoints).

``MESSAGES`` lists every message, who sends it and when; docs/architecture.md's protocol table is checked
against it (tests/unit/test_protocol.py). Both sides import this module; it imports nothing heavy.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple


class Method(str, enum.Enum):
    """The Trainer methods a command runs on every rank."""

    TRAIN = "train"
    EVALUATE = "evaluate"
    PREDICT = "predict"
    CALL = "call"  # another method or attribute of a hosted trainer (raytrainer/hosted.py)


class Kind(str, enum.Enum):
    """What an ``Event`` carries (its payload's type)."""

    LOG = "log"  # LogLine
    CALLBACK = "callback"  # CallbackEvent
    CHECKPOINT = "checkpoint"  # CheckpointCommitted
    CHECKPOINT_PART = "checkpoint_part"  # CheckpointPart
    PACE = "pace"  # Pace
    ATTEMPT = "attempt"  # Attempt


@dataclass(frozen=True)
class Command:
    """Driver -> every rank: run ``method`` with the ``Spec`` behind ``spec`` (a one-item list holding its
    object-store reference: in a list, Ray hands over the reference, not the bytes). ``id`` grows with each
    command of a group."""

    id: int
    method: Method
    spec: list


#: this process's id as a driver, in every command's spec
THIS_DRIVER = uuid.uuid4().hex


@dataclass(frozen=True)
class Spec:
    """What a command runs (raytrainer/hosted.py builds it): the trainer's ``Recipe`` pickled without its
    payload (raytrainer/hosted_recipe.py), the call's arguments, and what the driver learnt for the ranks:
    transformers' log level in the script."""

    trainer: bytes
    kwargs: dict
    transformers_log_level: int | None = None
    #: the driver's working directory and import path: each rank runs the command there, where its node has
    #: them, so that relative paths and the user's modules mean what they mean on the driver
    cwd: str | None = None
    paths: tuple = ()
    #: a hosted trainer's recipe payload (its constructor's arguments): ``[object-store reference]``, put
    #: there once per trainer; a rank fetches it only when it builds the trainer
    payload: list = ()
    #: the recipe keys of the hosted trainers of the driver that still may call this group again (alive,
    #: having run on it): their ranks' trainers are kept, every other one is freed (worker/hosted.py)
    keep: tuple = ()
    #: the driver process that sent it (a kept group serves one script's run after another's)
    driver: str = ""
    #: the trackers' settings in the driver's environment (integrations.TRACKER_ENV): set on each rank for
    #: the command, where transformers' trackers run
    environ: tuple = ()


@dataclass(frozen=True)
class Event:
    """Rank -> driver, batched and sent without waiting."""

    kind: Kind
    rank: int
    payload: Any


@dataclass(frozen=True)
class LogLine:
    """A log record of any rank (formatted there) or a line it wrote to stdout/stderr."""

    levelno: int
    text: str


@dataclass(frozen=True)
class CallbackEvent:
    """Rank 0's callback event, replayed into the driver's display callbacks: the event's name, the fields
    of the state they read, and the event's keyword arguments (logs, metrics, or for ``on_prediction_step``
    the batches done and the total)."""

    name: str
    state: dict
    kwargs: dict


@dataclass(frozen=True)
class CheckpointCommitted:
    """Rank 0 committed checkpoint ``name`` (every rank's share is in storage) at ``step``."""

    name: str
    step: int
    uri: str
    best_model_checkpoint: str | None = None
    best_metric: float | None = None


@dataclass(frozen=True)
class CheckpointPart:
    """One rank's share of a hosted trainer's checkpoint ``name`` (at ``uri``) is in storage: its files
    (name -> size and sha256), and how many parts the checkpoint has; the driver commits it when all have
    come (worker/hosted_commit.py), and the channel then offers it to a restart (``Attempt``). Rank 0's part
    carries the best checkpoint's name and metric."""

    name: str
    step: int
    uri: str
    files: dict
    parts: int
    best_model_checkpoint: str | None = None
    best_metric: float | None = None


@dataclass(frozen=True)
class Pace:
    """Each rank's seconds per step since the last logging step (a world-size list) and its node."""

    seconds_per_step: list
    nodes: list


@dataclass(frozen=True)
class Attempt:
    """Channel -> rank 0 at each start of a command: the attempt's number (0, then 1 after the first
    restart...), the latest checkpoint the command committed so far, and whether an earlier attempt failed
    deterministically (then this one must not train); the attempt's world size and the one before it (they
    differ where an elastic run's group shrank or grew). Also an event, so the driver numbers evaluations per
    attempt."""

    number: int
    latest_checkpoint: str | None = None
    failed: bool = False
    world_size: int | None = None
    previous_world_size: int | None = None


@dataclass
class RankResult:
    """Rank -> driver at the end of a command. Every rank reports its ``global_step``; rank 0 also the
    method's output, the final ``TrainerState`` (as a dict), where the trained weights were written, the
    attributes of its worker-side callbacks (``(class name, attributes)`` pairs), and the entries the
    command added to ``state.log_history`` (an ``evaluate``'s metrics)."""

    global_step: int
    output: Any = None
    state: dict | None = None
    weights_at: str | None = None
    callbacks: list | None = None
    logged: list | None = None


@dataclass(frozen=True)
class Fatal:
    """Rank -> channel: the rank's deterministic failure, pickled (failures.py)."""

    rank: int
    error: bytes


class Message(NamedTuple):
    name: str
    payload: type | None  # the class that carries it (its fields are the message's)
    sender: str
    receiver: str
    when: str


#: Every message of the protocol (the channel's methods carry them); docs/architecture.md shows this table.
MESSAGES: tuple[Message, ...] = (
    Message("Command", Command, "driver", "every rank", "one per Trainer call (train, evaluate, predict; "
            "for a hosted trainer any other method or attribute too)"),
    Message("Spec", Spec, "driver (into the object store once)", "every rank (fetches it)",
            "with each command"),
    Message("Attempt", Attempt, "channel", "rank 0 (broadcast to every rank); the driver as an event",
            "at each start of a command, again after Ray Train restarted the workers"),
    Message("Event(LOG)", LogLine, "every rank", "driver", "each log record and output line, batched"),
    Message("Event(CALLBACK)", CallbackEvent, "rank 0", "driver", "each callback event (step and "
            "prediction-step events throttled to a few a second)"),
    Message("Event(CHECKPOINT)", CheckpointCommitted, "rank 0", "driver", "when every rank's share of a "
            "checkpoint is in storage"),
    Message("Event(CHECKPOINT_PART)", CheckpointPart, "each rank holding files of a hosted trainer's "
            "checkpoint", "driver (writes the manifest when every part has come)", "when its files are "
            "hashed and in storage"),
    Message("Event(PACE)", Pace, "rank 0", "driver", "at each logging step (straggler warnings)"),
    Message("stop request", None, "driver", "rank 0 (polled between steps)", "when a driver-side callback "
            "set should_training_stop"),
    Message("evaluation decision", None, "driver", "rank 0 (waits for it, broadcasts it)", "after each "
            "evaluation, when a driver-side callback may stop training"),
    Message("growth request", None, "Ray Train's controller (an elastic run's scaling policy)",
            "rank 0 (polled at the preemption check); rank 0 answers once the checkpoint is committed",
            "when the cluster has room for more workers during train: the group grows from that checkpoint"),
    Message("Fatal", Fatal, "the failing rank", "channel (then the driver)", "on a deterministic error: "
            "no restart trains again, the group ends"),
    Message("RankResult", RankResult, "every rank", "driver", "at the end of each command"),
    Message("close", None, "driver", "every rank", "the group ends: each rank's command loop returns"),
)


def markdown_table() -> str:
    """``MESSAGES`` as the Markdown table docs/architecture.md holds (tests/unit/test_protocol.py)."""
    from dataclasses import fields

    rows = ["| message | fields | from | to | when |", "|---|---|---|---|---|"]
    for m in MESSAGES:
        names = ", ".join(f.name for f in fields(m.payload)) if m.payload is not None else "(none)"
        rows.append(f"| {m.name} | {names} | {m.sender} | {m.receiver} | {m.when} |")
    return "\n".join(rows)
