"""Collation, column removal and per-rank sharding of datasets.

Training deals batches out as accelerate does under ``torchrun`` (``BatchSamplerShard``): one order over
the whole dataset per epoch (``data_seed``/``seed`` + epoch), cut into batches of B, rank r taking batches
r, r+W, r+2W..., so each rank reads what it would read under transformers' Trainer and a run with W ranks of
batch B sees the same global batches as one rank of batch W*B. Evaluation shards in
contiguous blocks of one batch, rank r taking blocks r, r+W, r+2W...; every rank runs the same number of
batches, and ``unshard`` puts the gathered rows back at their dataset positions, so every example is
counted exactly once and in order.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch
from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler
from transformers.data.data_collator import default_data_collator as _default_data_collator
from transformers.trainer_pt_utils import DistributedLengthGroupedSampler, find_batch_size
from transformers.trainer_utils import RemoveColumnsCollator as _RemoveColumnsCollator

LABEL_KEYS = ("label", "label_ids", "labels")


# -- collation ---------------------------------------------------------------------------------------
# transformers' own: label / label_ids become labels, strings and None are left out. A dataset whose
# examples are not dicts is refused by the driver's pre-flight with a message saying so.
default_data_collator = _default_data_collator


def _as_mapping(example) -> Mapping:
    if isinstance(example, Mapping):
        return example
    if hasattr(example, "__dataclass_fields__"):
        return vars(example)
    raise TypeError(
        f"each example must be a dict of model inputs (got {type(example).__name__}); "
        "return e.g. {'input_ids': ..., 'labels': ...} from your dataset's __getitem__"
    )


def batch_size_of(inputs, default: int = 1) -> int:
    """The number of examples in a batch: transformers' ``find_batch_size`` (the first dimension of its
    first non-scalar tensor), ``default`` where it finds none."""
    size = find_batch_size(inputs)
    return default if size is None else size


def signature_columns(model: torch.nn.Module, label_names: list[str]) -> set[str] | None:
    """Input names ``model.forward`` names, plus label columns, as transformers keeps them: a forward that
    also takes ``**kwargs`` (every transformers 5 model) still gets only its named inputs. None (remove
    nothing) for a forward that names no input at all (``forward(self, **batch)``), where transformers
    would find no column to keep."""
    named = {name for name, p in inspect.signature(model.forward).parameters.items()
             if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)}
    if not named:
        return None
    return named | set(label_names) | set(LABEL_KEYS)


def collator_for(trainer, dataset):
    """``trainer``'s data collator, wrapped to drop the columns its model's forward does not take
    (``remove_unused_columns``) where ``dataset``'s first example has any."""
    if not trainer.args.remove_unused_columns:
        return trainer.data_collator
    keep = signature_columns(trainer.model, trainer.label_names)
    if keep is None or first_keys_within(dataset, keep):
        return trainer.data_collator  # nothing to remove: no per-batch filtering
    return RemoveColumnsCollator(trainer.data_collator, keep, logger=logging.getLogger("raytrainer.trainer"),
                                 model_name=type(trainer.model).__name__)


def first_keys_within(dataset, keep: set[str]) -> bool:
    """Whether a map-style dataset's first and last examples hold only columns in ``keep``; examples
    are then taken as uniform and column removal is skipped (no per-batch filtering)."""
    try:
        ends = [dataset[0], dataset[len(dataset) - 1]]
    except Exception:  # iterable, or not indexable by position: filter every batch
        return False
    return all(isinstance(e, Mapping) and set(e) <= keep for e in ends)


class RemoveColumnsCollator(_RemoveColumnsCollator):
    """transformers' ``RemoveColumnsCollator``, for examples of any mapping or dataclass (transformers' passes
    an example that is not a ``dict``, a ``BatchEncoding`` say, to the collator whole)."""

    def _remove_columns(self, feature) -> dict:
        return super()._remove_columns(dict(_as_mapping(feature)))


def default_label_names(model: torch.nn.Module) -> list[str]:
    """HF's rule: forward parameters whose name contains 'label' (``labels`` when there are none)."""
    names = [p for p in inspect.signature(model.forward).parameters if "label" in p]
    return names or ["labels"]


# -- training samplers ----------------------------------------------------------------------------------
def example_lengths(dataset, length_column_name: str = "length") -> list[int]:
    """``group_by_length``'s lengths: the ``length_column_name`` column, else each example's value of that
    key, else the length of its ``input_ids``."""
    column_names = getattr(dataset, "column_names", None)
    if column_names is not None and length_column_name in column_names:
        return list(dataset[length_column_name])
    lengths = []
    for i in range(len(dataset)):
        example = _as_mapping(dataset[i])
        lengths.append(int(example[length_column_name]) if length_column_name in example
                       else len(example["input_ids"]))
    return lengths


def length_grouped_sampler(dataset, global_batch: int, seed: int, length_column_name: str = "length",
                           lengths=None):
    """``group_by_length``: the whole dataset in transformers' length-grouped order over the GLOBAL batch
    (``get_length_grouped_indices``, seeded ``seed`` + epoch): it depends on the global batch only, so a run
    with W ranks of batch B sees the same global batches as one rank of batch W*B."""
    if lengths is None:
        lengths = example_lengths(dataset, length_column_name)
    return DistributedLengthGroupedSampler(global_batch, num_replicas=1, rank=0, seed=seed, lengths=lengths)


def rank_batches(sampler, batch_size: int, drop_last: bool, num_replicas: int, rank: int) -> BatchSampler:
    """This rank's batches of ``sampler``'s order, as accelerate shards a loader under ``torchrun``: every
    rank walks the same batches of ``batch_size`` and keeps those at positions ``rank``, ``rank +
    num_replicas``...; the last round is filled from the epoch's first examples (none dropped) unless
    ``drop_last``, so every rank runs the same number of steps. ``set_epoch`` reaches ``sampler`` through
    it."""
    batches = BatchSampler(sampler, batch_size, drop_last)
    if num_replicas == 1:  # one rank reads every batch, the last one as short as it comes
        return batches
    return BatchSamplerShard(batches, num_processes=num_replicas, process_index=rank)


def set_epoch(loader, epoch: int) -> None:
    """Tell a training loader which epoch it reads, as accelerate's loaders do: the loader itself where it
    knows how (a Ray Data stream, accelerate's own), else its sampler however deep in its batch samplers,
    else its dataset."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
        return
    batch_sampler = getattr(loader, "batch_sampler", None)
    for holder in (getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None),
                   getattr(getattr(batch_sampler, "batch_sampler", None), "sampler", None)):
        if hasattr(holder, "set_epoch"):
            holder.set_epoch(epoch)
            return
    if hasattr(getattr(loader, "dataset", None), "set_epoch"):
        loader.dataset.set_epoch(epoch)


# -- resuming mid-epoch ----------------------------------------------------------------------------------
# What a DataLoader is built from, besides its batches; the skipping loader takes them all from the original.
_LOADER_SETTINGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                    "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers",
                    "pin_memory_device", "in_order")


def skip_first_batches(loader, num_batches: int) -> DataLoader | None:
    """A loader yielding ``loader``'s batches after its first ``num_batches``, which are skipped at the batch
    sampler: their indices are drawn (cheap) but no example is read or collated. None where that cannot be
    done (an iterable dataset, a loader that is not a plain ``DataLoader``, one without a batch sampler):
    the caller then reads and drops the batches.

    The original batch sampler is wrapped, not copied, so the sampler the training loop ``set_epoch``s is
    the one that draws the indices; collate_fn, workers, pinning and the generator are the original's.
    Unlike accelerate's ``skip_first_batches`` this creates no accelerate state (no ``PartialState``).
    """
    if (type(loader) is not DataLoader or isinstance(loader.dataset, IterableDataset)
            or loader.batch_sampler is None):
        return None
    from accelerate.data_loader import SkipBatchSampler

    settings = {name: getattr(loader, name) for name in _LOADER_SETTINGS if hasattr(loader, name)}
    settings["persistent_workers"] = False  # it serves one epoch: its workers end with it
    return DataLoader(loader.dataset, batch_sampler=SkipBatchSampler(loader.batch_sampler, num_batches),
                      **settings)


def shard_loader(loader, num_replicas: int, rank: int, seed: int):
    """``loader`` as accelerate's ``prepare`` hands it to one of ``num_replicas`` processes, from the same
    pieces (its ``prepare_data_loader`` would also create accelerate's process state, which raytrainer's
    ranks do without): a map-style loader keeps this rank's batches of its batch sampler
    (``BatchSamplerShard``; a ``RandomSampler`` becomes accelerate's seeded one, so every rank shuffles
    alike), an iterable one reads this rank's share of each round (``IterableDatasetShard``). What is not a
    plain ``DataLoader`` comes back as given, as does any loader on one rank."""
    if type(loader) is not DataLoader or num_replicas == 1:
        return loader
    settings = {name: getattr(loader, name) for name in _LOADER_SETTINGS if hasattr(loader, name)}
    if isinstance(loader.dataset, IterableDataset):
        shard = IterableDatasetShard(loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last,
                                     num_processes=num_replicas, process_index=rank)
        return DataLoader(shard, batch_size=loader.batch_size, drop_last=loader.drop_last, **settings)
    batches = loader.batch_sampler
    if type(batches) is BatchSampler and type(batches.sampler) is torch.utils.data.RandomSampler:
        order = SeedableRandomSampler(loader.dataset, replacement=batches.sampler.replacement,
                                      num_samples=batches.sampler._num_samples, data_seed=seed)
        batches = BatchSampler(order, batches.batch_size, batches.drop_last)
    batches = BatchSamplerShard(batches, num_replicas, rank)
    return DataLoader(loader.dataset, batch_sampler=batches, **settings)


# -- evaluation sharding ---------------------------------------------------------------------------------
def eval_positions(num_examples: int, batch_size: int, world_size: int, rank: int) -> list[int | None]:
    """Dataset positions rank r evaluates: blocks r, r+W, ... of ``batch_size`` consecutive examples.

    The last round may leave a rank without a block; it then gets one dummy example (None) so that every
    rank runs the same number of batches. Dummies never share a batch with real examples, so they cannot
    change how a batch is padded, and ``unshard`` drops them.
    """
    round_size = batch_size * world_size
    rounds = -(-num_examples // round_size)  # none for no examples: every rank runs no batch
    positions: list[int | None] = []
    for start in range(rank * batch_size, rounds * round_size, round_size):
        block = list(range(start, min(start + batch_size, num_examples)))
        positions.extend(block if block else [None])
    return positions


def unshard(per_rank: list[np.ndarray], batch_size: int, num_examples: int) -> np.ndarray:
    """Inverse of block sharding: each rank's rows back at their dataset positions, dummies dropped."""
    world_size = len(per_rank)
    if world_size == 1:
        return per_rank[0][:num_examples]
    first = per_rank[0]
    out = np.empty((num_examples, *first.shape[1:]), dtype=first.dtype)
    for rank, rows in enumerate(per_rank):
        positions = eval_positions(num_examples, batch_size, world_size, rank)
        real = [i for i, p in enumerate(positions) if p is not None]
        out[[positions[i] for i in real]] = rows[real]
    return out


class EvalBlockSampler(Sampler[int]):
    """Rank r's evaluation indices (see ``eval_positions``; a dummy reads example 0)."""

    def __init__(self, num_examples: int, batch_size: int, world_size: int, rank: int):
        self.num_examples = num_examples
        self.indices = [p if p is not None else 0
                        for p in eval_positions(num_examples, batch_size, world_size, rank)]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


# -- iterable datasets -------------------------------------------------------------------------------
class IterableShard(IterableDataset):
    """This rank's share of an iterable dataset, one batch-sized block per round of W blocks.

    Training (``pad_rounds=True``): the last incomplete round is dropped (``drop_last``) or completed
    with the first examples of the stream, so every rank yields the same number of full batches.
    Evaluation (``pad_rounds=False``): blocks follow ``eval_positions`` — a rank left without a block in
    the last round yields one dummy example. ``num_real`` counts the stream's examples seen.
    """

    def __init__(self, dataset: Iterable, batch_size: int, world_size: int, rank: int,
                 drop_last: bool = False, pad_rounds: bool = True):
        self.dataset = dataset
        self.batch_size = batch_size
        self.world_size = world_size
        self.rank = rank
        self.drop_last = drop_last
        self.pad_rounds = pad_rounds
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
        if self.pad_rounds:
            if buf and not self.drop_last:
                while len(buf) < round_size:
                    buf.extend(first[: round_size - len(buf)])
                yield from buf[lo:hi]
        elif buf or self.num_real == 0:
            yield from (buf[lo:hi] or first[:1])


# -- Ray Data ----------------------------------------------------------------------------------------
def is_ray_dataset(obj) -> bool:
    return type(obj).__module__.startswith("ray.data") and hasattr(obj, "iter_torch_batches")


#: Rows of Ray Data's local shuffle buffer per batch row (at least ``_SHUFFLE_MIN_ROWS``): each worker
#: shuffles its stream through a buffer of this many rows, a new seed every epoch. A global shuffle
#: (``random_shuffle``) would move the whole data set across the network every epoch.
_SHUFFLE_BATCHES = 16
_SHUFFLE_MIN_ROWS = 256


def pad_ray_dataset(dataset, rows: int, world_size: int):
    """``dataset`` (of ``rows`` rows) with its first rows repeated until its row count divides by
    ``world_size``, as transformers' distributed sampler repeats examples, so that Ray Train's equal split
    drops none."""
    rest = rows % world_size
    return dataset if rest == 0 else dataset.union(dataset.limit(world_size - rest))


class RayDataBatches:
    """Batches from a Ray Data dataset, or from this worker's shard of it, shaped for the model.

    On Ray Train workers the source is ``ray.train.get_dataset_shard("train")``: the driver pads the data
    set to a multiple of W rows (``pad_ray_dataset``) and Ray splits it with ``equal=True``, so each of W
    ranks reads ``ceil(num_rows / W)`` rows and all run the same number of batches. ``shuffle_seed``: each
    epoch reads the rows through a local shuffle buffer seeded with ``shuffle_seed + epoch`` (``set_epoch``),
    so every epoch has its own order, the same in every run; None reads them in order.
    ``label`` / ``label_ids`` columns become ``labels``; columns outside ``keep`` are dropped.
    """

    def __init__(self, source, batch_size: int, num_rows: int, keep: set[str] | None, drop_last: bool,
                 shuffle_seed: int | None = None):
        self.dataset = source
        self.batch_size = batch_size
        self.num_rows = num_rows
        self.keep = keep
        self.drop_last = drop_last
        self.shuffle_seed = shuffle_seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        full, rest = divmod(self.num_rows, self.batch_size)
        return full + (0 if self.drop_last or rest == 0 else 1)

    def __iter__(self):
        shuffle = {}
        if self.shuffle_seed is not None:
            rows = max(_SHUFFLE_BATCHES * self.batch_size, _SHUFFLE_MIN_ROWS)
            shuffle = {"local_shuffle_buffer_size": rows,
                       "local_shuffle_seed": self.shuffle_seed + self.epoch}
        yield from self.dataset.iter_torch_batches(batch_size=self.batch_size, drop_last=self.drop_last,
                                                   collate_fn=_ray_collate(self.keep), **shuffle)


def _ray_collate(keep: set[str] | None):
    """Keep the model's columns (strings dropped), rename labels, copy into writable tensors."""
    from ray.data.collate_fn import NumpyBatchCollateFn

    class _Collate(NumpyBatchCollateFn):
        def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
            return {
                ("labels" if k in ("label", "label_ids") else k): torch.from_numpy(np.array(v))
                for k, v in batch.items()
                if (keep is None or k in keep) and v.dtype.kind not in "OUS"
            }

    return _Collate()
