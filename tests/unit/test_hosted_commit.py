"""A hosted trainer's checkpoint commit without Ray: which rank hashes and copies which file, and the driver's
commit once every part has come (worker/hosted_commit.py, driver/registry.py)."""

from __future__ import annotations

import json
import os

from raytrainer.checkpoint import committed_checkpoints, digest_files
from raytrainer.driver.registry import CheckpointRegistry
from raytrainer.protocol import CheckpointPart
from raytrainer.worker.hosted_commit import assign


def test_each_file_goes_to_the_first_rank_that_lists_it():
    # ranks 0 and 1 on node 0 (rank 1 does not list), ranks 2 and 3 on node 1 with its own disk
    listings = [["model.safetensors", "rng_state_0.pth", "rng_state_1.pth"], None,
                ["rng_state_2.pth", "rng_state_3.pth"], None]
    assert assign(listings) == [["model.safetensors", "rng_state_0.pth", "rng_state_1.pth"], [],
                                ["rng_state_2.pth", "rng_state_3.pth"], []]
    # a shared file system: node 1 sees node 0's files too; rank 0 takes them all, once
    shared = [["a", "b"], None, ["a", "b"], None]
    assert assign(shared) == [["a", "b"], [], [], []]


class _Args:
    save_total_limit = 1
    storage_filesystem = None
    load_best_model_at_end = False

    def __init__(self, root):
        self.output_dir = self.storage_path = str(root)


def _save(root, name: str, files: dict[str, bytes]) -> dict:
    os.makedirs(root / name, exist_ok=True)
    for rel, data in files.items():
        (root / name / rel).write_bytes(data)
    return digest_files(str(root / name), sorted(files))


def test_the_driver_commits_when_the_last_part_has_come_and_rotates(tmp_path):
    registry = CheckpointRegistry(_Args(tmp_path))
    committed = []
    registry.listeners.append(committed.append)
    for step in (2, 4, 6):
        name = f"checkpoint-{step}"
        zero = _save(tmp_path, name, {"model.safetensors": b"w" * step, "trainer_state.json": b"{}"})
        two = _save(tmp_path, name, {"rng_state_2.pth": b"r"})
        registry.add_part(CheckpointPart(name, step, str(tmp_path / name), zero, parts=2,
                                         best_model_checkpoint="checkpoint-2", best_metric=0.5))
        assert not (tmp_path / name / "manifest.json").exists()  # one part of two: not committed yet
        registry.add_part(CheckpointPart(name, step, str(tmp_path / name), two, parts=2))
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        assert sorted(manifest["files"]) == ["model.safetensors", "rng_state_2.pth", "trainer_state.json"]
        assert manifest["global_step"] == step
    assert [c.name for c in committed] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert committed[-1].best_model_checkpoint == str(tmp_path / "checkpoint-2")
    assert committed[-1].best_metric == 0.5
    # save_total_limit=1 keeps the newest and the best: the driver deleted checkpoint-4
    assert [os.path.basename(p) for _, p in committed_checkpoints(registry.storage)] == [
        "checkpoint-2", "checkpoint-6"]
    assert not (tmp_path / "checkpoint-4").exists()


class _DelayedDriver:
    """The channel to a driver whose registry commits 0.5 s after a part arrives (a busy driver)."""

    def __init__(self, registry):
        self.registry, self.sent = registry, []

    def send(self, kind, part, urgent=False):
        import threading

        self.sent.append(part.name)
        threading.Timer(0.5, self.registry.add_part, (part,)).start()


def test_commit_returns_once_the_drivers_manifest_is_written(tmp_path):
    """What a preemption's hold waits for before it says "committed": this rank's part sent and, on rank 0,
    the driver's manifest in storage (the part is hashed on a thread; the driver writes the manifest
    later)."""
    import time

    from transformers import TrainerControl, TrainerState

    from raytrainer.rank_context import RankContext
    from raytrainer.worker.hosted_commit import CommitCallback

    args = _Args(tmp_path)
    channel = _DelayedDriver(CheckpointRegistry(args))
    callback = CommitCallback(RankContext(), channel, args)
    _save(tmp_path, "checkpoint-3", {"model.safetensors": b"w" * 64, "trainer_state.json": b"{}"})
    state = TrainerState()
    state.global_step = 3
    callback.on_save(args, state, TrainerControl())
    started = time.monotonic()
    callback.commit()
    assert (tmp_path / "checkpoint-3" / "manifest.json").exists()
    assert time.monotonic() - started >= 0.4  # it waited for the driver
    assert channel.sent == ["checkpoint-3"]
    callback.commit()  # nothing saved since: returns at once
