"""torch.distributed.checkpoint (DCP) reading from a pyarrow filesystem (s3://, gs://, ...).

DCP's ``FileSystemReader`` reads through a small file-system interface (``FileSystemBase``); this module
gives it pyarrow's, with a local cache: the files a rank downloaded (verified) -- those it wrote at save
time, ``owned_files`` -- are read from disk; from any other file, each tensor or byte item the rank's load
plan needs is one ranged read of exactly its bytes. So on resume at the same world size a rank fetches its
own shards once plus a few small replicated entries, never whole files of other ranks; resharding to
another world size reads just the slices it needs.
"""

from __future__ import annotations

import io
import os
import posixpath
import re
from contextlib import contextmanager

import pyarrow.fs as pafs
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader

_WRITER = re.compile(r"__(\d+)_\d+\.distcp$")


def owned_files(names: list[str], rank: int, world_size: int) -> list[str]:
    """The files of a DCP folder that ``rank`` downloads and verifies: those rank ``rank`` wrote
    (``__<rank>_<n>.distcp``), and a round-robin share of the rest (``.metadata``, files of ranks beyond
    this world size). Every file is some rank's."""
    mine = []
    for i, name in enumerate(names):
        writer = _WRITER.search(name)
        owner = int(writer.group(1)) if writer and int(writer.group(1)) < world_size else i % world_size
        if owner == rank:
            mine.append(name)
    return mine


class _PyArrowFileSystem(FileSystemBase):
    """The read side of DCP's file-system interface on a pyarrow filesystem, local copies first."""

    def __init__(self, fs: pafs.FileSystem, root: str, cache: str | None):
        self.fs, self.root, self.cache = fs, root, cache

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "rb":
            raise ValueError(f"raytrainer's DCP reader only reads (mode {mode!r} asked for {path})")
        local = os.path.join(self.cache, posixpath.relpath(str(path), self.root)) if self.cache else None
        if local and os.path.exists(local):
            with open(local, "rb") as f:
                yield f
            return
        with self.fs.open_input_file(str(path)) as f:  # random access: reads are ranged requests
            yield _Ranged(f)

    def concat_path(self, path, suffix: str) -> str:
        return posixpath.join(str(path), suffix)

    def init_path(self, path, **kwargs) -> str:
        return str(path)

    def rename(self, path, new_path) -> None:
        raise NotImplementedError("read-only")

    def mkdir(self, path) -> None:
        raise NotImplementedError("read-only")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # chosen explicitly, never by DCP's auto-detection

    def exists(self, path) -> bool:
        return self.fs.get_file_info(str(path)).type != pafs.FileType.NotFound

    def rm_file(self, path) -> None:
        raise NotImplementedError("read-only")


class _Ranged:
    """A remote file as DCP's reader uses it: each item one ranged read of its bytes (DCP would otherwise
    read a tensor's zip record piecewise, a request per small read); sequential reads (the metadata's
    unpickling) from one read of the whole file."""

    def __init__(self, f):
        self.f = f
        self._whole: io.BytesIO | None = None

    def item(self, offset: int, length: int) -> io.BytesIO:
        return io.BytesIO(self.f.read_at(length, offset))

    def _buffer(self) -> io.BytesIO:
        if self._whole is None:
            self._whole = io.BytesIO(self.f.read_at(self.f.size(), 0))
        return self._whole

    def read(self, n: int = -1) -> bytes:
        return self._buffer().read(n)

    def readline(self) -> bytes:
        return self._buffer().readline()


class PyArrowReader(FileSystemReader):
    """``FileSystemReader`` over a pyarrow filesystem; ``path`` is the DCP folder's path on ``fs``,
    ``cache`` a local folder holding some of its files (verified copies)."""

    def __init__(self, fs: pafs.FileSystem, path: str | os.PathLike, cache: str | None = None):
        super().__init__(path)
        self.fs = _PyArrowFileSystem(fs, str(path), cache)
        self.path = str(path)

    def reset(self, checkpoint_id=None) -> None:
        super().reset(None)  # the path stays the one given

    def _slice_file(self, file, sinfo):
        if isinstance(file, _Ranged):
            return file.item(sinfo.offset, sinfo.length)
        return super()._slice_file(file, sinfo)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


def reader_at(storage, path: str) -> FileSystemReader:
    """A DCP StorageReader of the folder ``path`` on ``storage`` (a raytrainer Storage), for one process:
    DCP's own reader for a local path, else ranged reads through pyarrow."""
    if storage.is_local:
        return FileSystemReader(path)
    return PyArrowReader(storage.fs, path)


def tensor_metadata(reader: FileSystemReader) -> dict:
    """Key -> ``TensorStorageMetadata`` (size, dtype) of every tensor the DCP folder holds, from its
    ``.metadata`` alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {key: meta for key, meta in reader.read_metadata().state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)}
