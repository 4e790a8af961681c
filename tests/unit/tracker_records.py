"""Reading back what trackers wrote, with the trackers' own formats: W&B's offline record file.

wandb ships no reader for ``run-<id>.wandb`` (what ``wandb sync`` uploads): a LevelDB-format log of protobuf
``Record`` messages -- a 7-byte header (ident, magic, version 0), then 32 KiB blocks of chunks, each with a
7-byte header (CRC, length, type); a record too long for the rest of a block is split into FIRST,
MIDDLE... and LAST chunks.
"""

from __future__ import annotations

import json
import os
import struct
import time

_LOG_HEADER = b":W&B\xe1\xbe\x00"
_BLOCK = 32 * 1024
_CHUNK_HEADER = 7
_FULL, _FIRST, _LAST = 1, 2, 4


def _records(data: bytes) -> list[bytes]:
    records, parts, pos = [], None, len(_LOG_HEADER)
    while True:
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:  # too short for a chunk: zero padding up to the next block
            pos += left
            continue
        if pos + _CHUNK_HEADER > len(data):
            return records
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        chunk = data[pos + _CHUNK_HEADER:pos + _CHUNK_HEADER + length]
        if kind == 0 or len(chunk) < length:  # not written yet
            return records
        pos += _CHUNK_HEADER + length
        if kind == _FULL:
            records.append(chunk)
        elif kind == _FIRST:
            parts = [chunk]
        elif parts is not None:
            parts.append(chunk)
            if kind == _LAST:
                records.append(b"".join(parts))
                parts = None


def wandb_records(path: str, timeout: float = 30.0) -> list:
    """The ``Record`` messages of a finished offline run, once its exit record is on disk (wandb-core
    writes a run's last block when it closes the run's stream, just after ``wandb.finish()`` returns)."""
    from wandb.proto.wandb_internal_pb2 import Record

    deadline = time.monotonic() + timeout
    while True:
        with open(path, "rb") as f:
            data = f.read()
        assert data[:len(_LOG_HEADER)] == _LOG_HEADER
        records = [Record.FromString(r) for r in _records(data)]
        if any(r.HasField("exit") for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def wandb_history(records) -> list[dict]:
    """Each ``wandb.log`` call's values (keys as logged, values decoded from JSON)."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.HasField("history")]


def wandb_config(records) -> dict:
    config = {}
    for r in records:
        if r.HasField("config"):
            for item in r.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config


def offline_runs(wandb_dir) -> list[str]:
    root = os.path.join(wandb_dir, "wandb")
    return sorted(os.path.join(root, d) for d in os.listdir(root) if d.startswith("offline-run-"))
