"""Checkpoint storage on any pyarrow filesystem: a local path, a shared mount, file://, s3://, gs://, hdfs://.

Every checkpoint read, write, listing and deletion goes through ``pyarrow.fs``, so the same code serves a
laptop folder and a bucket. ``Storage`` is a (filesystem, root path) pair for one run directory.

Where the filesystem comes from, in the order pyarrow and Ray Train use:

- a ``storage_filesystem`` object (``TrainingArguments.storage_filesystem``, as Ray Train's
  ``RunConfig(storage_filesystem=...)``), used for URIs of its own kind (``s3://`` for an ``S3FileSystem``);
- the URI itself, with pyarrow's options in its query string (``s3://bucket/run?endpoint_override=host:9000
  &scheme=http``); the query is kept intact on every URI built from it (``uri_of`` joins on the path part);
- the environment: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
  ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, instance roles; ``GOOGLE_APPLICATION_CREDENTIALS`` for GCS.

Credentials never travel in a URI (pyarrow refuses ``secret_key`` in one), so the URIs that raytrainer
writes into ``trainer_state.json``, logs and summaries hold none.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import pyarrow as pa
import pyarrow.fs as pafs

#: raytrainer's and Ray Train's own state under a run's storage root (docs/checkpoints.md, "What else is in
#: output_dir"): Ray Train's run folder (``ray/``), the final weights the driver loads (``final-model/``).
#: One hidden folder, so that the root holds what transformers' holds -- ``checkpoint-<step>`` folders and
#: the saved model -- and nothing that ``get_last_checkpoint`` or a ``checkpoint-*`` glob could mistake.
STATE_FOLDER = ".raytrainer"

# pyarrow's type_name of the filesystem each URI scheme resolves to
_KIND = {"": "local", "file": "local", "s3": "s3", "gs": "gcs", "gcs": "gcs", "hdfs": "hdfs",
         "viewfs": "hdfs", "abfs": "abfs", "abfss": "abfs"}


def scheme_of(uri: str) -> str:
    return urlsplit(uri).scheme if "://" in uri else ""


def join_uri(uri: str, *parts: str) -> str:
    """``parts`` under ``uri``: a local path is joined as a path; a URI on its path part, so that a query
    string (``?endpoint_override=...``) stays at the end."""
    if "://" not in uri:
        return os.path.join(uri, *parts)
    split = urlsplit(uri)
    path = posixpath.join(split.path.rstrip("/") or "/", *parts)
    return urlunsplit(split._replace(path=path))


def uri_basename(uri: str) -> str:
    """The last path component of a local path or URI (its query string ignored)."""
    path = urlsplit(uri).path if "://" in uri else uri
    return posixpath.basename(path.rstrip("/"))


def filesystem_matches(filesystem: pafs.FileSystem, uri: str) -> bool:
    """Whether ``filesystem`` serves URIs like ``uri`` (an S3FileSystem serves s3://, a GcsFileSystem gs://)."""
    kind = filesystem.type_name
    if kind.startswith("py::"):  # a PyFileSystem (fsspec, ...): whatever remote scheme it was given for
        return scheme_of(uri) not in ("", "file")
    return _KIND.get(scheme_of(uri), scheme_of(uri)) == kind


def strip_scheme(uri: str) -> str:
    """The path on the filesystem: ``s3://bucket/run?x=1`` -> ``bucket/run`` (as pyarrow's from_uri)."""
    if "://" not in uri:
        return uri
    split = urlsplit(uri)
    if _KIND.get(split.scheme) == "local":
        return split.path
    return (split.netloc + split.path).rstrip("/")


@dataclass(frozen=True)
class Storage:
    fs: pafs.FileSystem
    root: str  # the run directory on ``fs`` (holds checkpoint-<step>/ folders)
    uri: str  # what the user gave, made absolute for local paths

    @classmethod
    def from_uri(cls, uri: str, filesystem: pafs.FileSystem | None = None) -> Storage:
        """The storage at ``uri``; ``filesystem`` (a user's ``storage_filesystem``) serves it when it is of
        the URI's kind, else pyarrow resolves the URI (its query options and the environment)."""
        uri = str(uri)
        if "://" not in uri:
            uri = os.path.abspath(os.path.expanduser(uri))
        if filesystem is not None and filesystem_matches(filesystem, uri):
            return cls(fs=filesystem, root=strip_scheme(uri).rstrip("/") or "/", uri=uri)
        try:
            fs, path = pafs.FileSystem.from_uri(uri if "://" in uri else f"file://{uri}")
        except pa.ArrowInvalid as exc:  # an unknown scheme, or a URI pyarrow cannot parse
            raise ValueError(
                f"storage {uri!r}: pyarrow has no filesystem for it ({exc}); use a local path or a URI of "
                "s3://, gs://, abfs://, hdfs:// or file://, or pass storage_filesystem= (a "
                "pyarrow.fs.FileSystem, e.g. an fsspec filesystem wrapped in pyarrow.fs.PyFileSystem)"
            ) from None
        return cls(fs=fs, root=path.rstrip("/") or "/", uri=uri)

    @classmethod
    def for_run(cls, args) -> Storage:
        """The run directory of ``args``: ``storage_path`` (which defaults to ``output_dir``)."""
        return cls.from_uri(args.storage_path or args.output_dir, getattr(args, "storage_filesystem", None))

    @property
    def is_local(self) -> bool:
        """A plain local path: ranks write checkpoint files in place. Any URI -- file:// included --
        goes through pyarrow: staged locally, then uploaded in the background."""
        return "://" not in self.uri and isinstance(self.fs, pafs.LocalFileSystem)

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def uri_of(self, *parts: str) -> str:
        """A URI (or absolute local path) for ``parts`` under the root, as users and Ray see it."""
        return join_uri(self.uri, *parts)

    def state(self, *parts: str) -> Storage:
        """``STATE_FOLDER/parts`` under the root, as a Storage of its own (on the same filesystem)."""
        return self.at(self.uri_of(STATE_FOLDER, *parts))

    def at(self, uri: str) -> Storage:
        """Another location, on this storage's filesystem when it serves that URI."""
        return Storage.from_uri(uri, self.fs)

    # -- files -------------------------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        return self.fs.get_file_info(path).type != pafs.FileType.NotFound

    def is_dir(self, path: str) -> bool:
        return self.fs.get_file_info(path).type == pafs.FileType.Directory

    def size(self, path: str) -> int:
        return self.fs.get_file_info(path).size

    def read_bytes(self, path: str) -> bytes:
        with self.fs.open_input_stream(path) as f:
            return f.read()

    def write_bytes(self, path: str, data: bytes) -> None:
        self.fs.create_dir(posixpath.dirname(path), recursive=True)
        with self.fs.open_output_stream(path) as f:
            f.write(data)

    def write_atomic(self, path: str, data: bytes) -> None:
        """Readers see the whole file or none: a temporary name, then a rename on a local filesystem
        (``file://`` URIs included), one PUT on object stores (atomic by itself)."""
        if not isinstance(self.fs, pafs.LocalFileSystem):
            self.write_bytes(path, data)
            return
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        self.write_bytes(tmp, data)
        self.fs.move(tmp, path)

    def list_dirs(self, path: str | None = None) -> list[str]:
        """Names of the folders directly under ``path`` (the root by default)."""
        path = path or self.root
        if not self.is_dir(path):
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(path, recursive=False))
        return [posixpath.basename(i.path) for i in infos if i.type == pafs.FileType.Directory]

    def list_files(self, path: str) -> dict[str, int]:
        """Relative path -> size of every file below ``path``."""
        infos = self.fs.get_file_info(pafs.FileSelector(path, recursive=True))
        prefix = path.rstrip("/") + "/"
        return {i.path[len(prefix):]: i.size for i in infos if i.type == pafs.FileType.File}

    def upload_dir(self, local_dir: str, dest: str) -> None:
        """Copy a local folder's files into ``dest`` (merging with what other ranks put there)."""
        self.fs.create_dir(dest, recursive=True)
        pafs.copy_files(local_dir, dest, source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=self.fs)

    def upload_file(self, local_path: str, path: str) -> None:
        """Copy one local file to ``path``, streamed."""
        self.fs.create_dir(posixpath.dirname(path), recursive=True)
        pafs.copy_files(local_path, path, source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=self.fs)

    def download(self, path: str, dest: str) -> None:
        """Copy one file to a local path, streamed."""
        os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
        pafs.copy_files(path, dest, source_filesystem=self.fs, destination_filesystem=pafs.LocalFileSystem())

    def download_dir(self, path: str, dest: str) -> None:
        """Copy a folder's files (recursively) into a local folder."""
        os.makedirs(dest, exist_ok=True)
        pafs.copy_files(path, dest, source_filesystem=self.fs, destination_filesystem=pafs.LocalFileSystem())

    def delete_dir(self, path: str) -> None:
        self.fs.delete_dir(path)

    def check_writable(self, what: str = "storage_path") -> None:
        """Write, read back and delete a marker, within seconds: fails on the driver, before any worker
        starts, with the URI and the fix (see ``storage_check``)."""
        from raytrainer.storage_check import check_writable

        check_writable(self, what)


def ray_run_folder(args) -> str:
    """Ray Train's run folder for a Trainer's group: ``<storage root>/.raytrainer/ray`` -- beside the
    checkpoints, not among them (Ray's run record and storage marker are not the user's files)."""
    return Storage.for_run(args).state("ray").root
