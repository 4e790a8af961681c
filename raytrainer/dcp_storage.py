"""torch.distributed.checkpoint (DCP) reading from a pyarrow filesystem (s3://, gs://, ...).

DCP's ``FileSystemReader`` reads through a small file-system interface (``FileSystemBase``); this module
gives it pyarrow's, with a local cache: the files a rank downloaded (verified) -- those it wrote at save
time, ``owned_files`` -- are read from disk; from any other file, each tensor or byte item the rank's load
plan needs is one ranged read of its bytes. So on resume at the same world size a rank fetches its
own shards once plus a few small replicated entries, never whole files of other ranks; resharding to
another world size reads just the slices it needs.

Given the checkpoint's manifest entries, each ranged read is verified without reading the whole file: a
shard's entry holds the sha256 of each of its blocks (``block_size``: 4 MiB, less for a small file), and
the read is widened to the blocks it touches, each checked (a file with no block hashes -- small, one
block -- is read whole and checked against its sha256). The last verified range is kept, so a run of
small items in one block (DCP writes a file's small tensors together at its end, and reads a file's
items in order) costs one read.
"""

from __future__ import annotations

import hashlib
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

    def __init__(self, fs: pafs.FileSystem, root: str, cache: str | None, files: dict | None = None,
                 damaged=None):
        self.fs, self.root, self.cache = fs, root, cache
        self.files, self.damaged = files or {}, damaged

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "rb":
            raise ValueError(f"raytrainer's DCP reader only reads (mode {mode!r} asked for {path})")
        local = os.path.join(self.cache, posixpath.relpath(str(path), self.root)) if self.cache else None
        if local and os.path.exists(local):
            with open(local, "rb") as f:
                yield f
            return
        name = posixpath.relpath(str(path), self.root)
        with self.fs.open_input_file(str(path)) as f:  # random access: reads are ranged requests
            yield _Ranged(f, self.files.get(name), lambda: self.damaged(name))

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
    """A remote file as DCP's reader uses it: each item one ranged read (DCP would otherwise read a tensor's
    zip record piecewise, a request per small read), verified by the manifest ``entry`` where one is given
    (see the module's docstring); sequential reads (the metadata's unpickling) from one read of the whole
    file, verified whole."""

    def __init__(self, f, entry: dict | None = None, damaged=None):
        self.f, self.damaged = f, damaged
        self.entry = entry if entry is not None and entry.get("sha256") is not None else None
        self._whole: io.BytesIO | None = None
        self._kept = (0, b"")  # the last verified range: (its offset, its bytes)

    def item(self, offset: int, length: int) -> io.BytesIO:
        if self.entry is None:
            return io.BytesIO(self.f.read_at(length, offset))
        start, data = self._kept
        if not (start <= offset and offset + length <= start + len(data)):
            start, data = self._verified_range(offset, length)
            self._kept = start, data
        return io.BytesIO(data[offset - start:offset + length - start])

    def _verified_range(self, offset: int, length: int) -> tuple[int, bytes]:
        """The whole blocks that hold ``offset`` .. ``offset + length``, each checked; blocks of the kept
        range it starts in are reused, not fetched again."""
        blocks, block = self.entry.get("blocks"), self.entry.get("block_size")
        if blocks is None:  # one block: the whole file, against its sha256
            return 0, self._buffer().getvalue()
        first, last = offset // block, max(offset, offset + length - 1) // block
        start, end = first * block, min(self.entry["size"], (last + 1) * block)
        kept_start, kept = self._kept
        reused = b""
        if kept and kept_start <= start < kept_start + len(kept):
            reused = kept[start - kept_start:]
        missing = end - start - len(reused)
        fetched = self.f.read_at(missing, start + len(reused)) if missing > 0 else b""
        for i in range((start + len(reused)) // block, last + 1):
            piece = fetched[i * block - start - len(reused):(i + 1) * block - start - len(reused)]
            if hashlib.sha256(piece).hexdigest() != blocks[i]:
                raise self.damaged()
        return start, (reused + fetched)[:end - start]

    def _buffer(self) -> io.BytesIO:
        if self._whole is None:
            data = self.f.read_at(self.f.size(), 0)
            if self.entry is not None and hashlib.sha256(data).hexdigest() != self.entry["sha256"]:
                raise self.damaged()
            self._whole = io.BytesIO(data)
        return self._whole

    def read(self, n: int = -1) -> bytes:
        return self._buffer().read(n)

    def readline(self) -> bytes:
        return self._buffer().readline()


class PyArrowReader(FileSystemReader):
    """``FileSystemReader`` over a pyarrow filesystem; ``path`` is the DCP folder's path on ``fs``,
    ``cache`` a local folder holding some of its files (verified copies)."""

    def __init__(self, fs: pafs.FileSystem, path: str | os.PathLike, cache: str | None = None,
                 files: dict | None = None, damaged=None):
        """``files``: the manifest's entries of the folder's files by their names in it, to verify what is
        read; ``damaged(name)``: the exception to raise for a file that does not match."""
        super().__init__(path)
        self.fs = _PyArrowFileSystem(fs, str(path), cache, files, damaged)
        self.path = str(path)

    def reset(self, checkpoint_id=None) -> None:
        super().reset(None)  # the path stays the one given

    def read_data(self, plan, planner):
        """DCP's own reading, with each file's items in the order they lie in it (DCP reads them in the
        state's order): each verified block is fetched once, and reused by the items that follow in it."""
        import dataclasses

        where = self.storage_data
        items = sorted(plan.items, key=lambda i: (where[i.storage_index].relative_path,
                                                  where[i.storage_index].offset))
        return super().read_data(dataclasses.replace(plan, items=items), planner)

    def _slice_file(self, file, sinfo):
        if isinstance(file, _Ranged):
            return file.item(sinfo.offset, sinfo.length)
        return super()._slice_file(file, sinfo)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


def reader_at(storage, path: str, files: dict | None = None, damaged=None) -> FileSystemReader:
    """A DCP StorageReader of the folder ``path`` on ``storage`` (a raytrainer Storage), for one process:
    DCP's own reader for a local path, else ranged reads through pyarrow, verified by ``files`` where given
    (``PyArrowReader``)."""
    if storage.is_local:
        return FileSystemReader(path)
    return PyArrowReader(storage.fs, path, files=files, damaged=damaged)


def tensor_metadata(reader: FileSystemReader) -> dict:
    """Key -> ``TensorStorageMetadata`` (size, dtype) of every tensor the DCP folder holds, from its
    ``.metadata`` alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {key: meta for key, meta in reader.read_metadata().state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)}
