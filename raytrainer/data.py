"""Collation and column removal as transformers' Trainer does them (its own collator; a collator that drops
the columns the model's forward does not take), and a Ray Data training set read as batches on each Ray
Train worker from its shard (``RayDataBatches``). Each rank's share of any other dataset is accelerate's,
under transformers' own loop (raytrainer/one_loop.py)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping

import numpy as np
import torch
from torch.utils.data import IterableDataset
from transformers.data.data_collator import default_data_collator as _default_data_collator
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


# -- Ray Data ----------------------------------------------------------------------------------------
def is_ray_dataset(obj) -> bool:
    """A ``ray.data.Dataset``, or one made a training set transformers' loop takes (``RayTrainingSet``)."""
    return isinstance(obj, RayTrainingSet) or (
        type(obj).__module__.startswith("ray.data") and hasattr(obj, "iter_torch_batches"))


#: Rows of Ray Data's local shuffle buffer per batch row (at least ``_SHUFFLE_MIN_ROWS``): each worker
#: shuffles its stream through a buffer of this many rows, a new seed every epoch. A global shuffle
#: (``random_shuffle``) would move the whole data set across the network every epoch.
_SHUFFLE_BATCHES = 16
_SHUFFLE_MIN_ROWS = 256


class RayTrainingSet:
    """A Ray Data training set as transformers' Trainer takes one: with a length (its rows, counted once on
    the driver), so that its loop sizes the epoch and the schedule as for any sized data set. Each rank reads
    it through ``ray_data_loader``, from its own shard on a Ray Train worker."""

    def __init__(self, dataset, rows: int):
        self.dataset, self.rows = dataset, rows

    def __len__(self) -> int:
        return self.rows

    def take(self, n: int) -> list:  # the driver's checks read its first examples (driver/preflight.py)
        return self.dataset.take(n)


def uses_ray_data(*datasets) -> bool:
    """Whether any of ``datasets`` (or of the evaluation sets a mapping holds) is a Ray Dataset."""
    return any(uses_ray_data(*d.values()) if isinstance(d, Mapping) else is_ray_dataset(d) for d in datasets)


def ray_data_as_transformers_takes_it(train_dataset, eval_dataset):
    """The constructor's data sets with a Ray Dataset made what transformers' loop reads: a training set
    sized (``RayTrainingSet``), an evaluation set read into its rows (``ray_data_rows``). Ray must be
    started first, the way raytrainer starts it (Ray Data would start it on its own, with no CPU to
    spare: driver/ray_runtime.ensure_ray)."""
    if is_ray_dataset(train_dataset) and not isinstance(train_dataset, RayTrainingSet):
        train_dataset = RayTrainingSet(train_dataset, train_dataset.count())
    return train_dataset, ray_data_rows(eval_dataset)


def ray_data_rows(dataset):
    """A Ray Dataset used for evaluation (or a mapping holding some), read here into rows. Evaluation needs
    every example once and in order; and a worker cannot read a Ray Dataset itself: Ray Data's tasks would
    wait for CPUs inside the Ray Train placement group that the workers hold."""
    if isinstance(dataset, Mapping):
        return {k: ray_data_rows(v) for k, v in dataset.items()}
    return dataset.take_all() if is_ray_dataset(dataset) else dataset


def ray_data_loader(trainer, ctx):
    """``get_train_dataloader`` for a ``RayTrainingSet`` on a rank (``ctx``): its batches, from this Ray Train
    worker's shard (the driver padded the data set to a multiple of the workers: ``pad_ray_dataset``), or
    from the whole data set in the driver's own process; in a new order every epoch, seeded ``data_seed``
    (else ``seed``) + the epoch transformers' loop is in (``state.epoch``, so a resumed run reads its epoch's
    order), unless ``train_sampling_strategy="sequential"``. A torch ``DataLoader`` over them, so that
    transformers' loop skips a resumed epoch's first batches as it skips any loader's."""
    from torch.utils.data import DataLoader

    args, dataset = trainer.args, trainer.train_dataset
    if ctx.on_ray:
        import ray.train

        source, rows = ray.train.get_dataset_shard("train"), -(-dataset.rows // ctx.world_size)
    else:
        source, rows = dataset.dataset, dataset.rows
    keep = signature_columns(trainer.model, trainer.label_names) if args.remove_unused_columns else None
    seed = None if args.train_sampling_strategy == "sequential" else (
        args.seed if args.data_seed is None else args.data_seed)
    batches = RayDataBatches(source, trainer._train_batch_size, rows, keep, args.dataloader_drop_last, seed)
    stream = _EpochStream(batches, lambda: int(trainer.state.epoch or 0))
    counted = type(trainer).num_examples  # transformers' "Num examples": the data set's rows, as for any set
    trainer.num_examples = lambda loader: (dataset.rows if getattr(loader, "dataset", None) is stream
                                           else counted(trainer, loader))
    return DataLoader(stream, batch_size=None)


class _EpochStream(IterableDataset):
    """``RayDataBatches`` as a torch data set of batches, told the epoch when each pass begins."""

    def __init__(self, batches: RayDataBatches, epoch):
        self.batches, self.epoch = batches, epoch

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        self.batches.set_epoch(self.epoch())
        return iter(self.batches)


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
