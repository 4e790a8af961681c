"""A hosted trainer's resume from a bucket (worker/hosted_resume.py): which files each rank copies to its
node, and accelerate's sharded loads reading a DCP folder through raytrainer's ranged, verified reader (a
real S3 server, moto) -- pinned to how accelerate makes its reader, so a change there fails here."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import torch
from test_block_hashes import SHARD, _sharded_checkpoint, _upload

from raytrainer.checkpoint import SHARDED_MODEL_DIR, CheckpointReader, DamagedCheckpointError
from raytrainer.worker.hosted_resume import Resume, dcp_folders, files_to_copy, world_size_of

#: A checkpoint transformers' loop wrote on 2 ranks under FSDP with SHARDED_STATE_DICT, with a ZeRO folder
DDP_SHARED = ["config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"]
FSDP = [f"{d}/{f}" for d in ("optimizer_0", "pytorch_model_fsdp_0") for f in (".metadata", "__0_0.distcp",
                                                                              "__1_0.distcp")]
PARTITIONS = [f"global_step4/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
ZERO = ["global_step4/mp_rank_00_model_states.pt", *PARTITIONS, "latest"]
RNG = ["rng_state_0.pth", "rng_state_1.pth"]


def test_each_rank_copies_its_own_files_and_a_node_the_shared_ones_once():
    names = sorted(DDP_SHARED + FSDP + ZERO + RNG)
    assert world_size_of(names) == 2 and world_size_of(["rng_state.pth", "x"]) == 1
    assert world_size_of(DDP_SHARED) is None
    assert dcp_folders(names) == {"optimizer_0", "pytorch_model_fsdp_0"}
    # two ranks on one node: rank 0 copies the shared files, each rank its RNG state, partitions, shards
    zero = files_to_copy(names, 0, 2, 2, local_zero=True)
    one = files_to_copy(names, 1, 2, 2, local_zero=False)
    own_zero = {PARTITIONS[0], "rng_state_0.pth", "optimizer_0/.metadata", "optimizer_0/__0_0.distcp",
                "pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp"}
    shared = {*DDP_SHARED, "latest", "global_step4/mp_rank_00_model_states.pt"}
    assert set(zero) == shared | own_zero and len(zero) == len(set(zero))
    assert sorted(one) == [PARTITIONS[1], "optimizer_0/__1_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp",
                           "rng_state_1.pth"]
    # rank 1 alone on a second node: the shared files once more (that node's copy), its own files
    assert set(files_to_copy(names, 1, 2, 2, local_zero=True)) == set(one) | shared
    # resumed on one worker: DeepSpeed reads every partition; a DCP folder's other shards are read in ranges
    alone = files_to_copy(names, 0, 1, 2, local_zero=True)
    assert {n for n in ZERO if "zero_pp_rank" in n} <= set(alone)
    assert "rng_state_1.pth" not in alone and "pytorch_model_fsdp_0/__1_0.distcp" in alone  # owned_files:
    # a shard of a rank beyond the world size is some rank's to copy


def test_accelerate_calls_dcp_by_name_at_call_time_in_its_sharded_saves_and_loads():
    """What ``hosted_resume._through_storage`` and ``hosted_saves._dcp_in_background`` rely on: accelerate's
    sharded loads and saves import torch.distributed.checkpoint inside the function and call
    ``dist_cp.FileSystemReader(folder)`` / ``dist_cp.save(..., storage_writer=dist_cp.FileSystemWriter(
    folder), planner=DefaultSavePlanner())`` there."""
    from accelerate.utils import fsdp_utils

    for load in (fsdp_utils.load_fsdp_model, fsdp_utils.load_fsdp_optimizer):
        source = inspect.getsource(load)
        assert "import torch.distributed.checkpoint as dist_cp" in source, load
        assert "storage_reader=dist_cp.FileSystemReader(ckpt_dir)" in source, load
    for save in (fsdp_utils.save_fsdp_model, fsdp_utils.save_fsdp_optimizer):
        source = " ".join(inspect.getsource(save).split())
        assert "import torch.distributed.checkpoint as dist_cp" in source, save
        assert "dist_cp.save( state_dict=" in source, save
        writer = "storage_writer=dist_cp.FileSystemWriter(ckpt_dir), planner=DefaultSavePlanner(),"
        assert writer in source, save


class _Loading:
    """A trainer's load hook as accelerate's sharded load makes its reader (the pinned call above)."""

    def __init__(self):
        self.loaded = None

    def _load_from_checkpoint(self, folder, model=None):
        import torch.distributed.checkpoint as dist_cp

        state = {"model": {k: torch.zeros_like(v) for k, v in self.expected.items()}}
        ckpt_dir = Path(folder) / SHARDED_MODEL_DIR
        dist_cp.load(state_dict=state, storage_reader=dist_cp.FileSystemReader(ckpt_dir))
        self.loaded = state["model"]

    def _load_optimizer_and_scheduler(self, folder):
        pass


def test_a_sharded_load_reads_the_bucket_in_verified_ranges(tmp_path, s3_bucket):
    model = _sharded_checkpoint(tmp_path / "ckpt")
    _upload(s3_bucket, tmp_path / "ckpt", "runs/checkpoint-1")
    reader = CheckpointReader(f"{s3_bucket.uri}/runs/checkpoint-1")
    local = tmp_path / "resume"
    (local / SHARDED_MODEL_DIR).mkdir(parents=True)  # nothing of the folder copied: every read is ranged
    resume = Resume(str(local), 1, {str(local / SHARDED_MODEL_DIR): (reader, SHARDED_MODEL_DIR)})
    trainer = _Loading()
    trainer.expected = {k: v for k, v in model.items() if k != "big"}  # a plan that skips the big tensor
    s3_bucket.server.clear_requests()
    with resume.reading(trainer):
        trainer._load_from_checkpoint(str(local))
    for name, tensor in trainer.expected.items():
        assert torch.equal(trainer.loaded[name], tensor), name
    got = [r for r in s3_bucket.server.requests(clear=True)
           if r["method"] == "GET" and r["key"].endswith(SHARD)]
    size = os.path.getsize(tmp_path / "ckpt" / SHARD)
    assert got and sum(r["bytes_out"] for r in got) < size / 4, (size, got)  # ranges of it, not the file
    assert "_load_from_checkpoint" not in trainer.__dict__  # the trainer's own load again, after the call

    # a path outside the resume folder: torch's own reader, from local disk
    trainer.expected = dict(model)
    with resume.reading(trainer):
        trainer._load_from_checkpoint(str(tmp_path / "ckpt"))
    assert torch.equal(trainer.loaded["big"], model["big"])
    assert not [r for r in s3_bucket.server.requests() if r["method"] == "GET"]

    # a damaged block the plan reads: refused, naming the file (one byte flipped in the bucket)
    data = bytearray((tmp_path / "ckpt" / SHARD).read_bytes())
    data[-100] ^= 0xFF  # the small tensors lie at the file's end
    s3_bucket.server.client.put_object(Bucket=s3_bucket.name, Key=f"runs/checkpoint-1/{SHARD}",
                                       Body=bytes(data))
    trainer.expected = {k: v for k, v in model.items() if k != "big"}
    with pytest.raises(DamagedCheckpointError, match=SHARD), resume.reading(trainer):
        trainer._load_from_checkpoint(str(local))
