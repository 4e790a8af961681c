"""raytrainer.hosted and raytrainer.trl without Ray: the twins, the arguments the ranks rebuild, refusals."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
import transformers

import raytrainer
from raytrainer.hosted_recipe import Recipe, plain_config


def _tiny_gpt2():
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, bos_token_id=0,
                                     eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


class _Rows:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        import torch

        ids = torch.tensor([(i + j) % 16 for j in range(6)])
        return {"input_ids": ids, "labels": ids}


def test_with_no_workers_the_twin_is_transformers_own_trainer_in_this_process(tmp_path):
    """num_workers=0: transformers' loop in this process, with the original arguments class; the model given
    is trained in place."""
    import torch

    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    args = Args(output_dir=str(tmp_path), num_workers=0, report_to="none", use_cpu=True, max_steps=2,
                per_device_train_batch_size=4, save_strategy="no", learning_rate=0.1)
    model = _tiny_gpt2()
    before = model.transformer.wte.weight.detach().clone()
    Twin = raytrainer.on_ray(transformers.Trainer)
    trainer = Twin(model=model, args=args, train_dataset=_Rows())
    assert isinstance(trainer, transformers.Trainer) and type(trainer) is Twin
    assert type(trainer.args) is transformers.TrainingArguments  # the original class, no Ray fields
    assert trainer.args.output_dir == str(tmp_path)
    assert type(trainer).train is transformers.Trainer.train  # transformers' own loop, nothing in front
    assert trainer.train().global_step == 2
    assert trainer.model is model and not torch.equal(model.transformer.wte.weight, before)


def test_with_workers_the_twin_is_a_transformers_trainer_whose_methods_run_on_the_ranks(tmp_path):
    """num_workers>=1: the driver's object is an instance of the twin (and of transformers.Trainer), built
    without running the trainer's constructor here; the trainer's methods are sent to the ranks."""
    from raytrainer.hosted import HostedTrainer, _RankMethod

    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    args = Args(output_dir=str(tmp_path), num_workers=2, report_to="none", use_cpu=True)
    Twin = raytrainer.on_ray(transformers.Trainer)
    trainer = Twin(model_init=_model, args=args)
    assert isinstance(trainer, Twin) and isinstance(trainer, transformers.Trainer)
    assert isinstance(trainer, HostedTrainer) and type(trainer).hosted_class is transformers.Trainer
    assert type(trainer).__name__ == "Trainer" and trainer.args is args  # the Ray fields stay on the driver
    for name in ("save_model", "compute_loss", "log", "get_train_dataloader"):
        assert isinstance(getattr(trainer, name), _RankMethod), name
    assert trainer.is_world_process_zero() is True and "model" not in vars(trainer)
    # what scripts ask the driver's accelerator: a model out of its wrappers, as accelerate's own
    module = torch.nn.Linear(2, 2)
    assert trainer.accelerator.unwrap_model(torch.nn.DataParallel(module)) is module
    assert trainer.accelerator.unwrap_model(module) is module


class _Mine(raytrainer.on_ray(transformers.Trainer)):
    """A user's subclass of a twin, as a script would write it."""

    def __init__(self, *args, scale: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = scale

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.seen = getattr(self, "seen", 0) + 1
        return loss * self.scale


def test_a_subclass_of_a_twin_is_built_on_the_ranks_as_it_is(tmp_path):
    """``class Mine(on_ray(transformers.Trainer))``: a rank builds ``Mine`` (its constructor, its overrides)
    from the recipe; with num_workers=0 it is ``Mine`` in this process, overrides and all."""
    from raytrainer.worker.hosted_sharding import build_trainer

    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    values = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=2,
                  per_device_train_batch_size=4, save_strategy="no")
    on_workers = _Mine(model_init=_tiny_gpt2, args=Args(num_workers=2, **values), train_dataset=_Rows(),
                       scale=2.0)
    assert type(on_workers).hosted_class is _Mine and isinstance(on_workers, _Mine)
    built_cls, args, kwargs, plain, _ = on_workers._recipe.unpack()
    assert built_cls is _Mine and kwargs["scale"] == 2.0 and type(plain) is transformers.TrainingArguments
    on_a_rank = build_trainer(built_cls, args, kwargs, plain)  # as worker/hosted.py builds it
    assert type(on_a_rank) is _Mine and on_a_rank.scale == 2.0
    on_a_rank.train()
    assert on_a_rank.seen == 2  # the subclass's compute_loss ran, once a step

    here = _Mine(model=_tiny_gpt2(), args=Args(num_workers=0, **values), train_dataset=_Rows(), scale=3.0)
    assert type(here) is _Mine and here.scale == 3.0 and type(here.args) is transformers.TrainingArguments
    here.train()
    assert here.seen == 2


class _PassThrough(raytrainer.Trainer):
    """The commonest subclass: a constructor that passes everything through."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)


def test_a_subclass_whose_constructor_passes_its_arguments_through_runs_where_its_arguments_say(tmp_path):
    """``Mine(model, args)`` by position, where ``Mine.__init__(self, *args, **kwargs)`` (or with keyword-only
    parameters of its own): ``args`` is found by the first constructor up the classes that names it, so
    ``num_workers=2`` makes the driver's side of a run on workers (it ran in this process before), and the
    ranks' arguments are the plain ones, put where they were given."""
    from raytrainer.hosted import HostedTrainer

    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    values = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    model = _tiny_gpt2()
    for cls, extra in ((_PassThrough, {}), (_Mine, {"scale": 2.0})):
        on_workers = cls(model, Args(num_workers=2, **values), None, _Rows(), **extra)
        assert isinstance(on_workers, HostedTrainer) and type(on_workers).hosted_class is cls, cls
        built_cls, args, kwargs, plain, given = on_workers._recipe.unpack()
        assert plain is args[1]
        assert built_cls is cls and args[0] is not None and type(args[1]) is transformers.TrainingArguments
        assert given.num_workers == 2 and kwargs == extra
    here = _PassThrough(model, raytrainer.TrainingArguments(num_workers=0, **values))
    assert not isinstance(here, HostedTrainer) and here.model is model


@dataclasses.dataclass
class _MyArgs(raytrainer.TrainingArguments):
    """A script's arguments class with a field of its own, as transformers users write them."""

    scale_by: float = 1.0


def test_a_scripts_own_arguments_fields_reach_the_ranks_plain_arguments(tmp_path):
    """The ranks build the trainer with the arguments' base class (transformers' own process view); the
    fields a script's subclass adds are on that object too, so its trainer subclass reads
    ``self.args.scale_by`` on the workers as in one process."""
    args = _MyArgs(output_dir=str(tmp_path), num_workers=2, report_to="none", use_cpu=True, scale_by=3.0)
    trainer = raytrainer.Trainer(model=_tiny_gpt2(), args=args, train_dataset=_Rows())
    *_, plain, given = trainer._recipe.unpack()
    assert type(plain) is transformers.TrainingArguments and plain.scale_by == 3.0
    assert given.scale_by == 3.0 and plain_config(args).scale_by == 3.0
    assert not hasattr(plain, "num_workers")  # raytrainer's fields stay on the driver's side


def test_twins_of_trl_keep_trls_names_and_other_names_are_trls_own():
    trl = pytest.importorskip("trl")
    from raytrainer import trl as rtrl

    assert rtrl.SFTTrainer.__name__ == "SFTTrainer" and issubclass(rtrl.SFTTrainer, trl.SFTTrainer)
    assert raytrainer.on_ray(rtrl.SFTTrainer) is rtrl.SFTTrainer
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
    with pytest.raises(ValueError, match=r"callbacks\[0\] \(lock\) cannot be pickled.*module level"):
        raytrainer.on_ray(transformers.Trainer)(model_init=lambda: None, args=args, callbacks=[lock])


def test_a_report_to_package_that_is_missing_is_refused_before_anything_starts(tmp_path):
    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    args = Args(output_dir=str(tmp_path), num_workers=2, report_to="clearml", use_cpu=True)
    with pytest.raises(ValueError, match="clearml"):
        raytrainer.on_ray(transformers.Trainer)(model_init=lambda: None, args=args)


def test_a_mesh_transformers_loop_cannot_run_on_cpu_workers_is_refused_before_anything_starts(tmp_path):
    """accelerate refuses any ParallelismConfig on a CPU group; raytrainer lays the mesh itself
    (worker/hosted_mesh.py), and refuses on the driver what cannot run: a mesh of another size than the
    group, checkpoints under tensor parallelism alone."""
    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    trainer_cls = raytrainer.on_ray(transformers.Trainer)
    for mesh, kw, words in (
            ({"dp_shard_size": 4}, {}, r"spans dp_shard_size=4 = 4 ranks, but num_workers=2"),
            ({"tp_size": 2}, {}, r"tensor parallelism alone.*safetensors.*--save_strategy no"),
    ):
        with pytest.raises(ValueError, match=words):  # the size: once the arguments are made
            trainer_cls(model_init=lambda: None, args=Args(
                output_dir=str(tmp_path), num_workers=2, report_to="none", use_cpu=True,
                parallelism_config=mesh, **kw))
    args = Args(output_dir=str(tmp_path), num_workers=2, report_to="none", use_cpu=True,
                parallelism_config={"tp_size": 2}, save_strategy="no")
    assert trainer_cls(model_init=lambda: None, args=args).args.parallelism_config.tp_size == 2


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


def test_the_drivers_tracker_settings_are_set_on_the_rank_for_the_command_only(tmp_path, monkeypatch):
    """A running cluster's workers do not inherit the script's environment: the trackers' settings in it
    (TENSORBOARD_LOGGING_DIR, MLFLOW_*, WANDB_* ...) travel in the spec, never the Hub's token."""
    import os

    from raytrainer.integrations import tracker_environment
    from raytrainer.worker.place import as_on_the_driver

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///x.db")
    monkeypatch.setenv("WANDB_PROJECT", "p")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    sent = tracker_environment()
    assert dict(sent) == {"TENSORBOARD_LOGGING_DIR": str(tmp_path / "tb"),
                          "MLFLOW_TRACKING_URI": "sqlite:///x.db", "WANDB_PROJECT": "p"}
    # on the rank: its own value of one is replaced for the command, and put back after
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR")
    monkeypatch.setenv("WANDB_PROJECT", "the worker's")
    with as_on_the_driver(None, (), sent):
        assert os.environ["TENSORBOARD_LOGGING_DIR"] == str(tmp_path / "tb")
        assert os.environ["WANDB_PROJECT"] == "p"
    assert "TENSORBOARD_LOGGING_DIR" not in os.environ and os.environ["WANDB_PROJECT"] == "the worker's"


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


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield {"input_ids": [1, 2], "labels": [1, 2]}


class _OwnLoader(transformers.Trainer):
    def get_train_dataloader(self):  # builds its own data, as GRPO's trainer does
        return [{"input_ids": [1, 2]}]


@pytest.mark.parametrize("call, given, message", [
    ("train", {}, r"train\(\) needs a train_dataset: pass `train_dataset=` to Trainer\."),
    ("train", {"train_dataset": []}, r"train_dataset is empty\."),
    ("train", {"train_dataset": _Stream()}, r"train_dataset \(_Stream\) has no length.*set max_steps"),
    ("evaluate", {"train_dataset": [1]}, r"evaluate\(\) needs an eval_dataset: pass it to Trainer or to"),
    ("evaluate", {"eval_dataset": {"a": [1], "b": []}}, r"eval_dataset\['b'\] is empty\."),
    ("predict", {}, r"predict\(\) needs a test_dataset\."),
])
def test_a_hosted_call_without_its_data_is_refused_before_anything_starts(tmp_path, call, given, message):
    """What raytrainer's Trainer refuses on the driver, a hosted trainer refuses there too: transformers'
    loop would refuse it on every rank, once the worker group had started."""
    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    args = Args(output_dir=str(tmp_path), num_workers=2, report_to="none", use_cpu=True)
    trainer = raytrainer.on_ray(transformers.Trainer)(model_init=_model, args=args, **given)
    with pytest.raises(ValueError, match=message):
        trainer.predict(None) if call == "predict" else getattr(trainer, call)()
    assert "_group" not in vars(trainer) and trainer._recipe.ref is None  # nothing sent, nothing started


def test_a_trainer_that_builds_its_own_train_loader_is_not_asked_for_a_train_dataset(tmp_path):
    Args = raytrainer.config_on_ray(transformers.TrainingArguments)
    args = Args(output_dir=str(tmp_path), num_workers=2, report_to="none", use_cpu=True)
    trainer = raytrainer.on_ray(_OwnLoader)(model_init=_model, args=args)
    trainer._check_call("train", {})  # its get_train_dataloader needs none
    with pytest.raises(ValueError, match="evaluate\\(\\) needs an eval_dataset: pass it to _OwnLoader"):
        trainer._check_call("evaluate", {"eval_dataset": None})


def test_a_deepspeed_config_without_precision_sections_casts_inputs_to_the_engines_dtype():
    """transformers casts floating inputs to ``hf_deepspeed_config.dtype()``, float32 for a config without a
    ``bf16`` section, while accelerate enables bf16 in the engine from ``--bf16``: the ranks' arguments get
    the missing sections as "auto", filled from the arguments."""
    import torch

    from raytrainer.hosted_recipe import plain_config

    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}
    args = raytrainer.TrainingArguments(output_dir="out", num_workers=2, bf16=True, use_cpu=True,
                                        report_to="none", deepspeed=config)
    plain = plain_config(args)
    assert plain.hf_deepspeed_config.dtype() == torch.bfloat16
    assert plain.hf_deepspeed_config.config["bf16"] == {"enabled": True}
    assert plain.hf_deepspeed_config.config["fp16"] == {"enabled": False}
    assert "bf16" not in config  # the script's own dict is left as it was
    fp32 = plain_config(raytrainer.TrainingArguments(output_dir="out", num_workers=2, use_cpu=True,
                                                     report_to="none", deepspeed=config))
    assert fp32.hf_deepspeed_config.dtype() == torch.float32
