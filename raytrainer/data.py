"""Collation, column removal and per-rank sharding of datasets.

Training shards with ``DistributedSampler`` (one permutation per epoch from ``data_seed``/``seed``, so a
run with W ranks of batch B sees the same global batches as one rank of batch W*B). Evaluation shards in
contiguous blocks of one batch, rank r taking blocks r, r+W, r+2W...; every rank runs the same number of
batches (the tail is padded by repeating the first examples) and ``unshard`` puts the gathered blocks
back in dataset order and cuts the padding, so every example is counted exactly once.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DistributedSampler, IterableDataset, Sampler

LABEL_KEYS = ("label", "label_ids", "labels")


# -- collation ---------------------------------------------------------------------------------------
def _as_mapping(example) -> Mapping:
    if isinstance(example, Mapping):
        return example
    if hasattr(example, "__dataclass_fields__"):
        return vars(example)
    raise TypeError(
        f"each example must be a dict of model inputs (got {type(example).__name__}); "
        "return e.g. {'input_ids': ..., 'labels': ...} from your dataset's __getitem__"
    )


def default_data_collator(features: list, return_tensors: str = "pt") -> dict[str, Any]:
    """Stack a list of dict examples into a batch of tensors, as HF's ``default_data_collator``.

    ``label`` / ``label_ids`` become ``labels``; strings and None values are left out.
    """
    if return_tensors != "pt":
        raise ValueError(f"return_tensors={return_tensors!r}: raytrainer collates to PyTorch tensors only")
    features = [_as_mapping(f) for f in features]
    first = features[0]
    batch: dict[str, Any] = {}
    for key in ("label", "label_ids"):
        if key in first and first[key] is not None:
            value = first[key]
            if isinstance(value, torch.Tensor):
                batch["labels"] = torch.stack([f[key] for f in features])
            else:
                is_int = isinstance(value, (int, np.integer)) or (
                    isinstance(value, (list, tuple, np.ndarray)) and np.asarray(value).dtype.kind in "iu"
                )
                dtype = torch.long if is_int else torch.float
                batch["labels"] = torch.tensor(np.array([f[key] for f in features]), dtype=dtype)
            break
    for key, value in first.items():
        if key in ("label", "label_ids") or value is None or isinstance(value, str):
            continue
        if isinstance(value, torch.Tensor):
            batch[key] = torch.stack([f[key] for f in features])
        elif isinstance(value, np.ndarray):
            batch[key] = torch.from_numpy(np.stack([f[key] for f in features]))
        else:
            batch[key] = torch.tensor([f[key] for f in features])
    return batch


def signature_columns(model: torch.nn.Module, label_names: list[str]) -> set[str] | None:
    """Input names ``model.forward`` accepts, plus label columns; None when it takes ``**kwargs``."""
    params = inspect.signature(model.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return set(params) | set(label_names) | set(LABEL_KEYS)


class RemoveColumnsCollator:
    """Drop the keys the model's forward does not take, then collate (HF's ``RemoveColumnsCollator``)."""

    def __init__(self, collator, keep: set[str]):
        self.collator = collator
        self.keep = keep

    def __call__(self, features: list):
        features = [{k: v for k, v in _as_mapping(f).items() if k in self.keep} for f in features]
        return self.collator(features)


def default_label_names(model: torch.nn.Module) -> list[str]:
    """HF's rule: forward parameters whose name contains 'label' (``labels`` when there are none)."""
    names = [p for p in inspect.signature(model.forward).parameters if "label" in p]
    return names or ["labels"]


# -- training samplers ----------------------------------------------------------------------------------
def _example_length(example, column: str) -> int:
    example = _as_mapping(example)
    if column in example:
        return int(example[column])
    return len(example["input_ids"])


class LengthGroupedDistributedSampler(DistributedSampler):
    """``group_by_length``: shuffled, then sorted by length inside mega-batches of 50 batches.

    Examples of similar length share batches (less padding) while the order stays random per epoch.
    """

    def __init__(self, dataset, batch_size: int, lengths: list[int] | None = None,
                 length_column_name: str = "length", **kwargs):
        super().__init__(dataset, **kwargs)
        if lengths is None:
            column_names = getattr(dataset, "column_names", None)
            if column_names is not None and length_column_name in column_names:
                lengths = list(dataset[length_column_name])
            else:
                lengths = [_example_length(dataset[i], length_column_name) for i in range(len(dataset))]
        self.lengths = lengths
        self.mega = batch_size * self.num_replicas * 50

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        perm = torch.randperm(len(self.lengths), generator=g).tolist()
        groups = [perm[i:i + self.mega] for i in range(0, len(perm), self.mega)]
        indices = [i for grp in groups for i in sorted(grp, key=lambda j: -self.lengths[j])]
        if self.drop_last:
            indices = indices[: self.total_size]
        else:
            indices += indices[: self.total_size - len(indices)]
        return iter(indices[self.rank: self.total_size: self.num_replicas])


# -- iterable datasets -------------------------------------------------------------------------------
class IterableShard(IterableDataset):
    """This rank's share of an iterable dataset, one batch at a time.

    Reads ``batch_size * world_size`` examples, keeps block ``rank``; the last incomplete round is
    dropped (``drop_last``) or completed with the first examples of the stream, so every rank yields
    the same number of batches. ``num_real`` counts the examples of the stream seen (for evaluation).
    """

    def __init__(self, dataset: Iterable, batch_size: int, world_size: int, rank: int,
                 drop_last: bool = False):
        self.dataset = dataset
        self.batch_size = batch_size
        self.world_size = world_size
        self.rank = rank
        self.drop_last = drop_last
        self.num_real = 0

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self):
        round_size = self.batch_size * self.world_size
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        first: list = []
        buf: list = []
        self.num_real = 0
        for example in self.dataset:
            self.num_real += 1
            if len(first) < round_size:
                first.append(example)
            buf.append(example)
            if len(buf) == round_size:
                yield from buf[lo:hi]
                buf = []
        if buf and not self.drop_last:
            while len(buf) < round_size:
                buf.extend(first[: round_size - len(buf)])
            yield from buf[lo:hi]


# -- evaluation sharding ---------------------------------------------------------------------------------
class EvalBlockSampler(Sampler[int]):
    """Rank r's evaluation indices: blocks r, r+W, ... of ``batch_size`` consecutive examples."""

    def __init__(self, num_examples: int, batch_size: int, world_size: int, rank: int):
        self.num_examples = num_examples
        round_size = batch_size * world_size
        total = max(1, math.ceil(num_examples / round_size)) * round_size
        padded = [i % max(num_examples, 1) for i in range(total)]
        self.indices = [
            i
            for start in range(rank * batch_size, total, round_size)
            for i in padded[start:start + batch_size]
        ]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def unshard(per_rank: list[np.ndarray], batch_size: int, num_examples: int) -> np.ndarray:
    """Inverse of block sharding: interleave the ranks' blocks and drop the padded tail."""
    if len(per_rank) == 1:
        return per_rank[0][:num_examples]
    blocks = [np.split(a, range(batch_size, len(a), batch_size)) if len(a) else [] for a in per_rank]
    ordered = [b for round_ in zip(*blocks) for b in round_]
    return np.concatenate(ordered)[:num_examples]
