"""Checkpoint storage on any pyarrow filesystem: a local path, a shared mount, file://, s3://, gs://, hdfs://.

Every checkpoint read, write, listing and deletion goes through ``pyarrow.fs``, so the same code serves a
laptop folder and a bucket. ``Storage`` is a (filesystem, root path) pair for one run directory.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from dataclasses import dataclass

import pyarrow.fs as pafs


@dataclass(frozen=True)
class Storage:
    fs: pafs.FileSystem
    root: str  # the run directory on ``fs`` (holds checkpoint-<step>/ folders)
    uri: str  # what the user gave, made absolute for local paths

    @classmethod
    def from_uri(cls, uri: str) -> Storage:
        if "://" not in uri:
            uri = os.path.abspath(os.path.expanduser(uri))
        fs, path = pafs.FileSystem.from_uri(uri if "://" in uri else f"file://{uri}")
        return cls(fs=fs, root=path.rstrip("/") or "/", uri=uri)

    @property
    def is_local(self) -> bool:
        """A plain local path: ranks write checkpoint files in place. Any URI -- file:// included --
        goes through pyarrow: staged locally, then uploaded in the background."""
        return "://" not in self.uri and isinstance(self.fs, pafs.LocalFileSystem)

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def uri_of(self, *parts: str) -> str:
        """A URI (or absolute local path) for ``parts`` under the root, as users and Ray see it."""
        if "://" in self.uri:
            return self.uri.rstrip("/") + "/" + "/".join(parts)
        return os.path.join(self.uri, *parts)

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
        """Readers see the whole file or none: a temporary name, then a rename (one PUT on object stores,
        which is atomic by itself)."""
        if not self.is_local:
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

    def delete_dir(self, path: str) -> None:
        self.fs.delete_dir(path)

    def check_writable(self) -> None:
        """Write and delete a marker: fails early, with the path, when the storage cannot be written."""
        marker = self.path(f".raytrainer-write-check-{uuid.uuid4().hex[:8]}")
        try:
            self.write_bytes(marker, b"ok")
            self.fs.delete_file(marker)
        except Exception as exc:
            raise ValueError(
                f"storage_path {self.uri!r} cannot be written ({type(exc).__name__}: {exc}). Give a "
                "folder or URI (s3://, gs://, ...) that this process and every worker can write."
            ) from exc
