"""raytrainer.hosted and raytrainer.trl without Ray: the twins, the arguments the ranks rebuild, refusals."""

from __future__ import annotations

import threading

import pytest
import transformers

import raytrainer
from raytrainer.hosted_recipe import Recipe, plain_config


def test_with_no_workers_the_twin_is_transformers_own_trainer(tmp_path):
    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    args = Args(output_dir=str(tmp_path), num_workers=0, report_to="none", use_cpu=True)
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16)
    model = transformers.GPT2LMHeadModel(config)
    trainer = raytrainer.on_ray(transformers.Trainer)(model=model, args=args)
    assert type(trainer) is transformers.Trainer
    assert type(trainer.args) is transformers.TrainingArguments  # the original class, no Ray fields
    assert trainer.args.output_dir == str(tmp_path)


def test_twins_of_trl_keep_trls_names_and_other_names_are_trls_own():
    trl = pytest.importorskip("trl")
    from raytrainer import trl as rtrl

    assert rtrl.SFTTrainer.__name__ == "SFTTrainer" and rtrl.SFTTrainer.hosted_class is trl.SFTTrainer
    assert issubclass(rtrl.DPOConfig, trl.DPOConfig)
    assert issubclass(rtrl.DPOConfig, raytrainer.RayArgumentsMixin)
    assert rtrl.TrlParser is trl.TrlParser and rtrl.get_peft_config is trl.get_peft_config
    import pickle

    assert pickle.loads(pickle.dumps(rtrl.SFTConfig)) is rtrl.SFTConfig  # by reference, for the workers
    with pytest.raises(AttributeError):
        rtrl.NoSuchTrainer  # noqa: B018


@pytest.mark.parametrize("name", ["SFTConfig", "DPOConfig", "RewardConfig", "GRPOConfig"])
def test_the_ranks_rebuild_the_original_config_from_the_values_given(name, tmp_path):
    trl = pytest.importorskip("trl")
    from raytrainer import trl as rtrl

    kwargs = dict(output_dir=str(tmp_path), learning_rate=3e-4, max_steps=7, report_to="none", use_cpu=True)
    if name == "GRPOConfig":
        kwargs.update(per_device_train_batch_size=2, num_generations=2)
    ours = getattr(rtrl, name)(num_workers=2, **kwargs)
    ours.model_init_kwargs = {"dtype": "float32"}  # set after construction, as TRL's scripts do
    rebuilt = plain_config(ours)
    expected = getattr(trl, name)(**kwargs)
    assert type(rebuilt) is getattr(trl, name)
    assert rebuilt.model_init_kwargs == {"dtype": "float32"}
    for field in ("learning_rate", "max_steps", "lr_scheduler_type", "bf16", "output_dir"):
        assert getattr(rebuilt, field) == getattr(expected, field), field
    if name == "GRPOConfig":  # derived once, in __post_init__, not given twice
        assert rebuilt.generation_batch_size == expected.generation_batch_size


def test_a_constructor_argument_that_cannot_be_pickled_is_named_on_the_driver(tmp_path):
    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    args = Args(output_dir=str(tmp_path), num_workers=2, report_to="none", use_cpu=True)
    lock = threading.Lock()
    with pytest.raises(ValueError, match=r"callbacks= cannot be pickled.*module level"):
        raytrainer.on_ray(transformers.Trainer)(model_init=lambda: None, args=args, callbacks=[lock])


def test_a_report_to_package_that_is_missing_is_refused_before_anything_starts(tmp_path):
    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    args = Args(output_dir=str(tmp_path), num_workers=2, report_to="clearml", use_cpu=True)
    with pytest.raises(ValueError, match="clearml"):
        raytrainer.on_ray(transformers.Trainer)(model_init=lambda: None, args=args)


def test_parallelism_config_on_cpu_workers_is_refused_before_anything_starts(tmp_path):
    """accelerate refuses a ParallelismConfig on a CPU (MULTI_CPU) group as each rank builds the trainer:
    the driver's constructor says so first, with what runs instead."""
    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    args = Args(output_dir=str(tmp_path), num_workers=2, report_to="none", use_cpu=True,
                parallelism_config={"dp_shard_size": 2})
    with pytest.raises(ValueError, match=r"parallelism_config=.*dp_shard_size.*CPU workers.*--fsdp"):
        raytrainer.on_ray(transformers.Trainer)(model_init=lambda: None, args=args)


def test_the_recipe_carries_the_constructor_and_each_spec_the_drivers_place(tmp_path, monkeypatch):
    from raytrainer.worker.place import as_on_the_driver, driver_place

    monkeypatch.chdir(tmp_path)
    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    args = Args(output_dir="relative", num_workers=2, report_to="none", use_cpu=True)
    recipe = Recipe.make(transformers.Trainer, (), {"args": args, "model_init": _model})
    cls, _, kw, plain, given = recipe.unpack()
    assert cls is transformers.Trainer and kw["model_init"] is _model and plain.use_cpu
    assert type(plain) is transformers.TrainingArguments and plain.output_dir == "relative"
    assert given.num_workers == 2 and given.storage_path == "relative"  # the Ray fields
    cwd, paths = driver_place()
    assert cwd == str(tmp_path) and all(isinstance(p, str) for p in paths)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "reward_here.py").write_text("VALUE = 7\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with as_on_the_driver(str(tmp_path), (str(tmp_path / "mine"),)):
        import os

        import reward_here

        assert os.getcwd() == str(tmp_path) and reward_here.VALUE == 7
    import os
    import sys

    assert os.getcwd() == str(elsewhere) and str(tmp_path / "mine") not in sys.path


def _model():
    return None


def test_a_hosted_trainer_pickles_without_this_process_s_group_pusher_and_payload_reference(tmp_path):
    """A Ray Tune trial actor gets a copy of the hosted trainer: what only this process can hold stays."""
    import cloudpickle

    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    args = Args(output_dir=str(tmp_path), num_workers=2, report_to="none", use_cpu=True)
    trainer = raytrainer.on_ray(transformers.Trainer)(model_init=_model, args=args)
    vars(trainer).update(_group=threading.Lock(), _hub=threading.Lock(), _model=object())
    trainer._recipe.ref = ["a reference this process owns"]
    copy = cloudpickle.loads(cloudpickle.dumps(trainer))
    assert "_group" not in vars(copy) and "_model" not in vars(copy) and copy._hub is None
    assert copy._recipe.ref is None and copy._recipe.payload == trainer._recipe.payload
    assert copy.args.num_workers == 2 and copy.model_init is not None
    assert trainer._recipe.ref == ["a reference this process owns"]  # the original keeps its own


def test_the_recipe_leaves_the_hub_token_on_the_driver(tmp_path):
    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    args = Args(output_dir=str(tmp_path), num_workers=2, report_to="none", use_cpu=True,
                hub_token="hf_planted_token_1234")
    recipe = Recipe.make(transformers.Trainer, (), {"args": args, "model_init": _model})
    assert b"hf_planted_token_1234" not in recipe.payload
    assert args.hub_token == "hf_planted_token_1234"  # the caller's arguments, untouched
    _, _, _, plain, given = recipe.unpack()
    assert plain.hub_token is None and given.hub_token is None and plain.push_to_hub is False


def test_an_elastic_hosted_trainer_s_ranks_build_transformers_arguments_for_their_world_size(tmp_path):
    """A hosted trainer (TRL's, transformers' own) is built on each rank from transformers' arguments: an
    elastic run's ranks build them with the per-device batch and accumulation that keep its global batch."""
    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    args = Args(output_dir=str(tmp_path), num_workers=(2, 3), per_device_train_batch_size=4, report_to="none",
                use_cpu=True, max_failures=1)
    recipe = Recipe.make(transformers.Trainer, (), {"args": args, "model_init": _model})
    for world, expected in ((3, (4, 1)), (2, (3, 2))):
        _, _, _, plain, given = recipe.unpack(world)
        assert (plain.per_device_train_batch_size, plain.gradient_accumulation_steps) == expected
        assert type(plain) is transformers.TrainingArguments and given.max_workers == 3
