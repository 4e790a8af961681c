"""An S3-compatible server for the tests (moto's S3 in a subprocess) that records who made which request.

``S3Server`` starts ``python tests/s3server.py serve ...`` on 127.0.0.1 on a free port. The server is
moto's own S3 in server mode behind a small WSGI middleware that appends one JSON line per request to a
log file: the client's process id (found from the TCP connection with psutil), the method, bucket, key,
query string, status, and the request and response body sizes. ``S3Server.requests()`` reads them back,
so a test can assert *which process* uploaded or downloaded what (the driver, a worker, rank 0, ...).

Usage::

    with S3Server() as server:
        server.create_bucket("ckpt")
        # Point pyarrow (and any AWS SDK) at it through the environment:
        os.environ.update(server.env)
        fs, path = pyarrow.fs.FileSystem.from_uri("s3://ckpt/run/file.bin")
        ...
        [r for r in server.requests() if r["method"] == "PUT"]

The helpers (``create_bucket``, ``list_objects``, ``get_object``) talk to the server with boto3 (installed
with moto) and mark their requests, so ``requests()`` leaves them out unless asked for them.

Server side, stand-alone::

    python tests/s3server.py serve --port 0 --port-file PORT_FILE --log REQUESTS.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from typing import Any

# The helpers' requests carry this in their User-Agent; the server logs them with "helper": true.
HELPER_AGENT = "rt-s3server-helper"
# Answered by the middleware itself (not moto, not logged): the parent's readiness probe.
PING_PATH = "/_rt_s3server/ping"

START_TIMEOUT_S = 20.0


# --------------------------------------------------------------------------------------------------
# Client side (the test process)
# --------------------------------------------------------------------------------------------------


class S3Server:
    """moto's S3 server in a subprocess on 127.0.0.1, with a per-request log.

    ``S3Server(access_key=..., secret_key=..., region=...)``; ``start()`` / ``stop()`` or use it as a
    context manager. Nothing here touches ``os.environ``: apply ``env`` where the clients need it.
    """

    def __init__(
        self,
        access_key: str = "rtkey-test",
        secret_key: str = "rtsecret-test-9f3a",
        region: str = "us-east-1",
        start_timeout: float = START_TIMEOUT_S,
    ):
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self.start_timeout = start_timeout
        self.port: int | None = None
        self.pid: int | None = None
        self.start_seconds: float | None = None
        self._proc: subprocess.Popen | None = None
        self._dir: str | None = None
        self._log_offset = 0
        self._boto_client = None
        self._finalizer: weakref.finalize | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> S3Server:
        if self._proc is not None:
            raise RuntimeError("S3Server already started")
        t0 = time.monotonic()
        self._dir = tempfile.mkdtemp(prefix="rt-s3server-")
        port_file = os.path.join(self._dir, "port")
        stderr_path = os.path.join(self._dir, "stderr.log")
        open(self.log_path, "w").close()
        self._log_offset = 0
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "serve",
            "--port",
            "0",
            "--port-file",
            port_file,
            "--log",
            self.log_path,
            "--parent-pid",
            str(os.getpid()),
        ]
        # The server's own environment: no endpoint overrides or credentials leak in, no proxies.
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and "proxy" not in k.lower()}
        env["PYTHONUNBUFFERED"] = "1"
        with open(stderr_path, "wb") as stderr:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr, env=env, close_fds=True
            )
        self.pid = self._proc.pid
        # Stop the subprocess even if the caller forgets to (at interpreter exit or garbage collection).
        self._finalizer = weakref.finalize(self, _stop_process, self._proc, self._dir)
        try:
            self._wait_until_up(port_file, t0)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def _wait_until_up(self, port_file: str, t0: float) -> None:
        assert self._proc is not None
        deadline = t0 + self.start_timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"the S3 test server exited with code {self._proc.returncode} before it answered:\n"
                    f"{self._stderr_text()}"
                )
            if self.port is None:
                with contextlib.suppress(OSError, ValueError):
                    with open(port_file) as f:
                        text = f.read()
                    if text.endswith("\n"):
                        self.port = int(text)
            if self.port is not None:
                try:
                    with urllib.request.urlopen(self.endpoint + PING_PATH, timeout=2) as resp:
                        if resp.status == 200:
                            return
                except (OSError, urllib.error.URLError) as e:
                    last_error = e
            time.sleep(0.05)
        raise RuntimeError(
            f"the S3 test server (pid {self._proc.pid}) did not answer within {self.start_timeout:.0f} s"
            f" (last error: {last_error!r}); its output:\n{self._stderr_text()}"
        )

    def _stderr_text(self) -> str:
        if self._dir is None:
            return ""
        try:
            with open(os.path.join(self._dir, "stderr.log"), errors="replace") as f:
                return f.read()[-8000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Terminate the server subprocess (by its pid: terminate, wait, kill) and remove its files."""
        self._boto_client = None
        if self._finalizer is not None:
            self._finalizer()  # runs _stop_process once
            self._finalizer = None
        elif self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._proc = None
        self._dir = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- connection details ------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        if self.port is None:
            raise RuntimeError("S3Server is not started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The environment that points pyarrow / boto3 / the AWS CLI at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    @property
    def log_path(self) -> str:
        if self._dir is None:
            raise RuntimeError("S3Server is not started")
        return os.path.join(self._dir, "requests.jsonl")

    # -- request log -------------------------------------------------------------------------------

    def requests(self, clear: bool = False, include_helper: bool = False) -> list[dict[str, Any]]:
        """Every request the server handled since the last clear, oldest first.

        Each is ``{"pid", "method", "bucket", "key", "query", "status", "bytes_in", "bytes_out"}`` (plus
        ``"helper"`` and ``"time"``): ``pid`` is the client's process id (None if it could not be found),
        ``bucket``/``key`` are None where the request has none (path-style URLs), ``bytes_in`` is the
        request body's payload length and ``bytes_out`` the response body's length. A request's line is
        written before its response is sent, so a request the caller has seen complete is always here.
        The helpers' own requests (``create_bucket`` ...) are left out unless ``include_helper``.
        """
        with open(self.log_path, "rb") as f:
            f.seek(self._log_offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # only whole lines: a line being written is read next time
        records = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        if clear:
            self._log_offset += end
        if not include_helper:
            records = [r for r in records if not r.get("helper")]
        return records

    def clear_requests(self) -> None:
        self.requests(clear=True)

    # -- helpers (boto3, marked as helper requests) ------------------------------------------------

    @property
    def client(self):
        """A boto3 S3 client for this server (path-style, its requests marked as helper requests)."""
        if self._boto_client is None:
            import boto3
            from botocore.config import Config

            self._boto_client = boto3.client(
                "s3",
                endpoint_url=self.endpoint,
                aws_access_key_id=self.access_key,
                aws_secret_access_key=self.secret_key,
                region_name=self.region,
                config=Config(
                    user_agent_extra=HELPER_AGENT,
                    s3={"addressing_style": "path"},
                    retries={"max_attempts": 2},
                ),
            )
        return self._boto_client

    def create_bucket(self, name: str) -> None:
        self.client.create_bucket(Bucket=name)

    def list_objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """``{key: size}`` of every object in ``bucket`` whose key starts with ``prefix``."""
        out: dict[str, int] = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                out[obj["Key"]] = obj["Size"]
        return out

    def get_object(self, bucket: str, key: str) -> bytes:
        return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()


def _stop_process(proc: subprocess.Popen, directory: str | None) -> None:
    """Terminate exactly ``proc`` (never anything found by name), then kill it if it lingers."""
    try:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    finally:
        if directory:
            shutil.rmtree(directory, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Server side (the subprocess)
# --------------------------------------------------------------------------------------------------


class _PidFinder:
    """The pid of the local process on the other end of a client's TCP connection to the server."""

    def __init__(self, server_port: int):
        self.server_port = server_port
        self._by_socket: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def pid_for(self, environ: dict) -> int | None:
        sock = environ.get("werkzeug.socket")
        # Clients keep connections alive: look a connection up once. Keyed on the connection's socket
        # (not only the client's (ip, port)) so that a port reused by another process is looked up again.
        if sock is not None:
            with self._lock:
                if sock in self._by_socket:
                    return self._by_socket[sock]
        pid = self._lookup(environ.get("REMOTE_ADDR"), int(environ.get("REMOTE_PORT") or 0))
        if sock is not None:
            with self._lock:
                self._by_socket[sock] = pid
        return pid

    def _lookup(self, ip: str | None, port: int) -> int | None:
        import psutil

        for attempt in range(3):
            try:
                conns = psutil.net_connections(kind="tcp")
            except (psutil.Error, OSError):
                return None
            for c in conns:
                if not c.laddr or not c.raddr or c.pid is None:
                    continue
                if c.laddr.port == port and c.raddr.port == self.server_port and _same_ip(c.laddr.ip, ip):
                    return c.pid
            time.sleep(0.01 * (attempt + 1))  # a process's fd table can be caught mid-update
        return None


def _same_ip(a: str, b: str | None) -> bool:
    if b is None:
        return False
    return a.removeprefix("::ffff:") == b.removeprefix("::ffff:")


class _CountingInput:
    """Wraps ``wsgi.input`` to count the request body bytes the application reads."""

    def __init__(self, stream):
        self._stream = stream
        self.count = 0

    def read(self, *args):
        data = self._stream.read(*args)
        self.count += len(data)
        return data

    def readline(self, *args):
        data = self._stream.readline(*args)
        self.count += len(data)
        return data

    def readlines(self, *args):
        lines = self._stream.readlines(*args)
        self.count += sum(len(x) for x in lines)
        return lines

    def __iter__(self):
        for line in self._stream:
            self.count += len(line)
            yield line

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _bucket_and_key(path: str) -> tuple[str | None, str | None]:
    """Path-style ``/bucket/key...`` -> (bucket, key); None where absent."""
    path = path.encode("latin-1", "replace").decode("utf-8", "replace").lstrip("/")  # WSGI's latin-1 str
    if not path:
        return None, None
    bucket, _, key = path.partition("/")
    return bucket, (key or None)


class RequestLogMiddleware:
    """WSGI middleware: one JSON line per request, appended to ``log_path`` and flushed.

    The response body is gathered first (moto builds it in memory anyway), so the line is written with
    the final ``bytes_out`` *before* the client gets the response: whoever saw a request complete finds
    it in the log.
    """

    def __init__(self, app, log_path: str, server_port: int):
        self.app = app
        self.pids = _PidFinder(server_port)
        self._log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 (open for the server's life)
        self._lock = threading.Lock()

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == PING_PATH:
            start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
            return [b"ok"]

        t0 = time.time()
        pid = self.pids.pid_for(environ)
        counting = _CountingInput(environ["wsgi.input"])
        environ["wsgi.input"] = counting
        status_holder: list[str] = []

        def _start_response(status, headers, exc_info=None):
            status_holder[:] = [status]
            return start_response(status, headers, exc_info)

        body_iter = self.app(environ, _start_response)
        try:
            chunks = [bytes(c) for c in body_iter]
        finally:
            close = getattr(body_iter, "close", None)
            if close is not None:
                close()

        bucket, key = _bucket_and_key(path)
        decoded = environ.get("HTTP_X_AMZ_DECODED_CONTENT_LENGTH")
        try:
            content_length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            content_length = 0
        if decoded is not None and decoded.isdigit():
            bytes_in = int(decoded)  # aws-chunked uploads: the payload, not the chunk framing
        else:
            bytes_in = max(counting.count, content_length)
        record = {
            "pid": pid,
            "method": environ.get("REQUEST_METHOD"),
            "bucket": bucket,
            "key": key,
            "query": environ.get("QUERY_STRING", ""),
            "status": int(status_holder[0].split()[0]) if status_holder else None,
            "bytes_in": bytes_in,
            "bytes_out": sum(len(c) for c in chunks),
            "range": environ.get("HTTP_RANGE"),
            "helper": HELPER_AGENT in environ.get("HTTP_USER_AGENT", ""),
            "time": t0,
        }
        line = json.dumps(record) + "\n"
        with self._lock:
            self._log.write(line)
            self._log.flush()
        return chunks


def _make_moto_app():
    """moto 5's server-mode WSGI app (what ``moto_server`` runs), with the S3 backend built up front."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

    app = DomainDispatcherApplication(create_backend_app)
    # Build the S3 Flask app now rather than on the first request (which would then take a second).
    warm = {
        "PATH_INFO": "/",
        "HTTP_HOST": "127.0.0.1",
        "HTTP_AUTHORIZATION": "AWS4-HMAC-SHA256 Credential=x/20240101/us-east-1/s3/aws4_request, "
        "SignedHeaders=host, Signature=0",
    }
    app.get_application(warm)
    return app


def _watch_parent(parent_pid: int, log_path: str) -> None:
    """Exit when the test process that started us is gone (e.g. killed before it could stop us)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            directory = os.path.dirname(os.path.abspath(log_path))
            if os.path.basename(directory).startswith("rt-s3server-"):  # S3Server's own temporary folder
                shutil.rmtree(directory, ignore_errors=True)
            os._exit(0)


def serve(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="s3server.py serve")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (see --port-file)")
    parser.add_argument("--port-file", help="write the bound port here (a line), once it listens")
    parser.add_argument("--log", required=True, help="append one JSON line per request here")
    parser.add_argument("--parent-pid", type=int, help="exit when this process is no longer our parent")
    args = parser.parse_args(argv)

    import logging

    from moto.moto_server.werkzeug_app import MotoRequestHandler
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request on stderr

    moto_app = _make_moto_app()
    # make_server is what werkzeug's run_simple(..., threaded=True) uses; calling it directly lets us
    # bind port 0 and report the port the kernel chose (no race on a port picked beforehand).
    holder: dict[str, Any] = {}

    def app(environ, start_response):
        return holder["app"](environ, start_response)

    server = make_server(args.host, args.port, app, threaded=True, request_handler=MotoRequestHandler)
    port = server.server_address[1]
    holder["app"] = RequestLogMiddleware(moto_app, args.log, port)

    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid, args.log), daemon=True).start()
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, args.port_file)
    print(f"s3server: moto S3 on http://{args.host}:{port} (pid {os.getpid()})", file=sys.stderr, flush=True)
    server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        sys.exit("usage: python tests/s3server.py serve --log FILE [--port P] [--port-file F]")
    serve(argv[1:])


if __name__ == "__main__":
    main()
