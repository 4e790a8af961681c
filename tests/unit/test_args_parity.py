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
    with pytest.raises(ValueError, match=r"context='thread'.*fork, spawn or forkserver"):
        TrainingArguments(output_dir=str(tmp_path), dataloader_multiprocessing_context="thread")


def test_ddp_static_graph_reaches_distributed_data_parallel(tmp_path, make_classifier):
    """transformers' own rule: the accelerator's DDP settings (what ``prepare`` gives DDP on every rank)
    carry ``ddp_static_graph``, and ``find_unused_parameters`` is True for a module not transformers'."""
    from raytrainer import Trainer

    args = TrainingArguments(output_dir=str(tmp_path), ddp_static_graph=True, report_to="none")
    handler = Trainer(model=make_classifier(), args=args).accelerator.ddp_handler
    assert handler.to_kwargs() == {"static_graph": True, "find_unused_parameters": True}


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=2))


def _token_examples(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (n, 8), generator=g)
    return [{"input_ids": ids[i], "labels": int(ids[i, 0] > 25)} for i in range(n)]


def test_activation_checkpointing_and_use_cache_reach_a_transformers_model(make_args):
    model = _tiny_bert()
    model.config.use_cache = True
    args = make_args(activation_checkpointing=True, max_steps=2, per_device_train_batch_size=4)
    trainer = Trainer(model=model, train_dataset=_token_examples(8), args=args)
    assert model.config.use_cache is False  # transformers.Trainer sets args.use_cache (False) on the config
    assert trainer.train().global_step == 2
    assert model.is_activation_checkpointing


def test_sequential_sampling_keeps_dataset_order(make_args, make_classifier, make_examples):
    train, x, _ = make_examples(12)
    trainer = Trainer(model=make_classifier(), train_dataset=train,
                      args=make_args(train_sampling_strategy="sequential", per_device_train_batch_size=4))
    batches = [b["x"] for b in trainer.get_train_dataloader()]
    torch.testing.assert_close(torch.cat(batches), x)


def test_an_unknown_sampling_strategy_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"train_sampling_strategy='batch_rebalance'.*random, sequential"):
        TrainingArguments(output_dir=str(tmp_path), train_sampling_strategy="batch_rebalance")


# -- every field of transformers.TrainingArguments is accounted for ------------------------------------------
# Fields raytrainer refuses (a value that changes what transformers would do is an error naming the field and
# the way to get it with raytrainer); each with a value that must be refused and the words of the error.
REFUSED = {
    "parallelism_config": ({"sp_size": 2}, "num_workers=0. Fix: pass --num_workers 2"),
    "use_liger_kernel": (True, "apply them in model_init"),
    "liger_kernel_config": ({"rope": True}, "apply them in model_init"),
    "accelerator_config": ({"split_batches": True}, "sets split_batches=True"),
    "debug": ("tpu_metrics_debug", "TPU metrics"),
}


def _default(f):
    import dataclasses

    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def test_every_transformers_field_is_transformers_own():
    """The arguments are transformers' class, not a copy: each of its fields (as the installed transformers
    declares it) is there with its default and help, and the only other fields are the Ray mixin's."""
    import dataclasses

    import transformers

    from raytrainer import RayArgumentsMixin

    assert issubclass(TrainingArguments, transformers.TrainingArguments)
    ours = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    theirs = {f.name: f for f in dataclasses.fields(transformers.TrainingArguments)}
    for name, f in theirs.items():
        assert repr(_default(ours[name])) == repr(_default(f)), name
        assert ours[name].metadata.get("help") == f.metadata.get("help"), name
    ray = {f.name for f in dataclasses.fields(RayArgumentsMixin)}
    assert set(ours) - set(theirs) == ray
    assert {"num_workers", "use_gpu", "storage_path", "max_failures"} <= ray


def test_the_ray_fields_join_any_transformers_arguments_class(tmp_path):
    """A TRL config or a user's subclass gains the Ray fields by putting the mixin first among its bases."""
    import dataclasses

    import transformers

    from raytrainer import RayArgumentsMixin

    @dataclasses.dataclass
    class MyConfig(transformers.TrainingArguments):
        max_length: int = 128

    @dataclasses.dataclass
    class RayMyConfig(RayArgumentsMixin, MyConfig):
        pass

    args = RayMyConfig(output_dir=str(tmp_path), num_workers=2, max_length=64)
    assert (args.max_length, args.num_workers, args.world_size) == (64, 2, 2)
    assert args.storage_path == str(tmp_path)
    with pytest.raises(ValueError, match="num_workers=-1: must be an integer >= 0"):
        RayMyConfig(output_dir=str(tmp_path), num_workers=-1)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_fields_name_themselves_and_the_way_out(tmp_path, name):
    value, words = REFUSED[name]
    with pytest.raises(ValueError, match=name) as info:
        TrainingArguments(output_dir=str(tmp_path), **{name: value})
    assert words in str(info.value)


def test_accelerator_config_at_raytrainer_s_behaviour_is_accepted(tmp_path):
    config = tmp_path / "accelerator.json"
    config.write_text('{"split_batches": false, "even_batches": true, "non_blocking": true}')
    TrainingArguments(output_dir=str(tmp_path), accelerator_config=str(config))


def test_debug_underflow_overflow_stops_at_the_first_inf(make_args, make_examples):
    class Overflowing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 3)

            self.linear.weight.data.fill_(3e38)  # the first forward overflows inside the linear layer

        def forward(self, x, labels=None):
            logits = self.linear(x)
            return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}

    data, _, _ = make_examples(8)
    trainer = Trainer(model=Overflowing(), train_dataset=data, args=make_args(debug="underflow_overflow",
                                                                               max_steps=2))
    with pytest.raises(ValueError, match="inf/nan detected"):
        trainer.train()
    assert trainer.args.debug == ["underflow_overflow"]
    assert trainer.state.global_step == 0


def test_a_transformers_training_arguments_instance_is_taken_as_it_is(tmp_path, make_classifier,
                                                                     make_examples):
    import transformers

    hf_args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, learning_rate=0.01, lr_scheduler_type="cosine",
        eval_strategy="steps", eval_steps=2, save_strategy="no", report_to="none", seed=7,
        per_device_train_batch_size=4, hub_token="hf_token_abc", disable_tqdm=True)
    data, _, _ = make_examples(12)
    trainer = Trainer(model=make_classifier(), args=hf_args, train_dataset=data, eval_dataset=data)
    args = trainer.args
    assert isinstance(args, TrainingArguments) and args.num_workers == 0
    assert (args.max_steps, args.learning_rate, args.seed) == (3, 0.01, 7)
    assert args.per_device_train_batch_size == 4
    assert args.lr_scheduler_type.value == "cosine" and args.eval_strategy.value == "steps"
    assert args.hub_token == "hf_token_abc" and args.report_to == []
    trainer.train()
    assert trainer.state.global_step == 3
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [2, 3]  # and at the end


def test_the_migration_page_is_what_the_code_generates():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "scripts" / "migration_tables.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_transformers_own_parser_reads_the_ray_fields(tmp_path):
    """TRL's TrlParser and users' scripts use transformers' HfArgumentParser: it must take raytrainer's
    fields (argparse refuses metadata keys it does not know, so the mixin's fields carry only "help")."""
    import transformers

    (args,) = transformers.HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--num_workers", "2", "--resources_per_worker", '{"CPU": 1}',
         "--max_failures", "3"])
    assert (args.num_workers, args.resources_per_worker, args.max_failures) == (2, {"CPU": 1}, 3)
