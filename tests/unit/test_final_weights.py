"""The trained weights' way from workers to the driver: storage, loaded lazily; the channel refuses weights.

FSDP's sharded layout is written here by a real one-rank gloo process group in this process; the 2-worker
layout (one file per rank) is checked by tests/integration/test_fsdp.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from raytrainer import TrainingArguments, final_weights
from raytrainer.rank_context import RankContext
from raytrainer.worker.channel_client import MAX_RESULT_TENSOR_BYTES, refuse_weights


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))


class _Rank:
    """What final_weights.write_hosted reads of a trainer on a rank: its model, as accelerate prepared it."""

    def __init__(self, model):
        self.model = self.model_wrapped = model
        self.accelerator = self

    def unwrap_model(self, model):
        return model


def _write(args, model) -> str:
    return final_weights.write_hosted(_Rank(model), RankContext(), args)


def _args(out, **kw) -> TrainingArguments:
    return TrainingArguments(output_dir=str(out), report_to="none", **kw)


def _round_trip(args, trained):
    uri = _write(args, trained)
    driver = _model(seed=1)  # the driver's module: other values, filled in place
    before = driver[0].weight
    final_weights.load_into(driver, uri, args.storage_filesystem)
    assert driver[0].weight is before
    return uri, driver


def test_replicated_weights_are_one_safetensors_file_filled_in_place(tmp_path):
    args = _args(tmp_path / "out")
    trained = _model(seed=0)
    uri, driver = _round_trip(args, trained)
    assert os.listdir(uri) == ["model.safetensors"]
    for name, value in trained.state_dict().items():
        assert torch.equal(driver.state_dict()[name], value), name


def test_fsdp_writes_shards_and_the_driver_loads_them_from_a_bucket(tmp_path, s3_bucket, gloo_group):
    from torch.distributed.fsdp import fully_shard

    args = _args(tmp_path / "out", storage_path=f"{s3_bucket.uri}/run", fsdp="full_shard", num_workers=1)
    trained = _model(seed=0)
    expected = {k: v.clone() for k, v in trained.state_dict().items()}
    fully_shard(trained)  # as accelerate's FSDP2 prepares it: each rank's parameters a DTensor shard
    uri, driver = _round_trip(args, trained)
    assert uri == f"{s3_bucket.uri}/run/.raytrainer/final-model"
    folder = "run/.raytrainer/final-model/"
    assert sorted(k for k in s3_bucket.list_objects(folder) if not k.endswith("/")) == [
        f"{folder}.metadata", f"{folder}__0_0.distcp"]
    for name, value in expected.items():
        assert torch.equal(driver.state_dict()[name], value), name


def test_a_second_write_replaces_the_first(tmp_path):
    args = _args(tmp_path / "out")
    _write(args, _model(seed=0))
    stale = tmp_path / "out" / ".raytrainer" / "final-model" / "__5_0.distcp"
    stale.write_bytes(b"from a run on more workers")
    _, driver = _round_trip(args, _model(seed=2))
    assert not stale.exists()
    assert torch.equal(driver[0].weight, _model(seed=2)[0].weight)


def test_missing_final_weights_name_the_folder(tmp_path):
    (tmp_path / ".raytrainer" / "final-model").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"\.raytrainer/final-model holds no final weights"):
        final_weights.load_into(_model(0), str(tmp_path / ".raytrainer" / "final-model"))


def test_the_channel_refuses_weights_but_takes_metrics():
    refuse_weights({"output": {"train_loss": 0.5}, "state": {"log_history": [{"loss": 1.0}]},
                    "small": torch.zeros(16)})
    with pytest.raises(RuntimeError, match="weights go through storage"):
        refuse_weights({"weights": _model(0).state_dict(), "big": torch.zeros(MAX_RESULT_TENSOR_BYTES)})
    with pytest.raises(RuntimeError, match="Sequential module"):
        refuse_weights({"output": [_model(0)]})


class _Mixed(nn.Module):
    """float32 and bfloat16 weights, a tied pair stored once, an integer buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.body = nn.Linear(8, 8).to(torch.bfloat16)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))


def test_safetensors_are_read_straight_into_the_model_tensors_and_cast_where_the_dtype_differs(tmp_path):
    from safetensors.torch import save_file

    from raytrainer.saving import dedupe_shared

    torch.manual_seed(3)
    trained = _Mixed()
    trained.steps += torch.tensor([5, 6, 7])
    stored = dedupe_shared({k: v.detach().clone() for k, v in trained.state_dict().items()})
    stored["body.bias"] = stored["body.bias"].float()  # stored in another dtype than the model's
    save_file(stored, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    torch.manual_seed(4)
    driver = _Mixed()
    final_weights.load_into(driver, str(tmp_path))
    for name, value in trained.state_dict().items():
        assert torch.equal(driver.state_dict()[name], value.to(driver.state_dict()[name].dtype)), name
    assert driver.head.weight is driver.embed.weight and driver.body.bias.dtype == torch.bfloat16

    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-10])  # the last tensor cut short
    with pytest.raises(OSError, match="truncated"):
        final_weights.load_into(_Mixed(), str(tmp_path))


def _rebuilt_rank(folder: str, rank: int, port: str, results) -> None:
    """Rank ``rank`` of two: an FSDP2 model trained (seed 0) writes its shard of the final weights; a model
    built again (seed 1, sharded the same way: a new group's trainer) loads them, each rank its share."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.distributed.init_process_group("gloo")
    trained, rebuilt = fully_shard(_model(seed=0)), fully_shard(_model(seed=1))
    dcp.save({"model": get_model_state_dict(trained)}, checkpoint_id=folder)  # final_weights' FSDP2 layout
    final_weights.load_on_ranks(rebuilt, folder)
    mine = {k: v.to_local().clone() for k, v in rebuilt.state_dict().items()}
    results.put({"rank": rank, "equal": all(torch.equal(mine[k], v.to_local())
                                            for k, v in trained.state_dict().items()),
                 "full": {k: v.full_tensor().numpy().copy() for k, v in rebuilt.state_dict().items()}})
    torch.distributed.destroy_process_group()


def test_a_trainer_built_again_on_the_ranks_loads_the_trained_weights_each_rank_its_share(tmp_path):
    """After close() or a restart the ranks build a trained hosted trainer again: ``load_on_ranks`` gives
    its model the final weights train() wrote -- DCP shards read by each rank for its own share, or the
    one safetensors file."""
    import functools
    import socket

    from two_ranks import run_two_ranks

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    target = functools.partial(_rebuilt_rank, str(tmp_path / "final"))
    results = sorted(run_two_ranks(target, port, timeout=180), key=lambda r: r["rank"])
    assert [r["equal"] for r in results] == [True, True]
    for name, value in _model(seed=0).state_dict().items():
        assert torch.equal(torch.from_numpy(results[0]["full"][name]), value), name

    args = _args(tmp_path / "out")  # replicated: rank 0's model.safetensors, read whole by every rank
    uri = _write(args, _model(seed=0))
    again = _model(seed=1)
    final_weights.load_on_ranks(again, uri)
    for name, value in _model(seed=0).state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name
