"""The driver's storage check: can this process write ``storage_path`` (or ``hub_model_id``)? Answered
within seconds, with a message that names the URI, what is wrong and the fix.

pyarrow's S3 client retries a failing request with backoff (about 6-12 s for an unreachable endpoint) and
GCS's retries for minutes; the check runs on a copy of the filesystem with one attempt and short timeouts,
so a wrong endpoint is reported in well under 5 s. Training itself keeps the user's retry settings.
"""

from __future__ import annotations

import datetime
import os
import uuid

import pyarrow.fs as pafs

CONNECT_TIMEOUT_S = 2.0
REQUEST_TIMEOUT_S = 3.0


def probe_filesystem(fs: pafs.FileSystem) -> pafs.FileSystem:
    """``fs`` with the same options (endpoint, credentials, region) but no retries and short timeouts."""
    if isinstance(fs, pafs.S3FileSystem):
        options = {k: v for k, v in fs.__reduce__()[1][0].items() if v is not None}
        options.update(retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
                       connect_timeout=CONNECT_TIMEOUT_S, request_timeout=REQUEST_TIMEOUT_S)
        return pafs.S3FileSystem(**options)
    if isinstance(fs, pafs.GcsFileSystem):
        options = {k: v for k, v in fs.__reduce__()[1][0].items() if v is not None}
        options["retry_time_limit"] = datetime.timedelta(seconds=REQUEST_TIMEOUT_S)
        return pafs.GcsFileSystem(**options)
    return fs


def _endpoint(fs: pafs.FileSystem) -> str:
    if isinstance(fs, (pafs.S3FileSystem, pafs.GcsFileSystem)):
        endpoint = fs.__reduce__()[1][0].get("endpoint_override") or ""
        if endpoint:
            return endpoint
    return os.environ.get("AWS_ENDPOINT_URL", "") if isinstance(fs, pafs.S3FileSystem) else ""


def diagnose(uri: str, fs: pafs.FileSystem, root: str, exc: BaseException, what: str) -> str:
    """A message for a failed storage access: which URI, the likely cause, and what to change."""
    text = str(exc)
    detail = f"({type(exc).__name__}: {text.splitlines()[0] if text else ''})"
    head = f"{what} {uri!r} cannot be written {detail}."
    bucket = root.split("/", 1)[0]
    upper = text.upper()
    if "NETWORK_CONNECTION" in upper or "CURLCODE" in upper or "COULD NOT CONNECT" in upper \
            or "TIMED OUT" in upper or "TIMEOUT" in upper or "COULDN'T RESOLVE" in upper:
        endpoint = _endpoint(fs) or "the default endpoint of the store"
        return (f"{head} The storage endpoint {endpoint} did not answer. Check the address and that the "
                "server runs and is reachable from the driver and every Ray node: AWS_ENDPOINT_URL "
                "(or ?endpoint_override=host:port&scheme=http in the URI) for S3-compatible stores.")
    if "NO_SUCH_BUCKET" in upper or "NOSUCHBUCKET" in upper or ("BUCKET" in upper and "NOT FOUND" in upper) \
            or "SPECIFIED BUCKET DOES NOT EXIST" in upper:
        return (f"{head} The bucket {bucket!r} does not exist. Create it (e.g. `aws s3 mb s3://{bucket}`) "
                "or fix the bucket name.")
    if any(code in upper for code in ("INVALID_ACCESS_KEY_ID", "INVALIDACCESSKEYID",
                                      "SIGNATURE_DOES_NOT_MATCH", "SIGNATUREDOESNOTMATCH",
                                      "INVALIDTOKEN", "EXPIREDTOKEN", "UNAUTHENTICATED",
                                      "NO CREDENTIALS", "MISSING CREDENTIALS")):
        return (f"{head} The store rejected the credentials. Set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                "(or AWS_PROFILE, an instance role; GOOGLE_APPLICATION_CREDENTIALS for GCS) on the driver "
                "and every Ray node, or pass a configured storage_filesystem.")
    if "ACCESS_DENIED" in upper or "ACCESSDENIED" in upper or "FORBIDDEN" in upper or "403" in upper \
            or "PERMISSION" in upper or "READ-ONLY" in upper:
        return (f"{head} Access is denied: these credentials may not write under {uri!r}. Grant write "
                "access to this prefix (s3:PutObject, s3:DeleteObject, s3:ListBucket; or the storage "
                "admin role on GCS), or choose a storage_path you may write.")
    return (f"{head} Give a folder or URI (s3://, gs://, ...) that this process and every worker can "
            "write.")


def check_writable(storage, what: str = "storage_path") -> None:
    """Write, read back and delete a marker file under ``storage.root``."""
    fs = probe_filesystem(storage.fs)
    marker = f"{storage.root.rstrip('/')}/.raytrainer-write-check-{uuid.uuid4().hex[:8]}"
    try:
        if isinstance(fs, pafs.LocalFileSystem):
            fs.create_dir(storage.root, recursive=True)
        # A write first: an object store's answer to it names the cause (a HEAD's answer has no body)
        with fs.open_output_stream(marker) as f:
            f.write(b"ok")
        with fs.open_input_stream(marker) as f:
            f.read()
        fs.delete_file(marker)
    except Exception as exc:
        raise ValueError(diagnose(storage.uri, storage.fs, storage.root, exc, what)) from exc
