"""Unit tests for raytrainer.data: collation, eval block sharding, iterable shards, sampler equivalence."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from transformers.trainer_pt_utils import find_batch_size, get_length_grouped_indices
from transformers.trainer_utils import RemoveColumnsCollator as TransformersRemoveColumnsCollator

from raytrainer.data import (
    EvalBlockSampler,
    IterableShard,
    RemoveColumnsCollator,
    batch_size_of,
    default_data_collator,
    default_label_names,
    eval_positions,
    length_grouped_sampler,
    set_epoch,
    signature_columns,
    unshard,
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


def test_batch_size_of_is_transformers_find_batch_size():
    batch = {"scalar": torch.tensor(1.0), "input_ids": torch.zeros(3, 5), "labels": torch.zeros(3)}
    assert batch_size_of(batch) == find_batch_size(batch) == 3
    assert batch_size_of({"x": torch.tensor(2.0)}) == 1 and find_batch_size({"x": torch.tensor(2.0)}) is None
    assert batch_size_of({"x": torch.tensor(2.0)}, default=0) == 0


# -- evaluation block sharding -------------------------------------------------------------------------------
def _batches(items: list, batch_size: int) -> list[list]:
    """How a DataLoader with ``batch_size`` chunks a rank's sampled items."""
    return [items[i : i + batch_size] for i in range(0, len(items), batch_size)]


@pytest.mark.parametrize("n", [1, 7, 16, 33])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("batch_size", [1, 4, 5])
def test_eval_block_sampler_and_unshard_round_trip(n, world_size, batch_size):
    per_rank = []
    for rank in range(world_size):
        sampler = EvalBlockSampler(n, batch_size, world_size, rank)
        assert sampler.num_examples == n
        assert len(sampler) == len(list(sampler))
        # What a rank's evaluation produces: one output per sampled example (here its dataset index).
        per_rank.append(np.array(list(sampler), dtype=np.int64))
    # Every rank runs the same number of batches (one per round), so the ranks stay in lock step.
    rounds = max(1, -(-n // (batch_size * world_size)))
    assert [len(_batches(list(a), batch_size)) for a in per_rank] == [rounds] * world_size
    assert all(0 <= i < n for a in per_rank for i in a)
    # Each real example is evaluated once; the only extra rows are one dummy per rank left without a block.
    dummies = sum(p is None for r in range(world_size) for p in eval_positions(n, batch_size, world_size, r))
    assert sum(len(a) for a in per_rank) == n + dummies
    assert dummies <= world_size - 1
    np.testing.assert_array_equal(unshard(per_rank, batch_size, n), np.arange(n))


@pytest.mark.parametrize("n", [1, 7, 16, 33])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("batch_size", [1, 4, 5])
def test_eval_positions_never_mix_dummies_with_real_examples(n, world_size, batch_size):
    seen = []
    for rank in range(world_size):
        positions = eval_positions(n, batch_size, world_size, rank)
        for batch in _batches(positions, batch_size):
            assert batch == [None] or None not in batch, batch
            # a real batch is consecutive examples: it is padded exactly as one process would pad it
            if batch != [None]:
                assert batch == list(range(batch[0], batch[0] + len(batch)))
                seen.extend(batch)
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("world_size", [2, 3])
def test_unshard_keeps_trailing_dimensions(world_size):
    n, batch_size = 11, 4
    per_rank = []
    for rank in range(world_size):
        idx = np.array(list(EvalBlockSampler(n, batch_size, world_size, rank)))
        per_rank.append(np.stack([idx, -idx], axis=1))  # (examples, 2)
    out = unshard(per_rank, batch_size, n)
    np.testing.assert_array_equal(out, np.stack([np.arange(n), -np.arange(n)], axis=1))


def test_eval_block_sampler_gives_contiguous_blocks_round_robin():
    # 10 examples, batch 2, 2 ranks: rank 0 gets blocks 0, 2, 4; rank 1 gets 1, 3 and a one-example dummy.
    assert list(EvalBlockSampler(10, 2, 2, 0)) == [0, 1, 4, 5, 8, 9]
    assert list(EvalBlockSampler(10, 2, 2, 1)) == [2, 3, 6, 7, 0]
    # 9 examples: rank 0's last block is partial (not padded with other examples)
    assert list(EvalBlockSampler(9, 2, 2, 0)) == [0, 1, 4, 5, 8]
    assert eval_positions(9, 2, 2, 1) == [2, 3, 6, 7, None]
    # one process: the dataset in order, the last batch short, nothing added
    assert list(EvalBlockSampler(10, 4, 1, 0)) == list(range(10))


# -- iterable datasets ---------------------------------------------------------------------------------------
class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


@pytest.mark.parametrize("n", [1, 5, 12, 13])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_iterable_shard_same_batch_count_and_full_coverage(n, world_size, batch_size):
    shards = [IterableShard(_Stream(n), batch_size, world_size, rank) for rank in range(world_size)]
    items = [list(shard) for shard in shards]
    batches = [[a[i : i + batch_size] for i in range(0, len(a), batch_size)] for a in items]
    assert len({len(b) for b in batches}) == 1, [len(b) for b in batches]
    assert all(len(batch) == batch_size for b in batches for batch in b)  # the tail is completed
    assert set(itertools.chain.from_iterable(items)) == set(range(n))
    assert len(batches[0]) == -(-n // (batch_size * world_size))
    assert all(shard.num_real == n for shard in shards)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_iterable_shard_drop_last_drops_only_the_incomplete_round(world_size):
    n, batch_size = 13, 2
    round_size = batch_size * world_size
    items = [
        list(IterableShard(_Stream(n), batch_size, world_size, r, drop_last=True)) for r in range(world_size)
    ]
    assert len({len(a) for a in items}) == 1
    full = (n // round_size) * round_size
    assert sorted(itertools.chain.from_iterable(items)) == list(range(full))


@pytest.mark.parametrize("n", [1, 5, 12, 13])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_iterable_shard_for_evaluation_follows_eval_positions(n, world_size, batch_size):
    shards = [
        IterableShard(_Stream(n), batch_size, world_size, rank, pad_rounds=False)
        for rank in range(world_size)
    ]
    items = [list(shard) for shard in shards]
    expected = [
        [p if p is not None else 0 for p in eval_positions(n, batch_size, world_size, r)]
        for r in range(world_size)
    ]
    assert items == expected
    assert len({len(_batches(a, batch_size)) for a in items}) == 1  # lock step
    assert all(shard.num_real == n for shard in shards)
    per_rank = [np.array(a) for a in items]
    np.testing.assert_array_equal(unshard(per_rank, batch_size, n), np.arange(n))


def test_iterable_shard_blocks_are_contiguous_per_rank():
    assert list(IterableShard(_Stream(8), 2, 2, 0)) == [0, 1, 4, 5]
    assert list(IterableShard(_Stream(8), 2, 2, 1)) == [2, 3, 6, 7]


# -- training batches: each rank reads what it reads under transformers' Trainer and torchrun ---------------
def _on_rank(make_args, dataset, world_size: int, rank: int, **overrides):
    """A ``Trainer`` as it stands on rank ``rank`` of a ``world_size``-rank run."""
    from raytrainer import Trainer
    from raytrainer.rank_context import RankContext

    class OnRank(Trainer):
        _view = RankContext(world_size=world_size, rank=rank)

    return OnRank(model=torch.nn.Linear(1, 1), train_dataset=dataset,
                  args=make_args(remove_unused_columns=False, **overrides))


def _rank_loader(make_args, dataset, world_size: int, rank: int, **overrides):
    """The training loader ``Trainer`` builds on that rank."""
    return _on_rank(make_args, dataset, world_size, rank, **overrides).get_train_dataloader()


def _epoch(loader, epoch: int) -> list[list[int]]:
    set_epoch(loader, epoch)
    return [batch["idx"].tolist() for batch in loader]


@pytest.mark.parametrize(("n", "drop_last", "strategy"), [(65, False, "random"), (65, True, "random"),
                                                         (64, False, "random"), (9, False, "random"),
                                                         (65, False, "sequential")])
def test_each_rank_reads_the_batches_accelerate_deals_it_under_torchrun(make_args, n, drop_last, strategy):
    """transformers' Trainer hands accelerate a loader over the whole dataset (a RandomSampler, or a
    SequentialSampler) and accelerate deals its batches out to the processes, seeded ``data_seed`` + epoch:
    every rank's batches here, epoch after epoch, are those, the short last round included."""
    from accelerate.data_loader import prepare_data_loader
    from accelerate.state import PartialState
    from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

    dataset = [{"idx": i} for i in range(n)]
    plain = list(range(n))
    order = RandomSampler(plain) if strategy == "random" else SequentialSampler(plain)
    try:
        for rank in (0, 1):
            ours = _rank_loader(make_args, dataset, 2, rank, per_device_train_batch_size=4, data_seed=11,
                                dataloader_drop_last=drop_last, train_sampling_strategy=strategy)
            theirs = prepare_data_loader(DataLoader(plain, batch_size=4, sampler=order, drop_last=drop_last),
                                         num_processes=2, process_index=rank, use_seedable_sampler=True,
                                         data_seed=11)
            assert len(ours) == len(theirs)
            for epoch in (0, 1, 2):
                theirs.set_epoch(epoch)
                expected = [b.tolist() for b in theirs]
                assert _epoch(ours, epoch) == expected
            assert (_epoch(ours, 0) != _epoch(ours, 1)) == (strategy == "random")
    finally:
        PartialState._reset_state()


class _Count(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(23))


def test_a_loader_a_subclass_prepares_is_sharded_as_accelerate_shards_it(make_args):
    """A subclass building its loader as transformers' get_train_dataloader does (a DataLoader over the
    whole dataset, then ``self.accelerator.prepare``) reads on each rank what accelerate gives that rank."""
    from accelerate.data_loader import prepare_data_loader
    from accelerate.state import PartialState
    from torch.utils.data import DataLoader, RandomSampler

    plain = list(range(30))
    try:
        for rank in (0, 1):
            trainer = _on_rank(make_args, plain, 2, rank, data_seed=3)
            for dataset, sampler in ((plain, RandomSampler(plain)), (_Count(), None)):
                mine = trainer.accelerator.prepare(DataLoader(dataset, batch_size=4, sampler=sampler))
                theirs = prepare_data_loader(DataLoader(dataset, batch_size=4, sampler=sampler),
                                             num_processes=2, process_index=rank, use_seedable_sampler=True,
                                             data_seed=3)
                for epoch in (0, 1):
                    set_epoch(mine, epoch)
                    theirs.set_epoch(epoch)
                    assert [b.tolist() for b in mine] == [b.tolist() for b in theirs]
                assert sampler is None or len(mine) == len(theirs) == 4
            model = torch.nn.Linear(1, 1)
            assert trainer.accelerator.prepare(model) is model  # placed by the strategy, not here
    finally:
        PartialState._reset_state()


def test_two_ranks_of_eight_train_the_global_batches_of_one_rank_of_sixteen(make_args):
    dataset = [{"idx": i} for i in range(64)]
    one = _epoch(_rank_loader(make_args, dataset, 1, 0, per_device_train_batch_size=16, seed=5), 1)
    two = [_epoch(_rank_loader(make_args, dataset, 2, r, per_device_train_batch_size=8, seed=5), 1)
           for r in (0, 1)]
    assert [sorted(a + b) for a, b in zip(*two)] == [sorted(batch) for batch in one]
    assert sorted(itertools.chain.from_iterable(one)) == list(range(64))


@pytest.mark.parametrize("seed", [0, 7])
def test_length_grouped_batches_two_by_eight_equal_one_by_sixteen(make_args, seed):
    n = 64
    lengths = [(i * 37) % 23 + 1 for i in range(n)]
    dataset = [{"idx": i, "length": length} for i, length in enumerate(lengths)]
    settings = {"train_sampling_strategy": "group_by_length", "seed": seed}
    one = _epoch(_rank_loader(make_args, dataset, 1, 0, per_device_train_batch_size=16, **settings), 3)
    two = [_epoch(_rank_loader(make_args, dataset, 2, r, per_device_train_batch_size=8, **settings), 3)
           for r in (0, 1)]
    assert [sorted(a + b) for a, b in zip(*two)] == [sorted(batch) for batch in one]
    # one rank's order is transformers' get_length_grouped_indices over the global batch, seeded seed + epoch
    generator = torch.Generator()
    generator.manual_seed(seed + 3)
    expected = get_length_grouped_indices(lengths, 16, generator=generator)
    assert list(itertools.chain.from_iterable(one)) == expected
    # the lengths may also come from the examples themselves
    derived = length_grouped_sampler([{"input_ids": [0] * length} for length in lengths], 16, seed=seed)
    assert derived.lengths == lengths
