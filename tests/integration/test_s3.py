"""2 Ray workers with their checkpoints in a real S3 server (moto, tests/s3server.py; the workers have its
endpoint and credentials in their environment, as a cluster's nodes would): Ray Train's run folder is the
bucket prefix itself (nothing written to a local folder named after the URI), FSDP's sharded checkpoints are
committed with a manifest matching the objects, rotation, bitwise resume from ``resume_from_checkpoint=True``
and from an ``s3://`` path into a fresh output_dir -- and what each rank reads on resume, counted at the
server per process: its own model and optimizer shards once, only ranged slices of the other rank's, at
most 0.6x the checkpoint in all."""

from __future__ import annotations

import os
from collections import defaultdict

import torch
from models import RecordPid, WideDropoutRegressor, make_data, rng_files
from test_fsdp import _args  # FSDP full_shard on 2 workers, saving every 5 steps

from raytrainer import Trainer
from raytrainer.storage import Storage, strip_scheme


def _same(a, b):
    for name, tensor in a.state_dict().items():
        assert torch.equal(b.state_dict()[name], tensor), name


def _reads_by_rank(requests, out) -> dict[int, dict[str, int]]:
    """rank -> object key -> bytes the rank's process fetched (GETs, at the server)."""
    rank_of = {int(open(os.path.join(out, f"pid-rank{r}")).read()): r for r in (0, 1)}  # noqa: SIM115
    reads: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for req in requests:
        if req["method"] == "GET" and req["key"] and req["pid"] in rank_of:
            reads[rank_of[req["pid"]]][req["key"]] += req["bytes_out"]
    return reads


def test_fsdp_checkpoints_in_a_bucket_resume_exactly_reading_each_ranks_share(tmp_path, s3_bucket):
    uri = f"{s3_bucket.uri}/runs/fsdp"
    data = make_data(48)
    full = Trainer(model=WideDropoutRegressor(), train_dataset=data,
                   args=_args(tmp_path / "full", storage_path=uri, save_total_limit=2))
    assert full.train().global_step == 18
    committed = s3_bucket.committed("runs/fsdp")  # manifests match the objects, sha256 included
    assert set(committed) == {"checkpoint-15", "checkpoint-18"}  # rotation: 5 and 10 deleted by the driver
    shards = {f"{d}/{f}" for d in ("optimizer_0", "pytorch_model_fsdp_0")
              for f in ("__0_0.distcp", "__1_0.distcp", ".metadata")}
    assert shards | rng_files(0, 1) <= set(committed["checkpoint-15"]["files"])
    assert "model.safetensors" not in committed["checkpoint-15"]["files"]  # the model sharded too
    assert not os.path.exists("s3:") and not any("s3:" in p for p in os.listdir(tmp_path / "full"))

    # as if the run had been stopped before its last save: resume_from_checkpoint=True finds checkpoint-15
    # in the bucket and ends bitwise where the uninterrupted run did
    Storage.from_uri(f"{uri}/checkpoint-18").delete_dir(strip_scheme(f"{uri}/checkpoint-18"))
    again = Trainer(model=WideDropoutRegressor(), args=_args(tmp_path / "again", storage_path=uri),
                    train_dataset=data)
    assert again.train(resume_from_checkpoint=True).global_step == 18
    _same(full.model, again.model)

    # from an s3:// checkpoint path into a fresh, local output_dir; requests counted per rank
    s3_bucket.server.clear_requests()
    fresh_dir = tmp_path / "fresh"
    fresh = Trainer(model=WideDropoutRegressor(), args=_args(fresh_dir, save_strategy="no"),
                    train_dataset=data, callbacks=[RecordPid()])
    fresh.train(resume_from_checkpoint=f"{uri}/checkpoint-15")
    _same(full.model, fresh.model)
    reads = _reads_by_rank(s3_bucket.server.requests(), str(fresh_dir))
    sizes = {n: m["size"] for n, m in committed["checkpoint-15"]["files"].items()}
    prefix = "runs/fsdp/checkpoint-15/"
    requests = s3_bucket.server.requests()
    for rank in (0, 1):  # the figures docs/cluster.md quotes
        mine = [r for r in requests if r["pid"] == int((fresh_dir / f"pid-rank{rank}").read_text())]
        total = sum(r["bytes_out"] for r in mine)
        print(f"S3 resume, rank {rank}: {len(mine)} requests, {total} bytes read; "
              f"by object: {dict(reads[rank])}; checkpoint files: {sizes}")
    for rank, other in ((0, 1), (1, 0)):
        for folder in ("optimizer_0", "pytorch_model_fsdp_0"):
            own = reads[rank][f"{prefix}{folder}/__{rank}_0.distcp"]
            foreign = reads[rank][f"{prefix}{folder}/__{other}_0.distcp"]
            assert own == sizes[f"{folder}/__{rank}_0.distcp"], (rank, dict(reads[rank]))  # once, whole
            assert foreign < sizes[f"{folder}/__{other}_0.distcp"] / 4, (rank, dict(reads[rank]))  # slices
        (foreign_rng,) = rng_files(other)
        assert reads[rank][f"{prefix}{foreign_rng}"] == 0  # each rank its own RNG state
        # each rank reads its share of the checkpoint (model and optimizer), not the whole of it
        assert sum(reads[rank].values()) <= 0.6 * sum(sizes.values()), (rank, dict(reads[rank]), sizes)


def test_deepspeed_zero3_resumes_from_a_bucket_each_rank_downloading_its_own_partition(tmp_path, s3_bucket):
    """DeepSpeed's loader reads files by path: from a bucket each rank downloads (verified) its own ZeRO
    partition files and the shared ones, none of the other rank's -- the checkpoint holds no gathered model,
    so that is at most 0.6x of it per rank; the resume is bitwise."""
    from test_deepspeed import _args as ds_args

    uri = f"{s3_bucket.uri}/runs/zero3"
    data = make_data(48)
    full = Trainer(model=WideDropoutRegressor(), train_dataset=data,
                   args=ds_args(tmp_path / "full", 3, bf16=True, storage_path=uri))
    assert full.train().global_step == 18
    files = s3_bucket.committed("runs/zero3")["checkpoint-10"]["files"]
    partitions = {r: {n for n in files if f"zero_pp_rank_{r}_" in n} for r in (0, 1)}
    assert partitions[0] and partitions[1]
    assert "model.safetensors" not in files, files  # the model is the partitions: nothing gathered

    s3_bucket.server.clear_requests()
    fresh_dir = tmp_path / "fresh"
    fresh = Trainer(model=WideDropoutRegressor(), train_dataset=data, callbacks=[RecordPid()],
                    args=ds_args(fresh_dir, 3, bf16=True, save_strategy="no"))
    fresh.train(resume_from_checkpoint=f"{uri}/checkpoint-10")
    _same(full.model, fresh.model)
    reads = _reads_by_rank(s3_bucket.server.requests(), str(fresh_dir))
    prefix = "runs/zero3/checkpoint-10/"
    for rank, other in ((0, 1), (1, 0)):
        for name in partitions[rank]:
            assert reads[rank][prefix + name] == files[name]["size"], (rank, name)  # once, whole
        for name in partitions[other]:
            assert reads[rank][prefix + name] == 0, (rank, name)
    sizes = {n: m["size"] for n, m in files.items()}
    for rank in (0, 1):  # each rank reads its share of the checkpoint, not the whole of it
        print(f"S3 ZeRO-3 resume, rank {rank}: {sum(reads[rank].values())} of {sum(sizes.values())} bytes")
        assert sum(reads[rank].values()) <= 0.6 * sum(sizes.values()), (rank, dict(reads[rank]), sizes)
