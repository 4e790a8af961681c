"""transformers.TrainingArguments fields a script may pass, each doing what it does under transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raytrainer import Trainer, TrainingArguments


def test_eval_on_start_evaluates_before_the_first_step(make_args, make_classifier, make_examples):
    train, _, _ = make_examples(24)
    held_out, _, _ = make_examples(10, seed=3)
    trainer = Trainer(model=make_classifier(), train_dataset=train, eval_dataset=held_out,
                      args=make_args(eval_on_start=True, max_steps=3, logging_steps=1))
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["step"] == 0 and "eval_loss" in first
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3]


def test_eval_on_start_without_an_eval_dataset_is_refused(make_args, make_classifier, make_examples):
    train, _, _ = make_examples(8)
    with pytest.raises(ValueError, match="eval_on_start=True needs an eval_dataset"):
        Trainer(model=make_classifier(), train_dataset=train, args=make_args(eval_on_start=True))


def test_eval_do_concat_batches_false_returns_one_entry_per_batch(make_args, make_classifier, make_examples):
    data, _, y = make_examples(10)
    joined = Trainer(model=make_classifier(), args=make_args(per_device_eval_batch_size=4)).predict(data)
    split = Trainer(model=make_classifier(),
                    args=make_args(per_device_eval_batch_size=4, eval_do_concat_batches=False)).predict(data)
    assert [len(p) for p in split.predictions] == [4, 4, 2]
    assert [len(lab) for lab in split.label_ids] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate(split.predictions), joined.predictions)
    np.testing.assert_array_equal(np.concatenate(split.label_ids), y.numpy())
    assert split.metrics["test_loss"] == pytest.approx(joined.metrics["test_loss"])


def test_full_determinism_turns_on_deterministic_algorithms(make_args, make_classifier, make_examples):
    train, _, _ = make_examples(8)
    try:
        Trainer(model=make_classifier(), train_dataset=train,
                args=make_args(full_determinism=True, max_steps=1)).train()
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_dataloader_order_and_start_method_reach_the_loader(make_args, make_classifier, make_examples):
    train, _, _ = make_examples(8)
    trainer = Trainer(model=make_classifier(), train_dataset=train, args=make_args(
        dataloader_num_workers=1, dataloader_in_order=False, dataloader_multiprocessing_context="spawn"))
    loader = trainer.get_train_dataloader()
    assert loader.in_order is False
    assert loader.multiprocessing_context.get_start_method() == "spawn"


def test_a_start_method_that_does_not_exist_is_named(tmp_path):
    with pytest.raises(ValueError, match="dataloader_multiprocessing_context='thread'.*fork, spawn or forkserver"):
        TrainingArguments(output_dir=str(tmp_path), dataloader_multiprocessing_context="thread")


def test_ddp_static_graph_reaches_distributed_data_parallel(tmp_path, make_classifier):
    import torch.distributed as dist

    from raytrainer.strategies.ddp import DDPStrategy
    from raytrainer.worker.context import RankContext

    args = TrainingArguments(output_dir=str(tmp_path), num_workers=2, ddp_static_graph=True)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
    try:
        wrapped = DDPStrategy(RankContext(), args).setup_model(make_classifier())
        assert wrapped.static_graph is True
    finally:
        dist.destroy_process_group()
