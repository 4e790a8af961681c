"""The checkpoint format: ``checkpoint-<step>/`` folders, committed by a manifest written last.

A checkpoint folder holds (HF's layout)::

    model.safetensors            consolidated weights (or the model's save_pretrained files)
    optimizer.pt  scheduler.pt   state dicts, loaded with torch.load(weights_only=True)
    rng_state_<rank>.safetensors python / numpy / torch CPU / CUDA generator states of each rank
    trainer_state.json           TrainerState: log_history, best_metric, callback states, ...
    training_args.json           the arguments, tokens hidden
    training_args.bin            the same, pickled as transformers writes it (for its tools; never read here)
    manifest.json                every file above with its size and sha256 -- written last, atomically

A folder without a readable manifest, or whose files do not match it, is partial: resume and best-model
loading skip it with a warning that names it. Nothing here unpickles arbitrary objects: tensors come
from safetensors, optimizer/scheduler state from ``torch.load(weights_only=True)``, the rest is JSON.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import tempfile

import torch

from raytrainer.storage import Storage, uri_basename

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "raytrainer-checkpoint/1"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or used; the message names it and what is wrong."""


class DamagedCheckpointError(CheckpointError):
    """A committed checkpoint whose files no longer match its manifest (bit rot, a copy cut short, a file
    rewritten after the commit), found when read. ``checkpoint`` is the folder's URI: a resume that chose
    it itself (``resume_from_checkpoint=True``, a restart) falls back to the one before (driver/runner.py)."""

    def __init__(self, message: str, checkpoint: str = ""):
        super().__init__(message)
        self.checkpoint = checkpoint


def step_of(name: str) -> int | None:
    """The step of a ``checkpoint-<step>`` folder name, path or URI; None for anything else."""
    match = _CHECKPOINT_RE.match(uri_basename(name))
    return int(match.group(1)) if match else None


# -- manifest ------------------------------------------------------------------------------------------
#: The read size when hashing, and the size of the blocks hashed one by one in the manifest (``blocks``)
#: for the files read in ranges (DCP shards): a rank that reads part of such a file verifies the blocks it
#: read, never the whole file. A smaller file gets smaller blocks (``_block_size``).
BLOCK = 1 << 22


def _block_size(size: int) -> int:
    """BLOCK for a file of 256 MiB or more; a smaller one is cut into about 64 blocks (at least 16 KiB
    each), so that reading a few small items of it (the replicated entries DCP puts at a file's end)
    checks kilobytes, not the file. A 70B model's shard on 64 ranks (2.2 GB, plus 8.8 GB of optimizer
    state): 2,600 blocks, 180 KB of the manifest per rank."""
    if size >= 64 * BLOCK:
        return BLOCK
    return max(1 << 14, 1 << max(0, size // 64 - 1).bit_length())


def _read_in_ranges(name: str) -> bool:
    """Whether ``name`` is read in ranges on resume (another rank's DCP shard, a reshard): its manifest
    entry then holds the sha256 of each BLOCK as well."""
    return name.endswith(".distcp")


def _sha256(stream, sink=None, blocks: list | None = None, block: int = BLOCK) -> str:
    """The stream's sha256, read in ``block``-sized blocks (a short read is topped up, so each block but
    the last is exactly ``block``); each block also goes to ``sink`` when given, and its own sha256 to
    ``blocks``."""
    h = hashlib.sha256()
    pending = b""
    while chunk := stream.read(block - len(pending)):
        pending = chunk if not pending else pending + chunk
        if len(pending) == block:
            _take(h, pending, sink, blocks)
            pending = b""
    if pending:
        _take(h, pending, sink, blocks)
    return h.hexdigest()


def _take(h, block: bytes, sink, blocks: list | None) -> None:
    h.update(block)
    if blocks is not None:
        blocks.append(hashlib.sha256(block).hexdigest())
    if sink is not None:
        sink.write(block)


def digest_files(folder: str, names: list[str]) -> dict[str, dict]:
    """Size and sha256 of the given files of a local folder (one rank's part of the manifest); for a file
    read in ranges and larger than one block, the sha256 of each of its blocks too."""
    out = {}
    for name in names:
        size = os.path.getsize(os.path.join(folder, name))
        block = _block_size(size)
        blocks = [] if _read_in_ranges(name) and size > block else None
        with open(os.path.join(folder, name), "rb") as f:
            digest = _sha256(f, blocks=blocks, block=block if blocks is not None else BLOCK)
        out[name] = {"size": size, "sha256": digest}
        if blocks is not None:
            out[name].update(block_size=block, blocks=blocks)
    return out


def write_manifest(storage: Storage, name: str, parts: list[dict], step: int) -> None:
    files: dict[str, dict] = {}
    for part in parts:
        files.update(part)
    body = {"format": FORMAT, "global_step": step, "files": dict(sorted(files.items()))}
    storage.write_atomic(storage.path(name, MANIFEST), json.dumps(body, indent=1).encode())


def read_manifest(storage: Storage, folder: str) -> dict | None:
    """The manifest of ``folder`` (a path on ``storage.fs``), or None when it is missing or unreadable."""
    path = f"{folder.rstrip('/')}/{MANIFEST}"
    if not storage.exists(path):
        return None
    try:
        body = json.loads(storage.read_bytes(path))
    except ValueError:
        return None
    return body if body.get("format") == FORMAT and isinstance(body.get("files"), dict) else None


def problems(storage: Storage, folder: str, manifest: dict) -> list[str]:
    """Files the manifest lists that are missing or of the wrong size (a cheap check, no reading)."""
    present = storage.list_files(folder)
    out = []
    for name, meta in _with_rewritten_weights(manifest["files"], present).items():
        if meta["sha256"] is None:  # present, unverified: weights the user rewrote in another layout
            continue
        if name not in present:
            out.append(f"{name} is missing")
        elif present[name] != meta["size"]:
            out.append(f"{name} has {present[name]} bytes, the manifest says {meta['size']}")
    return out


#: transformers' names for a model's weights: one file, or an index and the shards it names.
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
#: Files only raytrainer writes: a folder holding one without a manifest is a raytrainer save that did not
#: finish, never another library's checkpoint.
_RAYTRAINER_ONLY = re.compile(r"^(training_args\.json|rng_state_\d+\.safetensors)$")


def _is_weights(name: str) -> bool:
    return name in _WEIGHT_FILES or name in _WEIGHT_INDEXES or bool(
        re.match(r"^(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)$", name))


def _with_rewritten_weights(files: dict, present: dict[str, int]) -> dict:
    """The manifest's files, where the model's weights were rewritten in the folder after the save (say,
    into transformers' sharded layout: an index and its shards, as ``save_pretrained`` writes them) replaced
    by the files present now -- unverified (``sha256`` None). Only when every weight file the manifest
    lists is gone and the new layout is complete; anything else missing stays missing."""
    listed = [n for n in files if _is_weights(n)]
    if not listed or any(n in present for n in listed):
        return files
    index = next((n for n in _WEIGHT_INDEXES if n in present), None)
    if index is None:
        return files
    shards = {n for n in present if _is_weights(n) and n not in _WEIGHT_INDEXES}
    out = {n: meta for n, meta in files.items() if n not in listed}
    out.update({n: {"size": present[n], "sha256": None} for n in sorted({index, *shards})})
    return out


def foreign_checkpoint(storage: Storage, folder: str) -> dict | None:
    """A checkpoint another trainer wrote (transformers.Trainer's ``checkpoint-<step>``: weights,
    optimizer.pt, scheduler.pt, trainer_state.json, no manifest) as manifest files -- name -> size,
    ``sha256`` None: read as they are, unverified -- or None where ``folder`` is not one (no
    trainer_state.json, or a raytrainer save that did not finish)."""
    present = storage.list_files(folder)
    if "trainer_state.json" not in present or any(_RAYTRAINER_ONLY.match(n) for n in present):
        return None
    return {name: {"size": size, "sha256": None} for name, size in present.items()}


def committed_checkpoints(storage: Storage, warn: bool = True) -> list[tuple[int, str]]:
    """(step, folder path) of every committed checkpoint under the storage root, oldest first."""
    out = []
    for name in storage.list_dirs():
        step = step_of(name)
        if step is None:
            continue
        folder = storage.path(name)
        manifest = read_manifest(storage, folder)
        issues = ["it has no manifest"] if manifest is None else problems(storage, folder, manifest)
        if issues:
            if warn:
                logger.warning("skipping partial checkpoint %s: %s", storage.uri_of(name), "; ".join(issues))
            continue
        out.append((step, folder))
    return sorted(out)


def resolve_resume(storage: Storage, resume_from_checkpoint) -> str | None:
    """The folder URI to resume from: the latest committed one for True, else the one given (checked)."""
    if resume_from_checkpoint in (None, False):
        return None
    if resume_from_checkpoint is True:
        found = committed_checkpoints(storage)
        if not found:
            raise CheckpointError(
                "resume_from_checkpoint=True: No valid checkpoint found in output directory "
                f"({storage.uri}): it holds no committed checkpoint (checkpoint-<step> folder with a "
                "manifest). Train without resuming, or give a path."
            )
        return storage.uri_of(os.path.basename(found[-1][1]))
    target = storage.at(str(resume_from_checkpoint))
    if not target.is_dir(target.root):
        raise CheckpointError(f"resume_from_checkpoint={resume_from_checkpoint!r}: Can't find a valid "
                              f"checkpoint at {resume_from_checkpoint} (the folder does not exist).")
    manifest = read_manifest(target, target.root)
    if manifest is None and foreign_checkpoint(target, target.root) is not None:
        return target.uri  # another trainer's (transformers.Trainer's): the reader says so when it opens it
    if manifest is None:
        kind = "a partial checkpoint (its manifest.json is missing: the save did not finish)"
        if step_of(target.root) is None and not target.exists(target.path("trainer_state.json")):
            kind = "not a raytrainer checkpoint (no manifest.json, no trainer_state.json)"
        raise CheckpointError(f"resume_from_checkpoint={resume_from_checkpoint!r} is {kind}.")
    issues = problems(target, target.root, manifest)
    if issues:
        raise CheckpointError(
            f"resume_from_checkpoint={resume_from_checkpoint!r} is damaged: {'; '.join(issues)}")
    return target.uri


def _share_by_size(names: list[str], sizes: dict[str, int], ctx) -> list[list[str]]:
    """``names`` split into world_size lists of about equal bytes (largest first, each to the lightest rank;
    the same on every rank): a ZeRO checkpoint alternates kilobyte and gigabyte files, so a split by
    position would have one rank hash every partition."""
    shares: list[list[str]] = [[] for _ in range(ctx.world_size)]
    load = [0] * ctx.world_size
    for name in sorted(names, key=lambda n: (-sizes[n], n)):
        rank = load.index(min(load))
        shares[rank].append(name)
        load[rank] += sizes[name]
    return shares


def raise_on_every_rank(error: CheckpointError | None, ctx, uri: str) -> None:
    """Every rank raises when any rank found ``error`` (one flag all-reduce when none did): the first
    finder's, so that whichever rank's error reaches the driver names the damaged file."""
    if not ctx.any_flags([error is not None])[0]:
        return
    mine = (isinstance(error, DamagedCheckpointError), str(error)) if error is not None else None
    found = ctx.gather_object(mine)
    damaged, message = ctx.broadcast_object(next(f for f in found if f) if ctx.is_world_zero else None)
    if damaged:
        raise DamagedCheckpointError(message, uri) from error
    raise CheckpointError(message) from error


# -- reading files of a committed checkpoint, verified ----------------------------------------------------
class CheckpointReader:
    def __init__(self, uri: str, filesystem=None):
        """``filesystem``: the run's ``storage_filesystem``, used when it serves ``uri``."""
        self.uri = uri
        self.storage = Storage.from_uri(uri, filesystem)
        manifest = read_manifest(self.storage, self.storage.root)
        if manifest is None:
            self.files = foreign_checkpoint(self.storage, self.storage.root)
            if self.files is None:
                raise CheckpointError(f"{uri} has no manifest: it is not a committed raytrainer checkpoint.")
            _warn_once(f"{uri} was not written by raytrainer (it has no manifest.json, as "
                       "transformers.Trainer's checkpoints): its files are read as they are, unverified.")
        else:
            present = self.storage.list_files(self.storage.root)
            self.files = _with_rewritten_weights(manifest["files"], present)
            if any(meta["sha256"] is None for meta in self.files.values()):
                _warn_once(f"{uri}: its model weights were rewritten after it was committed (they are not "
                           "the files its manifest lists); they are read as they are, unverified.")

    def has(self, name: str) -> bool:
        return name in self.files

    def damaged(self, what: str) -> DamagedCheckpointError:
        return DamagedCheckpointError(f"{self.uri}/{what} does not match its manifest checksum: refusing it.",
                                      self.uri)

    def read(self, name: str) -> bytes:
        if name not in self.files:
            raise CheckpointError(f"{self.uri} does not hold {name}.")
        data = self.storage.read_bytes(self.storage.path(name))
        self._check(name, hashlib.sha256(data).hexdigest())
        return data

    def _check(self, name: str, digest: str) -> None:
        expected = self.files[name]["sha256"]
        if expected is not None and digest != expected:  # None: another trainer's file, read unverified
            raise self.damaged(name)

    def verify(self, name: str) -> None:
        if self.files[name]["sha256"] is None:
            return
        with self.storage.fs.open_input_stream(self.storage.path(name)) as f:
            digest = _sha256(f)
        self._check(name, digest)

    def verify_share(self, names: list[str], ctx) -> None:
        """Every rank checks every world_size-th of ``names`` against the manifest (streamed), and all
        ranks agree: one damaged file stops every rank, each having read 1/world_size of the bytes."""
        error = None
        try:
            for name in _share_by_size(names, {n: self.files[n]["size"] for n in names}, ctx)[ctx.rank]:
                self.verify(name)
        except CheckpointError as exc:
            error = exc
        raise_on_every_rank(error, ctx, self.uri)

    def download(self, name: str, dest: str) -> None:
        """One file to a local path, streamed and hashed on the way: a mismatch leaves no file behind."""
        os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
        with self.storage.fs.open_input_stream(self.storage.path(name)) as src, open(dest, "wb") as out:
            digest = _sha256(src, sink=out)
        try:
            self._check(name, digest)
        except CheckpointError:
            os.remove(dest)
            raise

    @contextlib.contextmanager
    def local_copy(self, names: list[str], ctx, mine: list[str] | None = None):
        """A local folder for a library that reads files itself (DeepSpeed): the checkpoint folder when it is
        local (each rank verifies its share of ``names``), else a temporary folder into which this rank
        downloads, verified, only ``mine`` -- the files it reads (all of ``names`` when not given)."""
        if self.storage.is_local:
            self.verify_share(names, ctx)
            yield self.storage.root
            return
        with tempfile.TemporaryDirectory(prefix="raytrainer-resume-") as tmp:
            self.download_all(names if mine is None else mine, tmp, ctx)
            yield tmp

    def download_all(self, names: list[str], dest: str, ctx) -> None:
        """``names`` into the local folder ``dest``, each verified as it streams (``download``); a collective:
        every rank raises when any rank met a damaged file, and a rank with no ``names`` waits for the
        others' copies here."""
        error = None
        try:
            for name in names:
                self.download(name, os.path.join(dest, name))
        except CheckpointError as exc:
            error = exc
        raise_on_every_rank(error, ctx, self.uri)

    @contextlib.contextmanager
    def dcp_reader(self, subdir: str, ctx):
        """A torch.distributed.checkpoint StorageReader for ``subdir``, every file verified by one rank.
        Local: DCP's own reader on the folder. A bucket: each rank downloads (verified) the files it wrote
        at save time -- its own shards, which its load plan reads -- and reads anything else its plan needs
        (another rank's replicated entries, reshards) as ranged reads of just those bytes."""
        names = sorted(n for n in self.files if n.startswith(f"{subdir}/"))
        if self.storage.is_local:
            from torch.distributed.checkpoint import FileSystemReader

            self.verify_share(names, ctx)
            yield FileSystemReader(self.storage.path(subdir))
            return
        from raytrainer.dcp_storage import owned_files

        mine = owned_files(names, ctx.rank, ctx.world_size)
        with self.local_copy(names, ctx, mine) as tmp, damage_named():
            yield self.ranged_reader(subdir, os.path.join(tmp, subdir))

    def ranged_reader(self, subdir: str, cache: str | None):
        """A DCP reader of ``subdir`` in this checkpoint's storage: the files in the local folder ``cache``
        (verified copies) read from there, anything else in ranged reads, each verified (``verifying``)."""
        from raytrainer.dcp_storage import PyArrowReader

        return PyArrowReader(self.storage.fs, self.storage.path(subdir), cache=cache,
                             **self.verifying(subdir))

    def verifying(self, subdir: str) -> dict:
        """What a PyArrowReader of ``subdir`` verifies its reads by: the manifest's entries of its files, by
        their names in it, and the error for one that does not match."""
        prefix = f"{subdir}/" if subdir else ""
        return {"files": {n[len(prefix):]: meta for n, meta in self.files.items() if n.startswith(prefix)},
                "damaged": lambda name: self.damaged(prefix + name)}

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """A safetensors file's tensors, verified while streaming: hashed in blocks as it is read (a local
        file) or downloaded (a bucket), then loaded from disk -- never a whole-file copy in memory beside
        the tensors."""
        from safetensors.torch import load_file

        if name not in self.files:
            raise CheckpointError(f"{self.uri} does not hold {name}.")
        if self.storage.is_local:
            self.verify(name)
            return load_file(self.storage.path(name))
        with tempfile.TemporaryDirectory(prefix="raytrainer-weights-") as tmp:
            local = os.path.join(tmp, os.path.basename(name))
            self.download(name, local)
            return load_file(local)

    def torch_state(self, name: str):
        """A state dict saved with torch.save, loaded without running any pickled code."""
        try:
            return torch.load(io.BytesIO(self.read(name)), weights_only=True, map_location="cpu")
        except Exception as exc:  # UnpicklingError for any global outside torch's allowlist
            raise CheckpointError(
                f"{self.uri}/{name} holds objects other than tensors and plain containers; raytrainer "
                f"refuses to unpickle it (nothing in it was run). Details: {type(exc).__name__}: {exc}"
            ) from exc

    def json(self, name: str):
        return json.loads(self.read(name))


@contextlib.contextmanager
def damage_named():
    """A DCP load meanwhile: DCP gathers every rank's errors into one ``CheckpointException`` (every rank
    raises it); where one of them is a damaged file, that DamagedCheckpointError is raised instead, so the
    driver resumes from the checkpoint before, as for any damaged file."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        damaged = [e for e, _ in exc.failures.values() if isinstance(e, DamagedCheckpointError)]
        if damaged:
            raise damaged[0] from exc
        raise


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


#: FSDP's sharded model (SHARDED_STATE_DICT): DCP shards under the key ``model``, accelerate's folder name
SHARDED_MODEL_DIR = "pytorch_model_fsdp_0"


def holds_sharded_model(files) -> bool:
    """Whether a checkpoint's files hold the model as DCP shards (``pytorch_model_fsdp_0/``)."""
    return f"{SHARDED_MODEL_DIR}/.metadata" in files


def _weight_files(reader: CheckpointReader) -> list[str]:
    """The checkpoint's consolidated weight files (its safetensors, not the RNG states)."""
    return _weights_in(reader.files)


def _weights_in(files) -> list[str]:
    return sorted(n for n in files if n.endswith(".safetensors") and not n.startswith("rng_state"))


def zero_model_tag(files) -> str | None:
    """The DeepSpeed tag (``global_step<N>``) whose ZeRO-3 partitions are a checkpoint's only copy of the
    model -- engine files and no consolidated weights, adapter or DCP model beside them; else None."""
    return None if _weights_in(files) or holds_sharded_model(files) else zero_tag(files)


def zero_tag(files) -> str | None:
    """The DeepSpeed engine checkpoint (``global_step<N>/`` with its ``*_model_states.pt``) among ``files``;
    the newest when there are several."""
    steps = {}
    for name in files:
        tag, _, rest = name.partition("/")
        number = tag.removeprefix("global_step")
        if rest.endswith("_model_states.pt") and number != tag:
            steps[tag] = int(number) if number.isdigit() else -1
    return max(steps, key=steps.get, default=None)


def _dcp_storage_reader(reader: CheckpointReader):
    """A DCP StorageReader of the checkpoint's sharded model, for one process (no process group): the local
    folder, or ranged reads from a bucket."""
    from raytrainer.dcp_storage import reader_at

    return reader_at(reader.storage, reader.storage.path(SHARDED_MODEL_DIR),
                     **reader.verifying(SHARDED_MODEL_DIR))


def _sharded_metadata(reader: CheckpointReader) -> dict:
    """Name -> DCP metadata (size, dtype) of the sharded model's tensors, from its ``.metadata`` alone."""
    from raytrainer.dcp_storage import tensor_metadata

    return {key[len("model."):]: meta for key, meta in tensor_metadata(_dcp_storage_reader(reader)).items()
            if key.startswith("model.")}


def _verify_sharded(reader: CheckpointReader) -> None:
    """Every file of the sharded model checked, where the files are local (DCP's own reader verifies
    nothing); from a bucket each read is verified as it is made (``dcp_storage.PyArrowReader``)."""
    if not reader.storage.is_local:
        return
    for name in sorted(n for n in reader.files if n.startswith(f"{SHARDED_MODEL_DIR}/")):
        reader.verify(name)


def _load_sharded(reader: CheckpointReader, tensors: dict[str, torch.Tensor]) -> None:
    """DCP's planner reads each of ``tensors`` (name -> a whole tensor) from the sharded model, in this
    process, straight into it."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        with damage_named():
            dcp.load({"model": tensors}, storage_reader=_dcp_storage_reader(reader), no_dist=True)


def model_weights(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    """The checkpoint's consolidated weights (its safetensors files, or its DCP-sharded model put together
    in memory: small models, tests and tools only -- a resume reads each rank's share instead)."""
    names = _weight_files(reader)
    if not names and holds_sharded_model(reader.files):
        return _sharded_weights(reader)
    if not names:
        raise CheckpointError(f"{reader.uri} holds no model weights (*.safetensors).")
    weights: dict[str, torch.Tensor] = {}
    for name in names:
        weights.update(reader.tensors(name))
    return weights


def _sharded_weights(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    _verify_sharded(reader)
    tensors = {name: torch.empty(meta.size, dtype=meta.properties.dtype)
               for name, meta in _sharded_metadata(reader).items()}
    _load_sharded(reader, tensors)
    return tensors


def weight_shapes(reader: CheckpointReader) -> dict[str, tuple]:
    """Name -> shape of every tensor in the checkpoint's weight files, from the safetensors headers alone
    (a few kilobytes per file, whatever the model's size): what the driver checks a resume against."""
    names = _weight_files(reader)
    if not names and holds_sharded_model(reader.files):  # DCP's .metadata holds every tensor's size
        return {name: tuple(meta.size) for name, meta in _sharded_metadata(reader).items()}
    shapes: dict[str, tuple] = {}
    for name in names:
        with reader.storage.fs.open_input_file(reader.storage.path(name)) as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


def check_shapes(own: dict[str, torch.Tensor], shapes: dict[str, tuple], source: str) -> None:
    """Refuse weights (name -> shape) of which a tensor the model also names has another shape there."""
    for name, mine in own.items():  # in the model's order: the first mismatch is the earliest layer
        if name in shapes and tuple(shapes[name]) != tuple(mine.shape):
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(shapes[name])} in the checkpoint but "
                f"{tuple(mine.shape)} in the model: the checkpoint is from another model shape."
            )


def check_fits(own: dict[str, torch.Tensor], shapes: dict[str, tuple], source: str) -> None:
    """Refuse weights (name -> shape) that do not fit the model's state dict ``own``, naming the first
    tensor whose shape or name does not fit; a tied weight stored once is fine."""
    check_shapes(own, shapes, source)
    missing = [k for k in own if k not in shapes]
    shared = {id(v.untyped_storage()) for k, v in own.items() if k in shapes}
    missing = [k for k in missing if id(own[k].untyped_storage()) not in shared]  # tied weights
    unexpected = [k for k in shapes if k not in own]
    if missing or unexpected:
        first = missing[0] if missing else unexpected[0]
        raise CheckpointError(
            f"{source} does not fit the model: first mismatching tensor {first!r} "
            f"({len(missing)} missing from the checkpoint, {len(unexpected)} unexpected)."
        )


def loads_its_own_way(model) -> bool:
    """The model overrides ``load_state_dict`` (or ``_load_from_state_dict``), say to resize a buffer to the
    saved one: it decides what fits, and raytrainer's shape check steps aside (as transformers calls the
    model's own method)."""
    return any(getattr(type(model), name, None) is not getattr(torch.nn.Module, name)
               for name in ("load_state_dict", "_load_from_state_dict"))


#: PEFT's adapter file (``PeftModel.save_pretrained``): a checkpoint of a PeftModel holds only the adapter
ADAPTER_WEIGHTS = "adapter_model.safetensors"


