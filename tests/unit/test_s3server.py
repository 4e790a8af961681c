"""The S3 test server (tests/s3server.py) through pyarrow: path-style requests, ranged reads, multipart
uploads, listings, and the attribution of every request to the client process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import psutil
import pyarrow.fs as pafs
import pytest
from s3server import S3Server


def _fs(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem from the URI alone: endpoint, credentials and region come from the environment."""
    return pafs.FileSystem.from_uri(uri)


def _write(fs: pafs.FileSystem, path: str, data: bytes, chunk: int | None = None) -> None:
    with fs.open_output_stream(path) as f:
        step = chunk or max(len(data), 1)
        for i in range(0, len(data), step):
            f.write(data[i : i + step])


def _uploads(requests: list[dict], bucket: str, key: str) -> list[dict]:
    """The requests that carried the object's bytes: PutObject or UploadPart."""
    return [r for r in requests if r["method"] == "PUT" and r["bucket"] == bucket and r["key"] == key]


def test_env_points_pyarrow_at_the_server(s3_bucket):
    assert os.environ["AWS_ENDPOINT_URL"] == s3_bucket.server.endpoint
    fs, path = _fs(f"{s3_bucket.uri}/dir/x.bin")
    assert isinstance(fs, pafs.S3FileSystem)
    assert path == f"{s3_bucket.name}/dir/x.bin"
    data = b"hello raytrainer " * 100
    _write(fs, path, data)
    with fs.open_input_stream(path) as f:
        assert f.read() == data

    # What the server saw: every request from this process, path-style (bucket and key parsed from the path).
    reqs = s3_bucket.server.requests()
    assert reqs, "pyarrow's requests did not reach the test server"
    assert {r["pid"] for r in reqs} == {os.getpid()}
    assert all(r["bucket"] == s3_bucket.name for r in reqs)
    assert all(r["status"] < 300 for r in reqs), reqs
    assert sum(r["bytes_in"] for r in _uploads(reqs, s3_bucket.name, "dir/x.bin")) == len(data)
    gets = [r for r in reqs if r["method"] == "GET" and r["key"] == "dir/x.bin"]
    assert sum(r["bytes_out"] for r in gets) == len(data)
    # ... and it holds the object.
    assert s3_bucket.list_objects() == {"dir/x.bin": len(data)}
    assert s3_bucket.get_object("dir/x.bin") == data


def test_ranged_read(s3_bucket):
    fs, path = _fs(f"{s3_bucket.uri}/r.bin")
    data = bytes(range(256)) * 40
    _write(fs, path, data)
    s3_bucket.server.clear_requests()

    with fs.open_input_file(path) as f:
        assert f.read_at(100, 250) == data[250:350]

    reqs = s3_bucket.server.requests()
    ranged = [r for r in reqs if r["method"] == "GET"]
    assert len(ranged) == 1, reqs
    assert ranged[0]["status"] == 206
    assert ranged[0]["range"] == "bytes=250-349"
    assert ranged[0]["bytes_out"] == 100
    assert ranged[0]["pid"] == os.getpid()
    # Opening the file asks for its size first (HEAD): no body either way.
    heads = [r for r in reqs if r["method"] == "HEAD"]
    assert heads and all(r["bytes_out"] == 0 for r in heads)


def test_multipart_upload(s3_bucket):
    fs, path = _fs(f"{s3_bucket.uri}/big/model.bin")
    data = os.urandom(6 * 1024 * 1024 + 12345)  # above the 5 MiB part minimum
    _write(fs, path, data, chunk=1024 * 1024)

    reqs = s3_bucket.server.requests()
    assert {r["pid"] for r in reqs} == {os.getpid()}
    key = "big/model.bin"
    create = [r for r in reqs if r["method"] == "POST" and r["key"] == key and r["query"] == "uploads"]
    parts = _uploads(reqs, s3_bucket.name, key)
    complete = [r for r in reqs if r["method"] == "POST" and r["key"] == key and "uploadId=" in r["query"]]
    assert len(create) == 1 and len(complete) == 1, reqs
    assert parts and all("partNumber=" in r["query"] for r in parts)
    assert sum(r["bytes_in"] for r in parts) == len(data)
    assert all(r["status"] == 200 for r in [*create, *parts, *complete])

    assert s3_bucket.list_objects("big/") == {key: len(data)}
    assert s3_bucket.get_object(key) == data


def test_list_prefix(s3_bucket):
    fs, _ = _fs(s3_bucket.uri)
    for key, size in {"run/a.bin": 3, "run/sub/b.bin": 5, "other/c.bin": 7}.items():
        _write(fs, f"{s3_bucket.name}/{key}", b"x" * size)
    s3_bucket.server.clear_requests()

    infos = fs.get_file_info(pafs.FileSelector(f"{s3_bucket.name}/run", recursive=True))
    files = {i.path: i.size for i in infos if i.type == pafs.FileType.File}
    assert files == {f"{s3_bucket.name}/run/a.bin": 3, f"{s3_bucket.name}/run/sub/b.bin": 5}

    reqs = s3_bucket.server.requests()
    lists = [r for r in reqs if r["method"] == "GET" and "list-type=2" in r["query"]]
    assert lists and all("prefix=run%2F" in r["query"] for r in lists), reqs
    assert all(r["pid"] == os.getpid() and r["key"] is None for r in lists)
    assert s3_bucket.list_objects("run/") == {"run/a.bin": 3, "run/sub/b.bin": 5}
    assert s3_bucket.list_objects() == {"run/a.bin": 3, "run/sub/b.bin": 5, "other/c.bin": 7}


def test_request_from_child_process_is_attributed_to_the_child(s3_bucket):
    code = textwrap.dedent(
        f"""
        import os
        import pyarrow.fs as pafs
        fs, path = pafs.FileSystem.from_uri("{s3_bucket.uri}/child/out.bin")
        with fs.open_output_stream(path) as f:
            f.write(b"from the child" * 10)
        print(os.getpid())
        """
    )
    # The child inherits the fixture's environment (AWS_ENDPOINT_URL and the credentials).
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    child_pid = int(proc.stdout.strip().splitlines()[-1])
    assert child_pid != os.getpid()

    reqs = [r for r in s3_bucket.server.requests() if r["key"] == "child/out.bin"]
    assert reqs
    assert {r["pid"] for r in reqs} == {child_pid}
    assert sum(r["bytes_in"] for r in _uploads(reqs, s3_bucket.name, "child/out.bin")) == 140
    assert s3_bucket.get_object("child/out.bin") == b"from the child" * 10


def test_helper_requests_are_marked_and_clearing(s3_bucket):
    server = s3_bucket.server
    assert server.requests() == []  # the fixture cleared the bucket's creation
    server.list_objects(s3_bucket.name)
    assert server.requests() == []
    helper = server.requests(include_helper=True)
    assert len(helper) == 1
    assert helper[0]["helper"] and helper[0]["pid"] == os.getpid() and helper[0]["method"] == "GET"

    fs, path = _fs(f"{s3_bucket.uri}/missing.bin")
    assert fs.get_file_info(path).type == pafs.FileType.NotFound
    reqs = server.requests(clear=True)
    assert any(r["method"] == "HEAD" and r["status"] == 404 for r in reqs)
    assert server.requests(include_helper=True) == []


def test_session_server_leaves_environ_alone(s3_server):
    env = s3_server.env
    assert env["AWS_ENDPOINT_URL"] == s3_server.endpoint
    assert s3_server.endpoint.startswith("http://127.0.0.1:")
    assert env["AWS_EC2_METADATA_DISABLED"] == "true"
    assert env["AWS_REGION"] == env["AWS_DEFAULT_REGION"] == "us-east-1"
    # Only s3_bucket sets these, and only for its test.
    assert os.environ.get("AWS_ENDPOINT_URL") != s3_server.endpoint
    assert os.environ.get("AWS_ACCESS_KEY_ID") != env["AWS_ACCESS_KEY_ID"]


def test_stop_terminates_exactly_the_server_process():
    server = S3Server(access_key="other-key", secret_key="other-secret")
    with server:
        pid = server.pid
        assert server.running
        proc = psutil.Process(pid)
        assert "s3server.py" in " ".join(proc.cmdline())
        assert proc.ppid() == os.getpid()
        server.create_bucket("stop-test")
        assert server.list_objects("stop-test") == {}
    assert not server.running
    with pytest.raises(psutil.NoSuchProcess):
        psutil.Process(pid).cmdline()


def test_start_failure_reports_the_server_output(tmp_path, monkeypatch):
    broken = tmp_path / "moto"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('moto is broken here: rt-marker')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the server subprocess imports this "moto"
    server = S3Server()
    with pytest.raises(RuntimeError, match="rt-marker"):
        server.start()
    assert not server.running
