"""What one rank holds while it runs one command -- its place in the run, its end of the channel, the
attempt, the checkpoint commit -- in one object, made by the rank's command loop (worker/entry.py) and
passed to ``worker/hosted.run_hosted``. It never travels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for readers; nothing here is imported at run time
    from raytrainer.rank_context import RankContext
    from raytrainer.worker.channel_client import ChannelClient
    from raytrainer.worker.hosted_commit import CommitCallback


@dataclass
class RankSession:
    ctx: RankContext
    #: the rank's end of the group's channel; None in the driver's own process (``num_workers=0``)
    channel: ChannelClient | None = None
    #: the command's attempt: 0, then 1 after Ray Train's first restart of the workers...
    attempt: int = 0
    #: the driver's transformers log level when the call was sent (worker/logs.py follows it)
    transformers_log_level: int | None = None
    #: the rank's checkpoint commit during ``train()`` (a preemption notice's save commits through it)
    writer: CommitCallback | None = None
