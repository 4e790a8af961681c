"""gs:// through the same code as s3://: checkpoints, bitwise resume from a gs:// path and the storage check
against a GCS JSON-API server (gcp-storage-emulator from PyPI, a subprocess on 127.0.0.1 stopped by its PID),
with the filesystem given the way Ray Train takes one: ``storage_filesystem=pyarrow.fs.GcsFileSystem(...)``
(an emulator needs anonymous access and an endpoint, which a gs:// URI cannot carry).

Not covered here: rotation and ``resume_from_checkpoint=True``, which list the run folder's checkpoint
folders with a delimiter listing; the emulator answers those without the ``prefixes`` real GCS returns
(so it lists no folders). The S3 tests cover both."""

from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys
import time

import pyarrow.fs as pafs
import pytest
from test_s3_storage import Net, args, assert_same_weights, data

from raytrainer import Trainer


@pytest.fixture(scope="module")
def gcs():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
                             "--port", str(port), "--in-memory"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("gcp-storage-emulator did not start") from None
                time.sleep(0.1)
        fs = pafs.GcsFileSystem(anonymous=True, endpoint_override=f"127.0.0.1:{port}", scheme="http",
                                project_id="raytrainer-test", retry_time_limit=datetime.timedelta(seconds=5))
        fs.create_dir("rt-gcs")  # the bucket
        yield fs
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_checkpoints_and_resume_in_gcs(tmp_path, gcs):
    uri = "gs://rt-gcs/runs/x"
    first = Trainer(model=Net(), args=args(tmp_path / "a", storage_path=uri, storage_filesystem=gcs,
                                           max_steps=8), train_dataset=data())
    first.train()
    listed = gcs.get_file_info(pafs.FileSelector("rt-gcs/runs/x/checkpoint-8", recursive=True))
    sizes = {i.path.rsplit("/", 1)[1]: i.size for i in listed if i.type == pafs.FileType.File}
    with gcs.open_input_stream("rt-gcs/runs/x/checkpoint-8/manifest.json") as f:
        manifest = json.loads(f.read())
    assert {n: m["size"] for n, m in manifest["files"].items()} == {
        n: size for n, size in sizes.items() if n != "manifest.json"}
    assert first.state.best_model_checkpoint is None and manifest["global_step"] == 8

    resumed = Trainer(model=Net(), args=args(tmp_path / "b", storage_path="gs://rt-gcs/runs/y",
                                             storage_filesystem=gcs, max_steps=12), train_dataset=data())
    assert resumed.train(resume_from_checkpoint=f"{uri}/checkpoint-8").global_step == 12
    straight = Trainer(model=Net(), args=args(tmp_path / "c", max_steps=12), train_dataset=data())
    straight.train()
    assert_same_weights(straight.model, resumed.model)


def test_a_missing_gcs_bucket_is_named(tmp_path, gcs):
    trainer = Trainer(model=Net(), args=args(tmp_path, storage_path="gs://rt-gcs-missing/run",
                                             storage_filesystem=gcs), train_dataset=data())
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"storage_path 'gs://rt-gcs-missing/run' cannot be written"):
        trainer.train()
    assert time.monotonic() - started < 5
