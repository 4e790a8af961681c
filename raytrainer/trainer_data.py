"""The Trainer's data loaders, as transformers' Trainer names them (``get_train_dataloader``,
``get_eval_dataloader``, ``get_test_dataloader``, ``_get_train_sampler``, ``num_examples``, ...): a mixin of
``raytrainer.Trainer``, so a subclass's override is what runs on each rank. Each data-parallel rank reads
its share (the ranks of one tensor-parallel group read the same one): ``self._view`` is the rank's context
on a worker, the whole run's in one process."""

from __future__ import annotations

import functools
import logging
from typing import Any

from accelerate.data_loader import SeedableRandomSampler
from torch.utils.data import DataLoader, IterableDataset, SequentialSampler

from raytrainer import data as rdata
from raytrainer.trainer_utils import has_length, seed_worker

logger = logging.getLogger("raytrainer.trainer")


class DataLoadersMixin:
    def _collator_for(self, dataset):
        """The data collator, wrapped to drop columns forward() does not take (remove_unused_columns)."""
        return rdata.collator_for(self, dataset)

    def _loader_kwargs(self) -> dict[str, Any]:
        a = self.args
        kwargs = {"num_workers": a.dataloader_num_workers, "pin_memory": a.dataloader_pin_memory
                  and self._view.device.type == "cuda"}
        if a.dataloader_num_workers > 0:
            kwargs["persistent_workers"] = a.dataloader_persistent_workers
            kwargs["prefetch_factor"] = a.dataloader_prefetch_factor
            kwargs["worker_init_fn"] = functools.partial(seed_worker, num_workers=a.dataloader_num_workers,
                                                         rank=a.process_index)
            kwargs["in_order"] = a.dataloader_in_order
            if a.dataloader_multiprocessing_context is not None:
                kwargs["multiprocessing_context"] = a.dataloader_multiprocessing_context
        return kwargs

    def _data_seed(self) -> int:
        """The seed of the training data's order: ``data_seed``, else ``seed`` (as transformers)."""
        return self.args.data_seed if self.args.data_seed is not None else self.args.seed

    def _get_train_sampler(self, train_dataset=None):
        """The training examples' order over the whole dataset, as transformers' Trainer returns it: the
        loader then deals its batches out to the data-parallel ranks (``_dataloader``), so an override that
        returns a sampler of its own is sharded the same way."""
        a, ctx = self.args, self._view
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if a.train_sampling_strategy == "group_by_length":
            # grouped over the global batch (B x GA x W ranks): the order depends on it only
            return rdata.length_grouped_sampler(dataset, a.train_batch_size * a.gradient_accumulation_steps
                                                * ctx.dp_size, self._data_seed(), a.length_column_name)
        if a.train_sampling_strategy == "sequential":
            return SequentialSampler(dataset)
        return SeedableRandomSampler(dataset, data_seed=self._data_seed())

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return self._dataloader(self.train_dataset, self.args.train_batch_size, train=True)

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        """The evaluation loader for ``eval_dataset`` -- a dataset, the name of one of a dict
        ``eval_dataset``'s, or None for ``self.eval_dataset``. With dataloader_persistent_workers the loader
        is built once per name and reused, as transformers does (its workers stay alive between evaluations).
        """
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        key = eval_dataset if isinstance(eval_dataset, str) else "eval"
        cache = self.__dict__.setdefault("_eval_dataloaders", {})
        if self.args.dataloader_persistent_workers and key in cache:
            return cache[key]
        if isinstance(eval_dataset, str):
            dataset = self.eval_dataset[eval_dataset]
        else:
            dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        loader = self._dataloader(dataset, self.args.eval_batch_size, train=False)
        if self.args.dataloader_persistent_workers:
            cache[key] = loader
        return loader

    def get_test_dataloader(self, test_dataset) -> DataLoader:
        return self._dataloader(test_dataset, self.args.eval_batch_size, train=False)

    def _dataloader(self, dataset, batch_size: int, train: bool) -> DataLoader:
        ctx, a = self._view, self.args
        if rdata.is_ray_dataset(dataset):
            if not train:  # in-process evaluation: every example once, in order (see preflight)
                dataset = dataset.take_all()
            else:
                return self._ray_data_batches(dataset, batch_size)
        hf_like = hasattr(dataset, "remove_columns") and hasattr(dataset, "column_names")
        if hf_like and a.remove_unused_columns:
            keep = rdata.signature_columns(self.model, self.label_names)
            if keep is not None:
                dataset = dataset.remove_columns([c for c in dataset.column_names if c not in keep])
        collator = self._collator_for(dataset)
        if isinstance(dataset, IterableDataset) or not has_length(dataset):
            shard = rdata.IterableShard(dataset, batch_size, ctx.dp_size, ctx.dp_rank,
                                        drop_last=a.dataloader_drop_last and train, pad_rounds=train)
            # evaluation counts the stream's examples as it reads them: read in this process
            loader_kwargs = self._loader_kwargs() if train else {}
            loader = DataLoader(shard, batch_size=batch_size, collate_fn=collator, **loader_kwargs)
            return _with_total_batch_size(loader, batch_size * ctx.dp_size)
        if train:
            sampler = self._get_train_sampler(dataset)
            if sampler is None:  # an override's "no sampler": the dataset's order, as a DataLoader's default
                sampler = SequentialSampler(dataset)
            drop_last = a.dataloader_drop_last
            batches = rdata.rank_batches(sampler, batch_size, drop_last, ctx.dp_size, ctx.dp_rank)
            loader = DataLoader(dataset, batch_sampler=batches, collate_fn=collator, **self._loader_kwargs())
            return _with_total_batch_size(loader, batch_size * ctx.dp_size)
        # dataloader_drop_last: evaluation reads whole rounds of batches only, as transformers
        n = len(dataset)
        if a.dataloader_drop_last:
            n -= n % (batch_size * ctx.dp_size)
        sampler = rdata.EvalBlockSampler(n, batch_size, ctx.dp_size, ctx.dp_rank)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collator,
                            **self._loader_kwargs())
        return _with_total_batch_size(loader, batch_size * ctx.dp_size)

    def _ray_data_batches(self, dataset, batch_size: int) -> rdata.RayDataBatches:
        import ray.train

        ctx = self._view
        rows = self._session.ray_data_rows if self._session is not None else None
        if rows is None:  # in the driver's own process (num_workers=0): counted here
            rows = dataset.count()
            if self._session is not None:
                self._session.ray_data_rows = rows
        source = ray.train.get_dataset_shard("train") if ctx.on_ray else dataset
        keep = None
        if self.args.remove_unused_columns:
            keep = rdata.signature_columns(self.model, self.label_names)
        a = self.args
        seed = None if a.train_sampling_strategy == "sequential" else self._data_seed()
        per_rank = -(-rows // ctx.world_size) if ctx.on_ray else rows  # padded by the driver (launch.py)
        return rdata.RayDataBatches(source, batch_size, per_rank, keep, a.dataloader_drop_last, seed)

    def num_examples(self, dataloader: DataLoader) -> int:
        """The examples a loader reads: its dataset's length, else batches times the batch size (a loader
        without ``dataset`` or of an unsized one), as transformers."""
        sampler = getattr(dataloader, "sampler", None)
        if isinstance(sampler, rdata.EvalBlockSampler):
            return sampler.num_examples
        try:
            dataset = dataloader.dataset
            if isinstance(dataset, rdata.IterableShard):
                dataset = dataset.dataset
            return len(dataset)
        except (AttributeError, TypeError):
            return len(dataloader) * (getattr(dataloader, "batch_size", None)
                                      or self.args.per_device_train_batch_size)

    def num_tokens(self, train_dl: DataLoader, max_steps: int | None = None) -> int:
        tokens = 0
        for step, batch in enumerate(train_dl):
            tokens += batch["input_ids"].numel() if "input_ids" in batch else 0
            if max_steps is not None and step >= max_steps:
                break
        return tokens


def _with_total_batch_size(loader: DataLoader, total: int) -> DataLoader:
    """The examples one step reads across all ranks, as on the loaders transformers' Trainer returns
    (accelerate's ``total_batch_size``): the per-rank batch size times the world size."""
    loader.total_batch_size = total
    return loader
