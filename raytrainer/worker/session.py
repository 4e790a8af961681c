"""What one rank holds while it runs one command -- its place in the run, its end of the channel, its
strategy and checkpoint writer -- in one object, made by ``worker/rank.run_rank`` and passed to the loops.

The Trainer refers to it as ``trainer._session`` while the command runs (its methods -- ``training_step``,
``prediction_step``, ``save_model``, the accelerator surface -- run on the rank and need the rank's view);
it never travels: the Trainer pickled to the workers carries the user's state only, and each rank makes its
own session after unpickling it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for readers; nothing here is imported at run time
    from raytrainer.protocol import CheckpointCommitted, Pace
    from raytrainer.rank_context import RankContext
    from raytrainer.strategies.base import Strategy
    from raytrainer.worker.channel_client import ChannelClient
    from raytrainer.worker.checkpointing import CheckpointWriter


@dataclass
class RankSession:
    ctx: RankContext
    #: the rank's end of the group's channel; None in the driver's own process (``num_workers=0``)
    channel: ChannelClient | None = None
    #: told of each committed checkpoint: the channel (rank 0 on Ray) or the driver's registry (in process)
    checkpoint_sink: Callable[[CheckpointCommitted], Any] | None = None
    #: told of each rank's pace at each logging step (rank 0 on Ray)
    pace_sink: Callable[[Pace], Any] | None = None
    #: the command's attempt: 0, then 1 after Ray Train's first restart of the workers...
    attempt: int = 0
    #: rows of a Ray Dataset training set, counted once by the driver (each rank sizes its epoch with it)
    ray_data_rows: int | None = None
    #: the driver's transformers log level when the call was sent (worker/logs.py follows it)
    transformers_log_level: int | None = None
    #: chosen when the model is set up (``strategies.select_strategy``)
    strategy: Strategy | None = None
    #: the rank's checkpoint writer during ``train()``
    writer: CheckpointWriter | None = None
    #: micro-batches in the current gradient-accumulation window (the loss is divided by it)
    micro_steps: int | None = None
