"""``parallelism_config`` on the driver (raytrainer/parallelism.py): accepted as transformers and accelerate
take it (an object, a dict, JSON on the command line), and each mesh the run cannot lay out refused before
anything starts, naming the value and the fix."""

from __future__ import annotations

import pytest
import torch

from raytrainer import Trainer, TrainingArguments
from raytrainer.hf_argparser import HfArgumentParser
from raytrainer.parallelism import check_fits, parse


def _args(tmp_path, **kw):
    return TrainingArguments(output_dir=str(tmp_path), **{"num_workers": 4, **kw})


def test_an_accelerate_object_a_dict_and_json_on_the_command_line_give_the_same_mesh(tmp_path):
    from accelerate import ParallelismConfig

    given = [ParallelismConfig(dp_shard_size=2, tp_size=2), {"dp_shard_size": 2, "tp_size": 2}]
    parsed = [_args(tmp_path, parallelism_config=v).parallelism_config for v in given]
    (cli,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--num_workers", "4", "--parallelism_config",
         '{"dp_shard_size": 2, "tp_size": 2}'])
    for config in [*parsed, cli.parallelism_config]:
        assert isinstance(config, ParallelismConfig)
        sizes = (config.dp_replicate_size, config.dp_shard_size, config.tp_size, config.cp_size)
        assert sizes == (1, 2, 2, 1)
    path = tmp_path / "mesh.json"
    path.write_text('{"dp_replicate_size": 2, "dp_shard_size": 2}')
    assert parse(str(path)).dp_replicate_size == 2
    # sizes that are all 1 are no mesh, as accelerate reads them: a plain run
    assert _args(tmp_path, parallelism_config={"tp_size": 1}).parallelism_config is None


@pytest.mark.parametrize(("kw", "words"), [
    ({"num_workers": 2, "parallelism_config": {"dp_shard_size": 2, "tp_size": 2}},
     "spans dp_shard_size=2 x tp_size=2 = 4 ranks, but num_workers=2. Fix: pass --num_workers 4"),
    ({"num_workers": 0, "parallelism_config": {"dp_shard_size": 2, "tp_size": 2}},
     "num_workers=0. Fix: pass --num_workers 4"),
    ({"num_workers": "2:4", "per_device_train_batch_size": 12,
      "parallelism_config": {"dp_shard_size": 2, "tp_size": 2}},
     "needs a fixed number of workers"),
    ({"parallelism_config": {"dp_shard_size": 2, "cp_size": 2}}, "ring attention"),
    ({"num_workers": 2, "parallelism_config": {"sp_size": 2}}, "Ulysses sequence parallelism"),
    ({"parallelism_config": {"dp_shard_size": 4}, "fsdp": "hybrid_shard"}, "drop hybrid_shard"),
    ({"parallelism_config": {"dp_replicate_size": 4}}, "dp_replicate alone is plain data parallelism"),
    ({"parallelism_config": {"tpsize": 4}}, "has no field 'tpsize'"),
    ({"parallelism_config": "{tp_size: 4"}, "is neither JSON nor a JSON file"),
    ({"parallelism_config": {"dp_shard_size": 2, "tp_size": 2},
      "deepspeed": {"zero_optimization": {"stage": 3}}}, "drop --deepspeed"),
])
def test_a_mesh_the_run_cannot_lay_out_is_refused_naming_the_fix(tmp_path, kw, words):
    with pytest.raises(ValueError, match="parallelism_config") as info:
        _args(tmp_path, **kw)
    assert words in str(info.value)


def test_a_tensor_parallel_group_larger_than_any_node_is_refused():
    config = parse({"dp_shard_size": 2, "tp_size": 4})
    check_fits(config, [4, 4])  # 2 nodes of 4 workers: each group of 4 fits in one
    with pytest.raises(ValueError, match="no node of the cluster holds more than 2 workers") as info:
        check_fits(config, [2, 2, 2, 2])
    assert "lower tp_size" in str(info.value)


class NoPlan(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def forward(self, x, labels=None):
        return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}


def test_tensor_parallelism_for_a_model_without_a_plan_is_refused_on_the_driver(tmp_path):
    import sys

    def ray_up() -> bool:
        ray = sys.modules.get("ray")
        return ray is not None and ray.is_initialized()

    up_before = ray_up()  # a whole-suite run has the integration tests' Ray instance up already
    data = [{"x": torch.zeros(4), "labels": torch.zeros(2)} for _ in range(8)]
    args = _args(tmp_path, parallelism_config={"dp_shard_size": 2, "tp_size": 2})
    for trainer in (Trainer(model=NoPlan(), args=args, train_dataset=data),
                    Trainer(model_init=NoPlan, args=args, train_dataset=data)):
        with pytest.raises(ValueError, match="NoPlan has no tensor-parallel plan") as info:
            trainer.train()
        assert "model.tp_plan = " in str(info.value)
        assert "_group" not in vars(trainer)  # no worker group was started for it
    assert ray_up() == up_before  # the check runs before Ray is asked for anything


def test_a_hosted_trainers_ranks_get_accelerates_object_whatever_form_it_was_given_in(tmp_path):
    """TRL's trainers run transformers' own loop on each rank, where accelerate reads parallelism_config: the
    arguments the ranks build hold the ParallelismConfig, not the dict or JSON the script passed."""
    pytest.importorskip("trl")
    from accelerate import ParallelismConfig

    from raytrainer.hosted_recipe import plain_config
    from raytrainer.trl import SFTConfig

    for given in ({"dp_shard_size": 2, "tp_size": 2}, '{"dp_shard_size": 2, "tp_size": 2}'):
        plain = plain_config(SFTConfig(output_dir=str(tmp_path), num_workers=4, bf16=False,
                                       parallelism_config=given))
        assert type(plain).__module__.startswith("trl.")
        assert isinstance(plain.parallelism_config, ParallelismConfig)
        assert (plain.parallelism_config.dp_shard_size, plain.parallelism_config.tp_size) == (2, 2)
