"""Fixtures shared by tests/unit and tests/integration: a real S3-compatible server (moto, in a subprocess).

- ``s3_server`` (session): a started ``tests/s3server.py`` ``S3Server``, stopped at the end of the session.
  It does not touch ``os.environ``; its ``env`` says how to reach it.
- ``s3_bucket`` (function): a fresh bucket on that server, with the server's ``env`` (AWS_ENDPOINT_URL,
  fake credentials, region) set in ``os.environ`` for the test only, so ``s3://<bucket>/...`` URIs
  resolve to it through pyarrow's ``FileSystem.from_uri`` (and any process started from the test
  inherits it). The server's request log is cleared once the bucket exists, so
  ``s3_bucket.server.requests()`` holds the test's own requests.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import uuid
from dataclasses import dataclass

import pytest

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:  # tests/s3server.py, importable from every test directory
    sys.path.insert(0, _TESTS_DIR)

from s3server import S3Server  # noqa: E402


@dataclass(frozen=True)
class S3Bucket:
    name: str
    server: S3Server

    @property
    def uri(self) -> str:
        return f"s3://{self.name}"

    def list_objects(self, prefix: str = "") -> dict[str, int]:
        return self.server.list_objects(self.name, prefix)

    def get_object(self, key: str) -> bytes:
        return self.server.get_object(self.name, key)

    def committed(self, prefix: str) -> dict[str, dict]:
        """Checkpoint name -> manifest of every committed checkpoint under ``prefix``, each checked against
        the bucket's objects: the same names and sizes, and each object's sha256 the manifest's."""
        objects = self.list_objects(prefix.rstrip("/") + "/")
        out = {}
        for key in sorted(k for k in objects if k.endswith("/manifest.json")):
            folder = key[: -len("/manifest.json")]
            manifest = json.loads(self.get_object(key))
            files = {k[len(folder) + 1:]: size for k, size in objects.items()
                     if k.startswith(folder + "/") and not k.endswith("/") and k != key}
            assert {n: m["size"] for n, m in manifest["files"].items()} == files, folder
            for name, meta in manifest["files"].items():
                assert hashlib.sha256(self.get_object(f"{folder}/{name}")).hexdigest() == meta["sha256"], name
            out[folder.rsplit("/", 1)[1]] = manifest
        return out


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch):
    name = "rt-" + uuid.uuid4().hex[:8]
    s3_server.create_bucket(name)
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    # Other endpoint settings in the environment would beat AWS_ENDPOINT_URL for S3.
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    s3_server.clear_requests()
    yield S3Bucket(name, s3_server)
