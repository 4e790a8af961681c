"""Elastic runs: ``num_workers=(min, max)`` (``--num_workers 2:4``) trains on as many workers as the cluster
holds, between ``min`` and ``max``, on Ray Train's elastic scaling.

Ray Train starts the group with as many workers as fit (at least ``min``); when a worker's node is lost it
starts the group again on what is left (``max_failures`` counts that restart, as any lost worker), and the
``train`` command resumes from the checkpoint the run last committed, on the new world size -- every
strategy reshards a checkpoint onto another number of ranks.

What keeps such a run the same run is its global batch, fixed at its full size: ``per_device_train_batch_size
* gradient_accumulation_steps * max``. On W workers each rank trains ``global / W`` samples per optimizer
step: the per-device batch as given where it divides that, else the largest that does (never larger: the
memory it was sized for), with ``gradient_accumulation_steps`` making up the rest. A step is then the same
number of samples on every world size, so ``max_steps``, the epoch's length in steps and the learning-rate
schedule keep their meaning, and the data position carries over as samples seen: each optimizer step
trains a contiguous block of the epoch's one permutation (the same for every world size: the ranks deal out
its batches in turn, data.rank_batches), whatever W is. A ``(min, max)`` whose global batch some W in
between cannot split evenly is refused before any worker starts.
"""

from __future__ import annotations

import logging
import math
import re

logger = logging.getLogger(__name__)

#: How long the ranks wait, after committing the checkpoint a growth asked for, for Ray Train to restart
#: the group bigger (driver/scaling_policy.py); past it they train on, and a later growth asks again.
GROWTH_HOLD_S = 60.0

_RANGE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def parse_workers(value):
    """``num_workers`` as given -- an int, ``(min, max)``, or a command-line string ``"4"`` / ``"2:4"`` --
    as an int or a ``(min, max)`` tuple of ints; None where it is none of these."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            return int(text)
        match = _RANGE.match(text)
        return (int(match[1]), int(match[2])) if match else None
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        return (value[0], value[1])
    return None


def global_batch(args) -> int:
    """The run's global batch: its size at ``max`` workers."""
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * args.max_workers


def batch_for(world: int, total: int, per_device: int) -> tuple[int, int]:
    """(per-device batch, gradient accumulation steps) that make ``total`` samples per optimizer step on
    ``world`` ranks: the per-device batch at most ``per_device``, as large as divides the rank's share."""
    share = total // world
    batch = max(b for b in range(1, min(per_device, share) + 1) if share % b == 0)
    return batch, share // batch


def check(args) -> None:
    """Refuse, on the driver, a worker range over which the global batch cannot be kept."""
    low, high = args.min_workers, args.max_workers
    given = f"num_workers=({low}, {high})"
    if not 1 <= low < high:
        raise ValueError(f"{given}: an elastic range needs 1 <= min < max; pass e.g. --num_workers 2:4, or "
                         f"one number for a fixed size")
    if args.auto_find_batch_size:
        raise ValueError(f"{given} with auto_find_batch_size=True: an elastic run keeps its global batch "
                         "by setting the per-device batch for each world size, which auto_find_batch_size "
                         "would change again; pass one of the two")
    if args.max_failures == 0:
        logger.warning("%s with max_failures=0: a node lost mid-run ends the run (Ray Train counts it as a "
                       "failure) instead of going on with the workers left; pass e.g. --max_failures 3 "
                       "(-1: any number)", given)
    total = global_batch(args)
    uneven = [w for w in range(low, high + 1) if total % w]
    if uneven:
        lcm = math.lcm(*range(low, high + 1))
        raise ValueError(
            f"{given}: the global batch, per_device_train_batch_size={args.per_device_train_batch_size} x "
            f"gradient_accumulation_steps={args.gradient_accumulation_steps} x {high} workers = {total}, "
            f"cannot be split evenly over {', '.join(map(str, uneven))} worker(s), so a run that shrinks to "
            f"that size would change its batch. Make it a multiple of {lcm} (every size from {low} to "
            f"{high} divides it), or narrow the range")


def batch_at(args, world: int) -> tuple[int, int]:
    """(per_device_train_batch_size, gradient_accumulation_steps) of an elastic run's ranks on ``world``
    workers, keeping its global batch (``args`` as the user set them: each call gets them afresh)."""
    per_device, steps = args.per_device_train_batch_size, args.gradient_accumulation_steps
    batch, accumulation = batch_for(world, global_batch(args), per_device)
    if (batch, accumulation) != (per_device, steps):
        logger.info("%d workers of at most %d: per_device_train_batch_size=%d, gradient_accumulation_steps="
                    "%d keep the global batch of %d", world, args.max_workers, batch, accumulation,
                    global_batch(args))
    return batch, accumulation


