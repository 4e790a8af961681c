"""TrainingArguments: defaults, derived values, validation messages, process view, serialization."""

import dataclasses
import json
import logging
import pickle
import re

import cloudpickle
import pytest

import raytrainer.args as args_module
from raytrainer.args import (
    HubStrategy,
    IntervalStrategy,
    OptimizerNames,
    SaveStrategy,
    SchedulerType,
    TrainingArguments,
)


def test_defaults_follow_the_trainer_docs():
    args = TrainingArguments()
    assert args.output_dir == "trainer_output"
    assert args.storage_path == "trainer_output"
    assert args.per_device_train_batch_size == 8 and args.per_device_eval_batch_size == 8
    assert args.learning_rate == 5e-5 and args.num_train_epochs == 3.0 and args.max_steps == -1
    assert args.logging_steps == 500 and args.save_steps == 500 and args.eval_steps is None
    assert args.report_to == []
    assert args.lr_scheduler_kwargs == {}
    assert args.disable_tqdm is False
    assert args.num_workers == 0 and args.world_size == 1
    assert args.placement_strategy == "PACK" and args.max_failures == 0 and args.use_gpu is False


def test_strategy_strings_become_enums_that_still_compare_as_strings():
    args = TrainingArguments(
        eval_strategy="epoch", save_strategy="epoch", lr_scheduler_type="cosine", optim="sgd"
    )
    assert args.eval_strategy is IntervalStrategy.EPOCH
    assert args.save_strategy is SaveStrategy.EPOCH
    assert args.logging_strategy is IntervalStrategy.STEPS
    assert args.hub_strategy is HubStrategy.EVERY_SAVE
    assert args.lr_scheduler_type is SchedulerType.COSINE
    assert args.optim is OptimizerNames.SGD
    assert args.eval_strategy == "epoch" and args.eval_strategy.value == "epoch"
    assert args.optim.value == "sgd" and args.lr_scheduler_type.value == "cosine"  # transformers' enums


def test_fields_transformers_removed_are_refused_as_by_transformers():
    """transformers 5 removed evaluation_strategy, warmup_ratio, ...: the fields are transformers'."""
    for removed in ("evaluation_strategy", "warmup_ratio", "include_inputs_for_metrics",
                    "overwrite_output_dir"):
        with pytest.raises(TypeError, match=removed):
            TrainingArguments(**{removed: 1})


def test_eval_steps_defaults_to_logging_steps_only_for_the_steps_strategy():
    assert TrainingArguments(eval_strategy="steps", logging_steps=50).eval_steps == 50
    assert TrainingArguments(eval_strategy="steps", logging_steps=50, eval_steps=20).eval_steps == 20
    assert TrainingArguments(eval_strategy="epoch", logging_steps=50).eval_steps is None
    assert TrainingArguments(eval_strategy="no").do_eval is False


def test_step_intervals_become_ints_and_ratios_stay_floats():
    args = TrainingArguments(eval_strategy="steps", eval_steps=10.0, save_steps=30.0, logging_steps=0.25)
    assert args.eval_steps == 10 and isinstance(args.eval_steps, int)
    assert args.save_steps == 30 and isinstance(args.save_steps, int)
    assert args.logging_steps == 0.25


def test_best_model_defaults():
    args = TrainingArguments(
        load_best_model_at_end=True, eval_strategy="steps", save_steps=500, eval_steps=100
    )
    assert args.metric_for_best_model == "loss" and args.greater_is_better is False
    assert TrainingArguments(metric_for_best_model="accuracy").greater_is_better is True
    assert TrainingArguments(metric_for_best_model="eval_loss").greater_is_better is False
    assert TrainingArguments(metric_for_best_model="f1", greater_is_better=False).greater_is_better is False
    assert TrainingArguments(metric_for_best_model=None).greater_is_better is None


def test_load_best_model_at_end_needs_matching_strategies():
    with pytest.raises(ValueError, match=r"eval_strategy='no' and save_strategy='steps'") as info:
        TrainingArguments(load_best_model_at_end=True)
    assert "load_best_model_at_end=True" in str(info.value)
    # save_strategy="best" saves on the best evaluation: any eval strategy goes.
    args = TrainingArguments(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="best")
    assert args.metric_for_best_model == "loss"


def test_load_best_model_at_end_needs_save_steps_multiple_of_eval_steps():
    with pytest.raises(ValueError, match=r"save_steps=500 is not a multiple of eval_steps=300") as info:
        TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", eval_steps=300, save_steps=500)
    assert "--save_steps 600" in str(info.value)
    ok = TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", eval_steps=300, save_steps=600)
    assert ok.save_steps == 600
    ratios = TrainingArguments(
        load_best_model_at_end=True, eval_strategy="steps", eval_steps=0.1, save_steps=0.3
    )
    assert ratios.save_steps == 0.3
    with pytest.raises(ValueError, match=r"save_steps=500 is not a multiple of eval_steps=0.1"):
        TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", eval_steps=0.1, save_steps=500)


BAD_INPUTS = [
    (
        {"per_device_train_batch_size": 0},
        "per_device_train_batch_size=0: must be a positive integer; "
        "pass e.g. --per_device_train_batch_size 8",
    ),
    ({"per_device_eval_batch_size": -2}, "per_device_eval_batch_size=-2: must be a positive integer"),
    ({"per_device_train_batch_size": 2.5}, "per_device_train_batch_size=2.5: must be a positive integer"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0: must be a positive integer"),
    ({"learning_rate": -1e-3}, "learning_rate=-0.001: must be a number >= 0"),
    (
        {"lr_scheduler_type": "cosine_annealing"},
        "lr_scheduler_type='cosine_annealing': unknown value, must be one of 'linear', 'cosine'",
    ),
    ({"optim": "adamw_hf"}, "optim='adamw_hf': unknown value, must be one of 'adamw_torch'"),
    (
        {"eval_strategy": "sometimes"},
        "eval_strategy='sometimes': unknown value, must be one of 'no', 'steps', 'epoch'",
    ),
    (
        {"save_strategy": "always"},
        "save_strategy='always': unknown value, must be one of 'no', 'steps', 'epoch', 'best'",
    ),
    ({"logging_strategy": "often"}, "logging_strategy='often': unknown value"),
    ({"hub_strategy": "never"}, "hub_strategy='never': unknown value"),
    (
        {"log_level": "verbose"},
        "log_level='verbose': must be one of 'debug', 'info', 'warning', 'error', 'critical', 'passive'",
    ),
    ({"log_level_replica": "loud"}, "log_level_replica='loud': must be one of"),
    (
        {"placement_strategy": "scatter"},
        "placement_strategy='SCATTER': must be one of 'PACK', 'SPREAD', 'STRICT_PACK', 'STRICT_SPREAD'",
    ),
    (
        {"ddp_backend": "nvlink"},
        "ddp_backend='nvlink': must be one of None, 'gloo', 'nccl', 'mpi', 'ccl', 'hccl'",
    ),
    ({"num_workers": -1}, "num_workers=-1: must be an integer >= 0"),
    ({"max_steps": 0}, "max_steps=0: must be -1 (train for num_train_epochs) or a positive integer"),
    ({"max_steps": -5}, "max_steps=-5: must be -1"),
    ({"warmup_steps": -3}, "warmup_steps=-3: must be an integer >= 0"),
    (
        {"eval_strategy": "steps", "eval_steps": 0},
        "eval_steps=0: must be a positive number when eval_strategy is 'steps'",
    ),
    (
        {"eval_strategy": "steps", "eval_steps": 12.5},
        "eval_steps=12.5: must be an integer when it is 1 or more",
    ),
    ({"save_steps": -1}, "save_steps=-1: must be a positive number when save_strategy is 'steps'"),
    ({"logging_steps": 0}, "logging_steps=0: must be a positive number when logging_strategy is 'steps'"),
    ({"save_total_limit": 0}, "save_total_limit=0: must be a positive integer"),
    ({"fp16": True, "bf16": True}, "fp16=True: cannot be combined with bf16=True"),
    ({"save_strategy": "best"},
     "metric_for_best_model=None: `args.metric_for_best_model` must be provided when save_strategy='best'"),
    (
        {"lr_scheduler_type": "reduce_lr_on_plateau"},
        "lr_scheduler_type='reduce_lr_on_plateau': needs evaluations",
    ),
    ({"dataloader_prefetch_factor": 2}, "dataloader_prefetch_factor=2: needs data loading subprocesses"),
    ({"max_failures": -2}, "max_failures=-2: must be an integer >= 0, or -1 to retry forever"),
    ({"resources_per_worker": '{"CPU": -1}'}, "resources_per_worker={'CPU': -1}: entry 'CPU': -1"),
    ({"resources_per_worker": "{CPU: 2}"}, "resources_per_worker='{CPU: 2}': is not valid JSON"),
    (
        {"lr_scheduler_kwargs": "[1, 2]"},
        "lr_scheduler_kwargs='[1, 2]': must be a dict or a JSON object string",
    ),
    ({"use_gpu": True, "use_cpu": True}, "use_gpu=True: conflicts with use_cpu=True"),
    ({"include_for_metrics": ["labels"]}, "include_for_metrics='labels': must be one of 'inputs', 'loss'"),
    ({"torch_empty_cache_steps": 0}, "torch_empty_cache_steps=0: must be a positive integer"),
    ({"report_to": [1]}, "report_to=[1]: must be a string or a list of strings"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_INPUTS, ids=[next(iter(k)) for k, _ in BAD_INPUTS])
def test_bad_inputs_name_the_field_and_value(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        TrainingArguments(**kwargs)
    assert "pass" in str(info.value)  # every message says how to fix it


def test_replace_revalidates_and_resets_the_process_view():
    args = TrainingArguments()
    with pytest.raises(ValueError, match=re.escape("per_device_train_batch_size=0")):
        dataclasses.replace(args, per_device_train_batch_size=0)
    args._set_process(4, 3, 1, 1)
    scaled = dataclasses.replace(args, num_workers=2)
    assert (scaled.world_size, scaled.process_index, scaled.local_process_index) == (2, 0, 0)
    assert scaled.num_workers == 2


def test_json_strings_for_dict_fields_are_parsed():
    args = TrainingArguments(
        lr_scheduler_kwargs='{"num_cycles": 2}', resources_per_worker='{"CPU": 2, "GPU": 0.5}'
    )
    assert args.lr_scheduler_kwargs == {"num_cycles": 2}
    assert args.resources_per_worker == {"CPU": 2, "GPU": 0.5}


def test_report_to_normalization():
    assert TrainingArguments(report_to="none").report_to == []
    assert TrainingArguments(report_to=["none"]).report_to == []
    assert TrainingArguments(report_to=None).report_to == []
    assert TrainingArguments(report_to="tensorboard").report_to == ["tensorboard"]
    from transformers.integrations import get_available_reporting_integrations

    assert TrainingArguments(report_to="all").report_to == get_available_reporting_integrations()


def test_small_normalizations():
    assert TrainingArguments(placement_strategy="strict_spread").placement_strategy == "STRICT_SPREAD"
    assert TrainingArguments(use_cpu=True).dataloader_pin_memory is False
    assert TrainingArguments(storage_path="s3://bucket/run").storage_path == "s3://bucket/run"
    assert TrainingArguments(output_dir="out", storage_path=None).storage_path == "out"
    assert TrainingArguments(log_level="error").disable_tqdm is True
    assert TrainingArguments(log_level="warning").disable_tqdm is False


def test_warmup_steps():
    assert TrainingArguments(warmup_steps=10).get_warmup_steps(1000) == 10
    assert TrainingArguments(warmup_steps=5.0).warmup_steps == 5
    assert TrainingArguments(warmup_steps=0.1).get_warmup_steps(95) == 10  # ceil(9.5)
    assert TrainingArguments().get_warmup_steps(100) == 0


def test_batch_sizes_and_timeout():
    args = TrainingArguments(per_device_train_batch_size=4, per_device_eval_batch_size=16, ddp_timeout=60)
    assert args.train_batch_size == 4 and args.eval_batch_size == 16
    assert args.ddp_timeout_delta.total_seconds() == 60


# --- The process view ---


def test_process_log_levels_with_log_on_each_node_false():
    args = TrainingArguments(
        log_level="warning", log_level_replica="error", log_on_each_node=False, num_workers=2
    )
    assert args.world_size == 2 and args.process_index == 0
    assert args.should_log and args.get_process_log_level() == logging.WARNING
    args._set_process(2, 1, 1, 0)
    assert (args.world_size, args.process_index, args.local_process_index) == (2, 1, 1)
    assert not args.should_log
    assert args.get_process_log_level() == logging.ERROR


def test_local_main_on_another_node_logs_at_the_main_level_with_log_on_each_node():
    args = TrainingArguments(log_level="debug", log_level_replica="critical", log_on_each_node=True)
    args._set_process(4, 2, 0, 1)
    assert args.should_log and args.get_process_log_level() == logging.DEBUG
    args.log_on_each_node = False
    assert not args.should_log and args.get_process_log_level() == logging.CRITICAL


def test_passive_levels():
    args = TrainingArguments(log_level="passive", log_level_replica="passive")
    assert args.get_process_log_level() == logging.INFO
    args._set_process(2, 1, 1, 0)
    assert args.get_process_log_level() == logging.WARNING


def test_should_save_follows_save_on_each_node():
    args = TrainingArguments(save_on_each_node=False)
    args._set_process(4, 2, 0, 1)
    assert not args.should_save
    args.save_on_each_node = True
    assert args.should_save
    args._set_process(4, 0, 0, 0)
    assert args.should_save


def test_set_process_rejects_inconsistent_ranks():
    with pytest.raises(ValueError, match=r"rank=2.*inconsistent"):
        TrainingArguments()._set_process(2, 2, 0, 0)


def test_main_process_first_is_a_no_op_without_a_process_group():
    args = TrainingArguments(num_workers=2)
    ran = []
    with args.main_process_first(desc="tokenize"):
        ran.append(True)
    assert ran == [True]


class _RecordingDist:
    def __init__(self, events):
        self.events = events

    def barrier(self):
        self.events.append("barrier")


@pytest.mark.parametrize(
    ("rank", "local_rank", "local", "expected"),
    [
        (0, 0, True, ["work", "barrier"]),  # main: works, then releases the replicas
        (1, 1, True, ["barrier", "work"]),  # replica: waits, then works
        (2, 0, True, ["work", "barrier"]),  # main of node 1 goes first when local
        (2, 0, False, ["barrier", "work"]),  # ... but waits when only global rank 0 goes first
    ],
)
def test_main_process_first_ordering(monkeypatch, rank, local_rank, local, expected):
    events = []
    monkeypatch.setattr(args_module, "_initialized_distributed", lambda: _RecordingDist(events))
    args = TrainingArguments(num_workers=4)
    args._set_process(4, rank, local_rank, rank // 2)
    with args.main_process_first(local=local):
        events.append("work")
    assert events == expected


# --- Serialization ---


def test_to_dict_hides_the_hub_token_and_uses_plain_values():
    args = TrainingArguments(hub_token="hf_secret", eval_strategy="epoch")
    d = args.to_dict()
    assert d["hub_token"] == "<HUB_TOKEN>"
    assert d["eval_strategy"] == "epoch" and type(d["eval_strategy"]) is str
    assert "_world_size" not in d and "_process_index" not in d
    assert "hf_secret" not in args.to_json_string()
    assert "hf_secret" not in repr(args) and "hf_secret" not in str(args)
    assert json.loads(args.to_json_string()) == d
    assert TrainingArguments().to_dict()["hub_token"] == "<HUB_TOKEN>"  # transformers masks it always


def test_to_dict_round_trips_and_is_a_copy():
    args = TrainingArguments(
        output_dir="out", eval_strategy="steps", eval_steps=10, lr_scheduler_kwargs={"a": 1}
    )
    d = args.to_dict()
    d["lr_scheduler_kwargs"]["a"] = 2
    assert args.lr_scheduler_kwargs == {"a": 1}
    assert TrainingArguments(**{**args.to_dict(), "hub_token": None}) == args


def test_to_sanitized_dict_keeps_only_simple_types():
    d = TrainingArguments(resources_per_worker={"CPU": 2}, per_device_train_batch_size=4).to_sanitized_dict()
    assert d["resources_per_worker"] == "{'CPU': 2}"
    assert d["report_to"] == "[]"
    assert d["eval_steps"] == "None"
    assert d["train_batch_size"] == 4 and d["learning_rate"] == 5e-5
    assert all(type(v) in (bool, int, float, str) for v in d.values())


def test_pickle_and_cloudpickle_round_trips_keep_fields_and_process_view():
    args = TrainingArguments(output_dir="out", num_workers=2, hub_token="tok", lr_scheduler_kwargs={"a": 1})
    args._set_process(2, 1, 1, 0)
    for dumps, loads in ((cloudpickle.dumps, cloudpickle.loads), (pickle.dumps, pickle.loads)):
        copy = loads(dumps(args))
        assert copy == args
        assert copy.hub_token == "tok"
        assert copy.eval_strategy is IntervalStrategy.NO
        assert (copy.world_size, copy.process_index, copy.local_process_index) == (2, 1, 1)


def test_process_view_names_hf_scripts_log(tmp_path):
    """transformers' example scripts log device, n_gpu, parallel_mode and local_rank before anything else."""
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    view = (args.device.type, args.n_gpu, args.parallel_mode.value, args.local_rank)
    assert view == ("cpu", 0, "not_parallel", -1)
    args._set_process(world_size=4, rank=3, local_rank=1, node_rank=1)
    assert (args.parallel_mode.value, args.local_rank) == ("distributed", 1)


def test_fsdp_config_may_name_a_json_file_as_in_transformers(tmp_path):
    import json

    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"transformer_layer_cls_to_wrap": ["GPT2Block"], "min_num_params": 0}))
    args = TrainingArguments(output_dir=str(tmp_path), fsdp="full_shard auto_wrap", fsdp_config=str(path),
                             num_workers=2)
    assert args.fsdp_config["transformer_layer_cls_to_wrap"] == ["GPT2Block"]
    sharded = {"output_dir": str(tmp_path), "fsdp": "full_shard", "num_workers": 2}
    with pytest.raises(ValueError, match=r"fsdp_config='.*missing\.json': no such file; pass the path of a"):
        TrainingArguments(fsdp_config=str(tmp_path / "missing.json"), **sharded)
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="names a JSON file that does not hold an object"):
        TrainingArguments(fsdp_config=str(tmp_path / "list.json"), **sharded)


def test_fsdp_config_reads_transformers_keys_and_refuses_what_fsdp2_cannot_do(tmp_path):
    """A transformers fsdp_config (accelerate's fsdp_ prefix, FSDP1-era keys, cpu_ram_efficient_loading) is
    read as transformers reads it; what raytrainer's FSDP2 cannot honour is refused, naming the key."""
    hf = {"fsdp_transformer_layer_cls_to_wrap": "GPT2Block", "fsdp_version": 2, "fsdp_cpu_offload": True,
          "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "cpu_ram_efficient_loading": "true",
          "sync_module_states": True, "use_orig_params": True, "backward_prefetch": "BACKWARD_PRE",
          "forward_prefetch": False, "limit_all_gathers": True, "xla": False}
    args = TrainingArguments(output_dir=str(tmp_path), fsdp="full_shard", fsdp_config=hf, num_workers=2)
    assert args.fsdp == ["full_shard", "offload", "auto_wrap"]  # cpu_offload, auto_wrap_policy
    assert args.fsdp_config["transformer_layer_cls_to_wrap"] == ["GPT2Block"]
    assert args.fsdp_config["cpu_ram_efficient_loading"] == "true" and "fsdp_version" not in args.fsdp_config
    sharded = {"output_dir": str(tmp_path), "fsdp": "full_shard", "num_workers": 2}
    refused = [({"version": 1}, r"version 1: raytrainer runs FSDP2 \(fully_shard\) only; drop 'version'"),
               ({"fsdp_xla": True}, r"xla is set, and raytrainer does not run on XLA; drop 'xla'"),
               ({"reshard_after_forward": False},
                r"reshard_after_forward False contradicts fsdp='full_shard'"),
               ({"cpu_ram_efficient_loading": True, "sync_module_states": "false"},
                r"cpu_ram_efficient_loading needs sync_module_states"),
               ({"wrap_everything": True}, r"unknown key 'wrap_everything'; use keys from activation_chec")]
    for config, message in refused:
        with pytest.raises(ValueError, match=message):
            TrainingArguments(fsdp_config=config, **sharded)
    zero2 = TrainingArguments(output_dir=str(tmp_path), fsdp="shard_grad_op", num_workers=2,
                              fsdp_config={"reshard_after_forward": "false"})
    assert zero2.fsdp_config == {"reshard_after_forward": "false"}
