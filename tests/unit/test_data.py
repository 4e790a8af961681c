"""Unit tests for raytrainer.data: collation and column removal as transformers'; the training batches each
rank of raytrainer's Trainer (transformers' loop) reads, on two real ranks."""

from __future__ import annotations

import functools
import itertools
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from transformers.trainer_pt_utils import get_length_grouped_indices
from transformers.trainer_utils import RemoveColumnsCollator as TransformersRemoveColumnsCollator
from two_ranks import run_two_ranks

from raytrainer import one_loop
from raytrainer.data import (
    RemoveColumnsCollator,
    default_data_collator,
    default_label_names,
    signature_columns,
)


# -- default_data_collator ---------------------------------------------------------------------------------
def test_collator_renames_int_label_to_long_labels():
    batch = default_data_collator([{"x": [1.0, 2.0], "label": 1}, {"x": [3.0, 4.0], "label": 0}])
    assert set(batch) == {"x", "labels"}
    assert batch["labels"].dtype == torch.long
    assert batch["labels"].tolist() == [1, 0]
    assert batch["x"].dtype == torch.float32
    assert batch["x"].tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_collator_float_labels_stay_float():
    batch = default_data_collator([{"x": [0.0], "label": 0.25}, {"x": [1.0], "label": 1.5}])
    assert batch["labels"].dtype == torch.float32
    assert batch["labels"].tolist() == [0.25, 1.5]


def test_collator_label_ids_lists_become_a_long_matrix():
    batch = default_data_collator([{"label_ids": [1, 2, 3]}, {"label_ids": [4, 5, 6]}])
    assert batch["labels"].dtype == torch.long
    assert batch["labels"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert "label_ids" not in batch


def test_collator_numpy_arrays_and_numpy_int_labels():
    features = [{"pixels": np.full((2, 2), i, dtype=np.float32), "label": np.int64(i)} for i in range(3)]
    batch = default_data_collator(features)
    assert batch["pixels"].shape == (3, 2, 2)
    assert batch["pixels"].dtype == torch.float32
    assert torch.equal(batch["pixels"][2], torch.full((2, 2), 2.0))
    assert batch["labels"].dtype == torch.long
    assert batch["labels"].tolist() == [0, 1, 2]


def test_collator_stacks_tensors_and_drops_strings_and_none():
    features = [
        {"input_ids": torch.tensor([1, 2]), "text": "a b", "extra": None, "labels": torch.tensor(1)},
        {"input_ids": torch.tensor([3, 4]), "text": "c d", "extra": None, "labels": torch.tensor(0)},
    ]
    batch = default_data_collator(features)
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].tolist() == [[1, 2], [3, 4]]
    assert batch["labels"].tolist() == [1, 0]


def test_collator_int32_tensor_label_becomes_long_as_in_hf():
    features = [{"x": [0.0], "label": torch.tensor(i, dtype=torch.int32)} for i in range(2)]
    batch = default_data_collator(features)
    assert batch["labels"].dtype == torch.long


def test_collator_accepts_dataclass_examples_and_rejects_other_types():
    @dataclass
    class Example:
        x: list
        label: int

    batch = default_data_collator([Example([1.0], 1), Example([2.0], 0)])
    assert batch["labels"].tolist() == [1, 0]
    with pytest.raises(TypeError):  # transformers' collator: vars() of a tuple
        default_data_collator([(1.0, 2.0)])


def test_examples_that_are_not_dicts_are_refused_on_the_driver(make_args, make_classifier):
    """transformers' collator fails obscurely on a tuple; the driver's pre-flight says why first."""
    from raytrainer import Trainer

    trainer = Trainer(model=make_classifier(), args=make_args(max_steps=1), train_dataset=[(1.0, 2.0)] * 4)
    with pytest.raises(ValueError, match=r"train_dataset\[0\] is a tuple; each example must be a dict"):
        trainer.train()


def test_default_data_collator_is_transformers_own():
    import transformers

    assert default_data_collator is transformers.default_data_collator


def test_remove_columns_collator_keeps_only_forward_inputs_and_labels():
    class Model(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, labels=None):
            return input_ids

    model = Model()
    keep = signature_columns(model, default_label_names(model))
    features = [{"input_ids": [1, 2], "attention_mask": [1, 1], "label": 1, "meta": [9.0], "idx": 0}] * 2
    batch = RemoveColumnsCollator(default_data_collator, keep)(features)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}

    class NamedAndKwargsModel(torch.nn.Module):  # transformers 5 models: named inputs and **kwargs
        def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
            return input_ids

    keep = signature_columns(NamedAndKwargsModel(), ["labels"])
    batch = RemoveColumnsCollator(default_data_collator, keep)(features)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}  # "meta", "idx" dropped, as transformers

    class KwargsModel(torch.nn.Module):
        def forward(self, **kwargs):
            return kwargs

    assert signature_columns(KwargsModel(), ["labels"]) is None  # names nothing: remove nothing


def test_remove_columns_collator_is_transformers_also_for_non_dict_examples():
    from transformers import BatchEncoding

    keep = {"input_ids", "labels"}
    features = [{"input_ids": [1, 2], "labels": 1, "meta": [9.0]},
                {"input_ids": [3, 4], "labels": 0, "meta": [8.0]}]
    ours = RemoveColumnsCollator(default_data_collator, keep)(features)
    theirs = TransformersRemoveColumnsCollator(default_data_collator, keep)(features)
    assert ours.keys() == theirs.keys() == keep
    assert all(torch.equal(ours[k], theirs[k]) for k in keep)
    # an example that is a mapping but not a dict has its columns removed too (transformers' passes it whole)
    batch = RemoveColumnsCollator(default_data_collator, keep)([BatchEncoding(f) for f in features])
    assert set(batch) == keep


# -- training batches: each rank reads what it reads under transformers' Trainer and torchrun ---------------
# Every rank here is a real one: one of two spawned processes in a gloo group, set up as Ray Train sets up a
# worker group's ranks (the torchrun variables, the process group started before the trainer:
# driver/torch_backend.py). Each builds raytrainer's Trainer from the recipe the driver's trainer
# (num_workers=2) made, as a Ray worker's rank builds it (worker/hosted.py's run_hosted: Recipe.unpack, then
# worker/hosted_sharding.py's build_trainer), and reads its training loader, epoch after epoch, as
# transformers' loop does. The two ranks are spawned once for every case (``ranks``); one process's side is
# raytrainer's Trainer with num_workers=0, in this process.
_DEALT = [(65, False, "random"), (65, True, "random"), (64, False, "random"), (9, False, "random"),
          (65, False, "sequential")]
_LENGTHS = [(i * 37) % 23 + 1 for i in range(64)]


class _Count(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(23))


class _PreparesItsLoader(one_loop.Trainer):
    """A subclass building its training loader as transformers' get_train_dataloader does: a DataLoader over
    the whole dataset (in random order where it has a length), then ``self.accelerator.prepare``."""

    def get_train_dataloader(self):
        from torch.utils.data import DataLoader, RandomSampler

        dataset = self.train_dataset
        sampler = RandomSampler(dataset) if hasattr(dataset, "__len__") else None
        return self.accelerator.prepare(DataLoader(dataset, batch_size=4, sampler=sampler))


def _trainer(output_dir: str, dataset, num_workers: int, cls=None, **overrides):
    """raytrainer's Trainer (transformers' loop) training a ``Linear`` on ``dataset``: with ``num_workers=2``
    the driver's side of a run on two ranks, which holds the recipe they build theirs from; with 0, the
    trainer itself, in this process."""
    from raytrainer import TrainingArguments

    args = TrainingArguments(output_dir=output_dir, num_workers=num_workers, save_strategy="no",
                             report_to="none", disable_tqdm=True, remove_unused_columns=False, **overrides)
    return (cls or one_loop.Trainer)(model=torch.nn.Linear(1, 1), train_dataset=dataset, args=args)


def _length_dataset():
    """The examples ``_LENGTHS`` long, as a ``datasets.Dataset``: transformers' loop reads group_by_length's
    lengths from such a dataset's ``length`` column (from a list of examples, only their ``input_ids``)."""
    import datasets

    return datasets.Dataset.from_list([{"idx": i, "length": length} for i, length in enumerate(_LENGTHS)])


def _epoch(loader, epoch: int) -> list[list[int]]:
    if hasattr(loader, "set_epoch"):  # as transformers' loop tells its loader the epoch
        loader.set_epoch(epoch)
    return [(batch["idx"] if isinstance(batch, Mapping) else batch).tolist() for batch in loader]


def _cases(output_dir: str) -> dict:
    """Each case the ranks read: the recipe of the driver's trainer (``num_workers=2``), and the epochs."""
    cases = {}
    for n, drop_last, strategy in _DEALT:
        trainer = _trainer(output_dir, [{"idx": i} for i in range(n)], 2, per_device_train_batch_size=4,
                           data_seed=11, dataloader_drop_last=drop_last, train_sampling_strategy=strategy)
        cases["dealt", n, drop_last, strategy] = trainer._recipe, (0, 1, 2)
    for dataset in (list(range(30)), _Count()):
        # transformers refuses a dataset without a length unless max_steps bounds the run
        trainer = _trainer(output_dir, dataset, 2, _PreparesItsLoader, data_seed=3, max_steps=6)
        cases["prepared", type(dataset).__name__] = trainer._recipe, (0, 1)
    trainer = _trainer(output_dir, [{"idx": i} for i in range(64)], 2, per_device_train_batch_size=8, seed=5)
    cases["global"] = trainer._recipe, (0, 1, 2)
    for seed in (0, 7):
        trainer = _trainer(output_dir, _length_dataset(), 2, per_device_train_batch_size=8, seed=seed,
                           train_sampling_strategy="group_by_length")
        cases["length", seed] = trainer._recipe, (0, 1, 2, 3)
    return cases


def _read_on_rank(cases: dict, rank: int, port: str, results) -> None:
    """Rank ``rank`` of two, as a Ray worker's: for each case, the trainer built from its recipe, and the
    batches of its training loader, epoch after epoch."""
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    from raytrainer.worker.hosted_sharding import build_trainer

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method="env://", rank=rank, world_size=2)
    read = {"rank": rank}
    for key, (recipe, epochs) in cases.items():
        trainer_cls, args, kwargs, targs, _given = recipe.unpack(2)
        trainer = build_trainer(trainer_cls, args, kwargs, targs, again=lambda r=recipe: r.unpack(2)[1:3])
        loader = trainer.get_train_dataloader()
        read[key] = seen = {"rank": (trainer.args.process_index, trainer.args.world_size),
                            "epochs": {epoch: _epoch(loader, epoch) for epoch in epochs},
                            "len": len(loader) if hasattr(trainer.train_dataset, "__len__") else None}
        if key[0] == "prepared":
            model = torch.nn.Linear(1, 1)
            prepared = trainer.accelerator.prepare(model)
            seen["model"] = (type(prepared), getattr(prepared, "module", None) is model)
        if key[0] == "length":
            sampler = loader.batch_sampler.batch_sampler.sampler  # accelerate's shard of a BatchSampler
            seen["grouped_by"] = type(sampler).__name__, sampler.batch_size
    results.put(read)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each of two real ranks reads in every case (``ranks[r][case]``), both spawned once."""
    cases = _cases(str(tmp_path_factory.mktemp("ranks")))
    read = run_two_ranks(functools.partial(_read_on_rank, cases), _free_port(), timeout=240)
    return sorted(read, key=lambda r: r["rank"])


def _one_process(output_dir, dataset, epochs, **overrides) -> dict:
    """The batches raytrainer's Trainer with num_workers=0 (transformers' loop, one process) reads, by
    epoch."""
    from accelerate.state import AcceleratorState

    try:
        loader = _trainer(str(output_dir), dataset, 0, **overrides).get_train_dataloader()
        return {epoch: _epoch(loader, epoch) for epoch in epochs}
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize(("n", "drop_last", "strategy"), _DEALT)
def test_each_rank_reads_the_batches_accelerate_deals_it_under_torchrun(ranks, n, drop_last, strategy):
    """transformers' Trainer hands accelerate a loader over the whole dataset (a RandomSampler, or a
    SequentialSampler) and accelerate deals its batches out to the processes, seeded ``data_seed`` + epoch:
    each of two real ranks of raytrainer's Trainer, built as on Ray workers, reads those batches, epoch after
    epoch, the short last round included."""
    from accelerate.data_loader import prepare_data_loader
    from accelerate.state import PartialState
    from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

    plain = list(range(n))
    order = RandomSampler(plain) if strategy == "random" else SequentialSampler(plain)
    try:
        for rank in (0, 1):
            ours = ranks[rank]["dealt", n, drop_last, strategy]
            assert ours["rank"] == (rank, 2)
            theirs = prepare_data_loader(DataLoader(plain, batch_size=4, sampler=order, drop_last=drop_last),
                                         num_processes=2, process_index=rank, use_seedable_sampler=True,
                                         data_seed=11)
            assert ours["len"] == len(theirs)
            for epoch in (0, 1, 2):
                theirs.set_epoch(epoch)
                assert ours["epochs"][epoch] == [b.tolist() for b in theirs]
            assert (ours["epochs"][0] != ours["epochs"][1]) == (strategy == "random")
    finally:
        PartialState._reset_state()


def test_a_loader_a_subclass_prepares_is_sharded_as_accelerate_shards_it(ranks):
    """A subclass building its loader as transformers' get_train_dataloader does (a DataLoader over the
    whole dataset, then ``self.accelerator.prepare``) reads on each real rank what accelerate gives that
    rank. A model it passes through ``self.accelerator.prepare`` on these CPU ranks comes back wrapped in
    DistributedDataParallel around the module itself (accelerate's MULTI_CPU: transformers' loop on CPU
    workers without ``fsdp``)."""
    from accelerate.data_loader import prepare_data_loader
    from accelerate.state import PartialState
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, RandomSampler

    plain = list(range(30))
    try:
        for rank in (0, 1):
            for dataset, sampler in ((plain, RandomSampler(plain)), (_Count(), None)):
                mine = ranks[rank]["prepared", type(dataset).__name__]
                assert mine["rank"] == (rank, 2)
                theirs = prepare_data_loader(DataLoader(dataset, batch_size=4, sampler=sampler),
                                             num_processes=2, process_index=rank, use_seedable_sampler=True,
                                             data_seed=3)
                for epoch in (0, 1):
                    theirs.set_epoch(epoch)
                    assert mine["epochs"][epoch] == [b.tolist() for b in theirs]
                assert sampler is None or mine["len"] == len(theirs) == 4
                assert mine["model"] == (DistributedDataParallel, True)
    finally:
        PartialState._reset_state()


def test_two_ranks_of_eight_train_the_global_batches_of_one_rank_of_sixteen(ranks, tmp_path):
    """Each step of two real ranks of 8 trains, between them, the batch one process of 16 trains at that
    step, epoch after epoch: accelerate deals the batches of one order, seeded ``seed`` + epoch."""
    one = _one_process(tmp_path, [{"idx": i} for i in range(64)], (0, 1, 2), per_device_train_batch_size=16,
                       seed=5)
    two = [ranks[r]["global"]["epochs"] for r in (0, 1)]
    for epoch in (0, 1, 2):
        steps = [sorted(a + b) for a, b in zip(two[0][epoch], two[1][epoch])]
        assert steps == [sorted(batch) for batch in one[epoch]]
        assert sorted(itertools.chain.from_iterable(one[epoch])) == list(range(64))
    assert one[0] != one[1]


@pytest.mark.parametrize("seed", [0, 7])
def test_length_grouped_batches_two_by_eight_equal_one_by_sixteen(ranks, tmp_path, seed):
    """``group_by_length``: two real ranks of 8 train the global batches of one process of 16, epoch after
    epoch, in transformers' length-grouped order (``get_length_grouped_indices``). Each rank groups by its
    own batch of 8, in mega-batches of ``min(n // (4 * 8), 50)`` batches: 2 x 8 here, the 1 x 16 of one
    process of 16 (equal only at this size: 96 examples give 3 x 8 against 1 x 16). Each epoch's order is
    drawn from torch's global random stream, which the constructor seeds ``seed`` (transformers'
    ``set_seed``) on every rank alike, after the base seed each new iterator of the loader draws from it."""
    one = _one_process(tmp_path, _length_dataset(), (0, 1, 2, 3), per_device_train_batch_size=16, seed=seed,
                       train_sampling_strategy="group_by_length")
    two = [ranks[r]["length", seed] for r in (0, 1)]
    assert [r["grouped_by"] for r in two] == [("LengthGroupedSampler", 8)] * 2
    stream = torch.Generator().manual_seed(seed)
    for epoch in (0, 1, 2, 3):
        mine, yours = two[0]["epochs"][epoch], two[1]["epochs"][epoch]
        assert [sorted(a + b) for a, b in zip(mine, yours)] == [sorted(batch) for batch in one[epoch]]
        torch.empty((), dtype=torch.int64).random_(generator=stream)  # the iterator's base seed
        expected = get_length_grouped_indices(_LENGTHS, 16, generator=stream)
        assert list(itertools.chain.from_iterable(one[epoch])) == expected
