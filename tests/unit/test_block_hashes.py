"""Ranged reads of a sharded checkpoint in a bucket are verified block by block (a real S3 server, moto):
a DCP shard's manifest entry holds the sha256 of each of its 4 MiB blocks, a read that touches part of the
file fetches and checks only the blocks it touches, and a damaged block is refused naming the file -- while
the blocks a read does not touch are neither fetched nor needed."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from raytrainer.checkpoint import (
    BLOCK,
    FORMAT,
    MANIFEST,
    SHARDED_MODEL_DIR,
    CheckpointReader,
    DamagedCheckpointError,
    _load_sharded,
    _sha256,
    digest_files,
    model_weights,
)

SHARD = f"{SHARDED_MODEL_DIR}/__0_0.distcp"


def _sharded_checkpoint(folder) -> dict[str, torch.Tensor]:
    """A checkpoint holding a model as DCP shards, written in one process as raytrainer writes them, with
    its manifest."""
    from raytrainer.strategies.dcp import save_state

    g = torch.Generator().manual_seed(0)
    model = {"small": torch.arange(10, dtype=torch.float32), "big": torch.randn(5 * BLOCK // 8, generator=g),
             "step": torch.tensor(7.0), "other": torch.randn(BLOCK // 16, generator=g)}
    os.makedirs(folder, exist_ok=True)
    save_state({"model": model}, str(folder), SHARDED_MODEL_DIR, None)
    names = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)
    manifest = {"format": FORMAT, "global_step": 1, "files": digest_files(str(folder), names)}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f)
    return model


def _upload(bucket, folder, prefix: str) -> None:
    for d, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(d, name)
            key = f"{prefix}/{os.path.relpath(path, folder)}"
            with open(path, "rb") as f:
                bucket.server.client.put_object(Bucket=bucket.name, Key=key, Body=f.read())


def _bytes_of(bucket, key: str) -> int:
    return sum(r["bytes_out"] for r in bucket.server.requests(clear=True)
               if r["method"] == "GET" and (r["key"] or "").endswith(key))


def test_the_manifest_holds_each_block_s_hash_for_a_shard_and_none_for_small_files(tmp_path):
    _sharded_checkpoint(tmp_path)
    files = json.loads((tmp_path / MANIFEST).read_text())["files"]
    data = (tmp_path / SHARD).read_bytes()
    entry, block = files[SHARD], files[SHARD]["block_size"]
    assert block == 1 << 18 and len(data) > 40 * block  # a 10 MiB file: about 64 blocks of 256 KiB
    hashes = [hashlib.sha256(data[i:i + block]).hexdigest() for i in range(0, len(data), block)]
    assert entry["blocks"] == hashes
    assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert "blocks" not in files[f"{SHARDED_MODEL_DIR}/.metadata"]  # small: its sha256 is the check


def test_a_ranged_read_fetches_and_checks_only_the_blocks_it_touches(tmp_path, s3_bucket):
    model = _sharded_checkpoint(tmp_path / "ckpt")
    _upload(s3_bucket, tmp_path / "ckpt", "runs/checkpoint-1")
    uri = f"{s3_bucket.uri}/runs/checkpoint-1"

    # the whole model, read remotely: every block checked, the values exact
    s3_bucket.server.clear_requests()
    weights = model_weights(CheckpointReader(uri))
    assert all(torch.equal(weights[k], v) for k, v in model.items()) and sorted(weights) == sorted(model)
    size = (tmp_path / "ckpt" / SHARD).stat().st_size
    assert _bytes_of(s3_bucket, SHARD) == size  # each block once

    # the small entries were written last, together, after the large tensors, whatever the state's order
    import torch.distributed.checkpoint as dcp

    storage = dcp.FileSystemReader(str(tmp_path / "ckpt" / SHARDED_MODEL_DIR)).read_metadata().storage_data
    where = {index.fqn: (info.offset, info.length) for index, info in storage.items()}
    order = sorted(where, key=lambda k: where[k][0])
    assert order == ["model.big", "model.other", "model.small", "model.step"], order
    block = json.loads((tmp_path / "ckpt" / MANIFEST).read_text())["files"][SHARD]["block_size"]
    assert where["model.small"][0] // block == (size - 1) // block  # both in the last block

    # damage the big tensor's first block
    data = bytearray((tmp_path / "ckpt" / SHARD).read_bytes())
    data[where["model.big"][0] + 5] ^= 0xFF
    s3_bucket.server.client.put_object(Bucket=s3_bucket.name, Key=f"runs/checkpoint-1/{SHARD}",
                                       Body=bytes(data))

    # reading only the small entries: the last block fetched once and checked, the damaged one never read
    s3_bucket.server.clear_requests()
    only = {"small": torch.empty(10), "step": torch.tensor(0.0)}
    _load_sharded(CheckpointReader(uri), only)
    assert torch.equal(only["small"], model["small"]) and only["step"].item() == 7.0
    assert 0 < _bytes_of(s3_bucket, SHARD) <= block

    # reading the big tensor touches the damaged block: refused, naming the file
    with pytest.raises(DamagedCheckpointError, match=f"{SHARD} does not match its manifest checksum"):
        model_weights(CheckpointReader(uri))


def test_the_stream_hash_tops_up_short_reads_so_blocks_are_whole():
    import io

    class Trickle(io.BytesIO):  # a network stream returning less than asked
        def read(self, n=-1):
            return super().read(min(n, 999_983) if n and n > 0 else n)

    data = os.urandom(2 * BLOCK + 12345)
    blocks: list[str] = []
    sink = io.BytesIO()
    assert _sha256(Trickle(data), sink=sink, blocks=blocks) == hashlib.sha256(data).hexdigest()
    assert sink.getvalue() == data
    assert blocks == [hashlib.sha256(data[i:i + BLOCK]).hexdigest() for i in range(0, len(data), BLOCK)]
