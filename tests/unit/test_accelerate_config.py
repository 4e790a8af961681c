"""accelerate config files -> TrainingArguments, read with accelerate's own loader."""

from __future__ import annotations

import pytest

from raytrainer import TrainingArguments

BASE = """compute_environment: LOCAL_MACHINE
debug: false
distributed_type: {kind}
machine_rank: 0
main_training_function: main
mixed_precision: {precision}
num_machines: 1
num_processes: {processes}
use_cpu: {use_cpu}
"""


def write(tmp_path, extra: str = "", **kw) -> str:
    fields = {"kind": "MULTI_GPU", "precision": "'no'", "processes": 4, "use_cpu": "false", **kw}
    path = tmp_path / "config.yaml"
    path.write_text(BASE.format(**fields) + extra)
    return str(path)


def test_multi_gpu_bf16(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), accelerate_config=write(tmp_path, precision="bf16"))
    assert (args.num_workers, args.use_gpu, args.bf16, args.fp16, args.fsdp) == (4, True, True, False, [])


def test_fsdp_v1_size_based_offload_activation_checkpointing(tmp_path):
    extra = ("fsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n  fsdp_offload_params: true\n"
             "  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  fsdp_min_num_params: 1000\n"
             "  fsdp_activation_checkpointing: true\n")
    args = TrainingArguments(output_dir=str(tmp_path),
                             accelerate_config=write(tmp_path, extra, kind="FSDP", use_cpu="true"))
    assert args.fsdp == ["shard_grad_op", "offload", "auto_wrap"]
    assert args.fsdp_config == {"min_num_params": 1000, "activation_checkpointing": True}
    assert args.use_gpu is False and args.num_workers == 4


def test_fsdp_v2_reshard_after_forward(tmp_path):
    extra = "fsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: false\n"
    args = TrainingArguments(output_dir=str(tmp_path), accelerate_config=write(tmp_path, extra, kind="FSDP"))
    assert args.fsdp == ["shard_grad_op"]
    assert "cpu_ram_efficient_loading" not in args.fsdp_config  # each rank initialises its own shard


def test_the_ranks_arguments_carry_the_files_layout(tmp_path):
    """The ranks build transformers' own arguments from the values as given (hosted_recipe.plain_config):
    the file's values count as given, so each rank's accelerator gets the FSDP plugin it describes."""
    from raytrainer.hosted_recipe import plain_config

    extra = ("fsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
             "  fsdp_transformer_layer_cls_to_wrap: Linear\n")
    args = TrainingArguments(output_dir=str(tmp_path),
                             accelerate_config=write(tmp_path, extra, kind="FSDP", use_cpu="true"))
    ranks = plain_config(args, use_cpu=True)
    assert ranks.fsdp_plugin_args["fsdp_version"] == 2
    assert ranks.fsdp_config["transformer_layer_cls_to_wrap"] == ["Linear"]


def test_fsdp_cpu_ram_efficient_loading_builds_on_rank_0(tmp_path):
    extra = "fsdp_config:\n  fsdp_version: 2\n  fsdp_cpu_ram_efficient_loading: true\n"
    args = TrainingArguments(output_dir=str(tmp_path), accelerate_config=write(tmp_path, extra, kind="FSDP"))
    assert args.fsdp_config == {"cpu_ram_efficient_loading": True}


def test_deepspeed_plugin_keys_become_a_deepspeed_config(tmp_path):
    extra = ("deepspeed_config:\n  zero_stage: 3\n  offload_optimizer_device: cpu\n"
             "  offload_param_device: none\n  gradient_accumulation_steps: 2\n"
             "  zero3_save_16bit_model: true\n")
    args = TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=2,
                             accelerate_config=write(tmp_path, extra, kind="DEEPSPEED", processes=2))
    assert args.num_workers == 2
    assert args.deepspeed["zero_optimization"] == {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "stage3_gather_16bit_weights_on_model_save": True}
    assert args.deepspeed["gradient_accumulation_steps"] == 2
    assert args.deepspeed["train_micro_batch_size_per_gpu"] == "auto"
    # a plugin value that disagrees with the arguments is named, as with a DeepSpeed JSON file
    mismatch = "ds gradient_accumulation_steps=2 vs hf gradient_accumulation_steps=1"
    with pytest.raises(ValueError, match=mismatch):
        TrainingArguments(output_dir=str(tmp_path),
                          accelerate_config=write(tmp_path, extra, kind="DEEPSPEED", processes=2))


def test_deepspeed_config_file_is_relative_to_the_yaml(tmp_path):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}, "train_batch_size": "auto"}')
    extra = "deepspeed_config:\n  deepspeed_config_file: ds.json\n"
    args = TrainingArguments(output_dir=str(tmp_path),
                             accelerate_config=write(tmp_path, extra, kind="DEEPSPEED", processes=2))
    assert args.deepspeed == str(tmp_path / "ds.json")


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        TrainingArguments(output_dir=str(tmp_path), accelerate_config=str(tmp_path / "nope.yaml"))


def test_an_argument_that_contradicts_the_file_is_refused(tmp_path):
    """num_workers=2 and the file's num_processes=4: a conflict named with the fix, not a silent override;
    the same value given twice, or an argument left at its default, is fine."""
    config = write(tmp_path, processes=4)
    with pytest.raises(ValueError, match=r"num_workers=2: conflicts with accelerate_config=.*which sets "
                                         r"num_workers=4; drop --num_workers"):
        TrainingArguments(output_dir=str(tmp_path), accelerate_config=config, num_workers=2)
    same = TrainingArguments(output_dir=str(tmp_path), accelerate_config=config, num_workers=4)
    assert same.num_workers == 4
    assert TrainingArguments(output_dir=str(tmp_path), accelerate_config=config).num_workers == 4
