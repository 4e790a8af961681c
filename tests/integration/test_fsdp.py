"""FSDP2 on 2 Ray workers (gloo, CPU mesh): really sharded, converges like DDP, exact resume, 2 -> 1."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from models import (
    DropoutRegressor,
    ReportSharding,
    SlowThenFullDisk,
    make_data,
    rng_files,
    train_into_the_full_disk,
)

from raytrainer import Trainer, TrainingArguments


def _args(out, **kw) -> TrainingArguments:
    base = {"output_dir": str(out), "num_workers": 2, "per_device_train_batch_size": 4, "num_train_epochs": 3,
            "learning_rate": 0.02, "optim": "adamw_torch", "save_strategy": "steps", "save_steps": 5,
            "logging_steps": 3, "disable_tqdm": True, "report_to": "none",
            "fsdp": "full_shard auto_wrap", "fsdp_config": {"transformer_layer_cls_to_wrap": ["Linear"]}}
    base.update(kw)
    return TrainingArguments(**base)


def test_fsdp_shards_trains_and_resumes_exactly(tmp_path, capfd):
    data = make_data(48)
    full = Trainer(model=DropoutRegressor(), args=_args(tmp_path / "full"), train_dataset=data,
                   callbacks=[ReportSharding()])
    out = full.train()
    console = "".join(capfd.readouterr())
    # 16 x 6 first-layer weight: each of the 2 ranks holds half of it as a DTensor shard
    for rank in (0, 1):
        assert f"rank {rank}: FSDPModule=True DTensor=True local=48 of 96" in console
    assert out.global_step == 18
    # the final weights came to the driver through storage, each rank writing its own shard (DCP)
    assert sorted(p.name for p in (tmp_path / "full" / ".raytrainer" / "final-model").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
    losses = [h["loss"] for h in full.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]

    # the model and the optimizer state are saved sharded (DCP, one file per rank each), nothing gathered:
    # no consolidated model.safetensors or optimizer.pt; rank 0 still writes the small files
    files = set(json.loads((tmp_path / "full" / "checkpoint-10" / "manifest.json").read_text())["files"])
    assert {"pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp",
            "pytorch_model_fsdp_0/__1_0.distcp", "optimizer_0/.metadata", "optimizer_0/__0_0.distcp",
            "optimizer_0/__1_0.distcp", "trainer_state.json", "training_args.json", "scheduler.pt",
            *rng_files(0, 1)} <= files, files
    assert "model.safetensors" not in files and "optimizer.pt" not in files, files
    # the final checkpoint's shards, consolidated, are the trained model bitwise
    from safetensors.torch import load_file

    from raytrainer.consolidate import consolidate

    assert consolidate(str(tmp_path / "full" / "checkpoint-18"), str(tmp_path / "merged")) == [
        "model.safetensors"]
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert merged.keys() == full.model.state_dict().keys()
    for name, tensor in full.model.state_dict().items():
        assert torch.equal(merged[name], tensor), name

    # exact resume mid-epoch (step 10 = epoch 2, update 4 of 6) on 2 FSDP workers
    resumed = Trainer(model=DropoutRegressor(), args=_args(tmp_path / "resumed"), train_dataset=data)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-10"))
    for name, tensor in full.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name

    # the sharded checkpoint also resumes on ONE worker (2 -> 1): DCP reshards the optimizer state
    single = Trainer(model=DropoutRegressor(), train_dataset=data,
                     args=_args(tmp_path / "single", num_workers=1, per_device_train_batch_size=8))
    out1 = single.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-10"))
    assert out1.global_step == 18
    restored = [(h["step"], h["loss"]) for h in single.state.log_history if "loss" in h]
    saved = [(h["step"], h["loss"]) for h in full.state.log_history if "loss" in h]
    assert restored[:3] == saved[:3]  # steps 3, 6, 9 come back from the checkpoint's trainer state
    assert [s for s, _ in restored] == [3, 6, 9, 12, 15, 18]

    # ... and on one worker without FSDP (a plain module filled from both ranks' shards): the same run
    plain = Trainer(model=DropoutRegressor(), train_dataset=data,
                    args=_args(tmp_path / "plain", num_workers=1, per_device_train_batch_size=8, fsdp="",
                               fsdp_config=None))
    assert plain.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-10")).global_step == 18
    assert [(h["step"], h["loss"]) for h in plain.state.log_history if "loss" in h][:3] == saved[:3]
    for name, tensor in single.model.state_dict().items():
        torch.testing.assert_close(plain.model.state_dict()[name], tensor, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(300)
def test_sharded_saves_write_in_the_background_and_a_failed_write_fails_the_run_naming_it(tmp_path):
    """FSDP's shards are written by DCP's async_save: the training thread goes on before the (held back)
    files of checkpoint-5 exist, and checkpoint-5 is committed whole. A write that fails (ENOSPC on rank 0
    at checkpoint-10) fails the run at a following step, naming the checkpoint and the error, and leaves
    that checkpoint uncommitted and checkpoint-5 intact."""
    out = tmp_path / "out"
    trainer = Trainer(model=DropoutRegressor(), args=_args(out), train_dataset=make_data(48),
                      callbacks=[SlowThenFullDisk(slow=5, full=10)])
    files = train_into_the_full_disk(trainer, out)
    assert {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp",
            "optimizer_0/__1_0.distcp"} <= files, files
    resumed = Trainer(model=DropoutRegressor(), args=_args(tmp_path / "again"), train_dataset=make_data(48))
    assert resumed.train(resume_from_checkpoint=str(out / "checkpoint-5")).global_step == 18


@pytest.mark.timeout(300)
def test_full_state_dict_checkpoints_are_consolidated_and_hold_what_the_sharded_ones_do(tmp_path):
    """FULL_STATE_DICT: model.safetensors and optimizer.pt gathered on rank 0, no DCP folders; the same run
    with SHARDED_STATE_DICT holds, consolidated from its shards, the same weights bit for bit. And
    load_best_model_at_end brings the best sharded checkpoint's weights into the driver's model (DCP, one
    process)."""
    from safetensors.torch import load_file

    from raytrainer.consolidate import consolidate

    data, evals = make_data(48), make_data(8, seed=2)
    runs = {}
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        args = _args(tmp_path / kind, max_steps=10, eval_strategy="steps", eval_steps=5,
                     load_best_model_at_end=True,
                     fsdp_config={"transformer_layer_cls_to_wrap": ["Linear"], "state_dict_type": kind})
        runs[kind] = Trainer(model=DropoutRegressor(), args=args, train_dataset=data, eval_dataset=evals)
        runs[kind].train()
    manifest = tmp_path / "FULL_STATE_DICT" / "checkpoint-10" / "manifest.json"
    full = set(json.loads(manifest.read_text())["files"])
    assert {"model.safetensors", "optimizer.bin"} <= full, full  # transformers' names under FSDP
    assert not any(f.startswith(("pytorch_model_fsdp_0/", "optimizer_0/")) for f in full), full
    consolidated = load_file(str(tmp_path / "FULL_STATE_DICT" / "checkpoint-10" / "model.safetensors"))
    assert consolidate(str(tmp_path / "SHARDED_STATE_DICT" / "checkpoint-10"), str(tmp_path / "merged"))
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert merged.keys() == consolidated.keys()
    for name, tensor in consolidated.items():
        assert torch.equal(merged[name], tensor), name

    sharded = runs["SHARDED_STATE_DICT"]
    best = sharded.state.best_model_checkpoint
    assert best and os.path.exists(os.path.join(best, "pytorch_model_fsdp_0", ".metadata"))
    assert consolidate(best, str(tmp_path / "best"))
    expected = load_file(str(tmp_path / "best" / "model.safetensors"))
    for name, tensor in sharded.model.state_dict().items():  # the driver's model, loaded lazily from DCP
        assert torch.equal(tensor, expected[name]), name


def test_an_accelerate_fsdp_yaml_runs_fsdp(tmp_path, capfd):
    import os

    yaml = os.path.join(os.path.dirname(__file__), "data", "accelerate_fsdp.yaml")
    args = TrainingArguments(output_dir=str(tmp_path), accelerate_config=yaml, max_steps=3,
                             per_device_train_batch_size=4, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=DropoutRegressor(), args=args, train_dataset=make_data(32),
                      callbacks=[ReportSharding()])
    assert trainer.train().global_step == 3
    console = "".join(capfd.readouterr())
    for rank in (0, 1):
        assert f"rank {rank}: FSDPModule=True DTensor=True local=48 of 96" in console


@pytest.mark.timeout(300)
def test_fsdp_model_init_initialises_each_rank_shard_of_a_transformers_model(tmp_path, capfd):
    """A GPT-2 from a config in model_init: every rank builds it on the meta device and initialises only its
    own shard with transformers' _init_weights, so each holds half the parameters before the first step;
    the weights follow GPT-2's scheme (residual projections at 0.02/sqrt(2 n_layer)), the two ranks' shards
    are drawn apart (not copies), and it trains."""
    import re

    from models import ReportInitialShards, counting_data, tiny_gpt2

    args = _args(tmp_path, fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"]}, max_steps=12,
                 learning_rate=3e-3, per_device_train_batch_size=8, logging_steps=4, save_strategy="no")
    trainer = Trainer(model_init=tiny_gpt2, args=args, train_dataset=counting_data(96),
                      callbacks=[ReportInitialShards()])
    trainer.train()
    console = "".join(capfd.readouterr())
    report = {int(r): (int(h), int(f), float(p), float(a), o, e) for r, h, f, p, a, o, e in re.findall(
        r"rank (\d): held=(\d+) full=(\d+) proj_std=([\d.]+) attn_std=([\d.]+) norms_ones=(\w+) "
        r"halves_equal=(\w+)", console)}
    assert sorted(report) == [0, 1], console[-3000:]
    for held, full, proj, attn, ones, equal in report.values():
        assert held == full // 2  # this rank's shard, never the model
        assert proj == pytest.approx(0.02 / 2, rel=0.15) and attn == pytest.approx(0.02, rel=0.15)
        assert ones == "True" and equal == "False"
    assert "initialising each rank's shard" not in console  # no fall-back to rank 0's build
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5, losses

    # `raytrainer consolidate`: the two ranks' DCP shards of the final weights, a file of at most 100 KB at
    # a time, into safetensors that from_pretrained loads -- equal to the trained model
    from transformers import GPT2LMHeadModel

    from raytrainer.cli import main

    out = tmp_path / "consolidated"
    final = tmp_path / ".raytrainer" / "final-model"
    assert main(["consolidate", str(final), str(out), "--max-shard-size", "100KB"]) == 0
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    trainer.model.config.save_pretrained(out)
    expected = trainer.model.state_dict()
    loaded = GPT2LMHeadModel.from_pretrained(out).state_dict()
    assert loaded.keys() == expected.keys()
    for key, tensor in loaded.items():
        assert torch.equal(tensor, expected[key]), key


@pytest.mark.timeout(300)
def test_fsdp_initialises_each_rank_shard_of_a_plain_torch_model_with_each_modules_reset_parameters(tmp_path,
                                                                                                  capfd):
    """A plain torch model (Linear layers, a LayerNorm; no root reset_parameters, no transformers init) from
    model_init: every rank builds it on the meta device and initialises its own shard with each module's
    reset_parameters(), so each holds half the parameters before the first step, within nn.Linear's bounds,
    the two ranks' shards drawn apart; no fall-back to rank 0's build, and it trains."""
    import re

    from models import ReportParameterMemory, ReportPlainInit, build_plain_stack, wide_data

    args = _args(tmp_path, fsdp="full_shard", fsdp_config={}, max_steps=6, logging_steps=1,
                 per_device_train_batch_size=4, learning_rate=3e-3, save_strategy="no")
    trainer = Trainer(model_init=build_plain_stack, args=args, train_dataset=wide_data(48, width=256),
                      callbacks=[ReportParameterMemory(), ReportPlainInit()])
    trainer.train()
    console = "".join(capfd.readouterr())
    held = {int(r): (int(h), int(f)) for r, h, f in re.findall(r"rank (\d): held=(\d+) full=(\d+)", console)}
    init = {int(r): (float(b), float(s), o, float(c)) for r, b, s, o, c in re.findall(
        r"rank (\d): bound_ratio=([\d.]+) spread=([\d.]+) norm_ones=(\w+) first=(-?[\d.]+)", console)}
    assert sorted(held) == sorted(init) == [0, 1], console[-3000:]
    for rank, (ratio, spread, ones, _) in init.items():
        assert abs(held[rank][0] - held[rank][1] / 2) < 0.01 * held[rank][1]  # its shard, never the model
        assert ratio <= 1.0 and spread > 0.4 and ones == "True", init  # U(-1/sqrt(in), 1/sqrt(in)): 0.577
    assert init[0][3] != init[1][3]  # each rank drew its own shard
    assert "rank 0 builds the model" not in console and "initialising each rank's shard" not in console
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses), losses


@pytest.mark.timeout(300)
def test_fsdp_falls_back_to_rank_0_when_a_shard_cannot_be_initialised(tmp_path, capfd):
    """A model whose initialisation fails on one rank's shard: every rank agrees, warns, and goes rank 0's
    way (rank 0 builds, the shards are filled from it), so the run trains as the run that asks for rank 0's
    way (``cpu_ram_efficient_loading``) does, bit for bit. (Not as a model handed in: transformers' loop
    draws the data order from the random state model_init leaves, as in one process.)"""
    from models import InitFailsOnShards, make_data

    data = make_data(32)
    kw = {"max_steps": 4, "save_strategy": "no"}
    built = Trainer(model_init=lambda: InitFailsOnShards(), args=_args(tmp_path / "init", **kw),
                    train_dataset=data)
    built.train()
    console = "".join(capfd.readouterr())
    assert "initialising each rank's shard of FSDPInitFailsOnShards failed" in console, console[-3000:]
    asked = Trainer(model_init=lambda: InitFailsOnShards(), train_dataset=data,
                    args=_args(tmp_path / "asked", **kw, fsdp_config={
                        "transformer_layer_cls_to_wrap": ["Linear"], "cpu_ram_efficient_loading": True}))
    asked.train()
    assert [h["loss"] for h in built.state.log_history if "loss" in h] == \
        [h["loss"] for h in asked.state.log_history if "loss" in h]
    for name, tensor in asked.model.state_dict().items():
        assert torch.equal(built.model.state_dict()[name], tensor), name


@pytest.mark.timeout(900)
def test_fsdp_model_init_never_builds_the_whole_model_on_a_rank(tmp_path, capfd):
    """model_init of a model whose root has reset_parameters(): every rank builds it on the meta device and
    initialises its own shard, so no rank's memory ever grows by the model. With
    fsdp_config["cpu_ram_efficient_loading"], rank 0 builds it whole and broadcasts it into the shards (the
    others build on meta): the run then trains exactly as the same model handed in built."""
    import re

    from models import ReportParameterMemory, WideStack, build_wide_stack, wide_data

    from raytrainer.trainer_utils import set_seed

    def report_of(console):
        found = {int(r): (int(h), int(f), int(g), int(i)) for r, h, f, g, i in re.findall(
            r"rank (\d): held=(\d+) full=(\d+) peak_growth=(-?\d+) init_growth=(-?\d+)", console)}
        assert sorted(found) == [0, 1], console[-3000:]
        return found

    data = wide_data(16)
    kw = {"fsdp": "full_shard", "max_steps": 2, "save_steps": 1, "logging_steps": 1,
          "per_device_train_batch_size": 2, "learning_rate": 1e-3}
    sharded = Trainer(model_init=build_wide_stack, args=_args(tmp_path / "shards", fsdp_config={}, **kw),
                      train_dataset=data, callbacks=[ReportParameterMemory()])
    sharded.train()
    report = report_of("".join(capfd.readouterr()))
    full = report[0][1]
    assert full > 256 << 20  # 256 MiB of weights
    for rank, (held, _, peak, built) in report.items():
        assert abs(held - full / 2) < 0.01 * full, (rank, held, full)  # half each, before the first step
        assert built < 0.1 * full, report  # model_init on the meta device allocates nothing
        assert peak < 0.75 * full, report  # its shard, and never the whole model
    assert all(math.isfinite(h["loss"]) for h in sharded.state.log_history if "loss" in h)

    kw["fsdp_config"] = {"cpu_ram_efficient_loading": True}
    built = Trainer(model_init=build_wide_stack, args=_args(tmp_path / "init", **kw), train_dataset=data,
                    callbacks=[ReportParameterMemory()])
    built.train()
    report = report_of("".join(capfd.readouterr()))
    for rank, (held, _, _, _) in report.items():
        assert abs(held - full / 2) < 0.01 * full, (rank, held, full)
    assert report[1][3] < 0.1 * full, report  # rank 1: model_init on the meta device allocates nothing
    assert report[1][2] < 1.35 * full, report  # its shard twice at most, never the model plus its shard
    assert report[0][2] < 2.25 * full, report  # the full build it broadcasts from, plus its shard

    set_seed(42)  # what the Trainer does before model_init
    given = Trainer(model=WideStack(), args=_args(tmp_path / "given", **kw), train_dataset=data)
    given.train()
    for name, tensor in given.model.state_dict().items():
        assert torch.equal(built.model.state_dict()[name], tensor), name
    assert [h["loss"] for h in built.state.log_history if "loss" in h] == \
        [h["loss"] for h in given.state.log_history if "loss" in h]

    # resumed with model_init: rank 0 reads the checkpoint's weights and broadcasts them into the shards
    resumed = Trainer(model_init=build_wide_stack, args=_args(tmp_path / "resumed", **kw), train_dataset=data)
    resumed.train(resume_from_checkpoint=str(tmp_path / "init" / "checkpoint-1"))
    for name, tensor in built.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
