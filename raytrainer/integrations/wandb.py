"""``report_to="wandb"``: Weights & Biases. ``WANDB_MODE=offline`` keeps the run on disk (``wandb sync``
uploads it later); ``WANDB_PROJECT`` names the project (``huggingface`` by default, as in HF);
``WANDB_DIR`` is where runs are written (``output_dir`` by default)."""

from __future__ import annotations

import logging
import os
import struct
import time

from raytrainer.callbacks import TrainerCallback
from raytrainer.integrations._common import numeric, rewrite_logs

logger = logging.getLogger(__name__)

# W&B's record file (run-<id>.wandb) is a LevelDB-format log: this 7-byte header (ident, magic, version 0),
# then 32 KiB blocks of chunks, each with a 7-byte header (CRC, length, type); a record too long for the
# rest of a block is split into FIRST, MIDDLE... and LAST chunks.
_LOG_HEADER = b":W&B\xe1\xbe\x00"
_BLOCK = 32 * 1024
_CHUNK_HEADER = 7
_FULL, _FIRST, _LAST = 1, 2, 4


class WandbCallback(TrainerCallback):
    on_driver = True
    same_on_every_rank = True

    def __init__(self):
        self._run = None

    def setup(self, args, state, model=None) -> None:
        import wandb

        config = args.to_sanitized_dict()  # tokens are hidden by to_dict
        model_config = getattr(model, "config", None)
        if model_config is not None and hasattr(model_config, "to_dict"):
            config = {**model_config.to_dict(), **config}
        directory = os.getenv("WANDB_DIR") or args.output_dir
        os.makedirs(directory, exist_ok=True)
        self._run = wandb.init(project=os.getenv("WANDB_PROJECT", "huggingface"),
                               name=args.run_name or state.trial_name, config=config, dir=directory,
                               reinit="create_new")
        self._run.define_metric("train/global_step")
        self._run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero and self._run is None:
            self.setup(args, state, model)

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        if self._run is None:
            self.setup(args, state, model)
        self._run.log({**rewrite_logs(numeric(logs or {})), "train/global_step": state.global_step})

    def on_train_end(self, args, state, control, **kwargs):
        run, self._run = self._run, None
        if run is None:
            return
        settings = run.settings
        run.finish()
        if not getattr(settings, "x_skip_transaction_log", False):
            wait_for_record_file(settings.sync_file)  # finish() returns before it is all on disk

    def __getstate__(self):  # shipped to the workers inside the Trainer: no live run
        return {**self.__dict__, "_run": None}


def wait_for_record_file(path: str, timeout: float = 10.0) -> bool:
    """Wait until W&B's service has written a finished run's record file; False if it did not in time.

    ``Run.finish()`` returns once the service has handled the run's exit record (and, online, uploaded the
    data), but the service buffers the record file in 32 KiB blocks and writes the last one when it closes the
    run's stream, on the finish message that ``finish()`` sends without waiting for an answer. Until then an
    offline run's file may hold only its header. The exit record is the last one written: once it is on
    disk, every record is.
    """
    from google.protobuf.message import DecodeError
    from wandb.proto.wandb_internal_pb2 import Record

    deadline = time.monotonic() + timeout
    while True:
        try:
            tail = _last_records(path)
        except OSError:
            return False  # no record file (e.g. a disabled run)
        if tail is None:
            return False  # a format this reader does not know: do not wait for it
        try:
            if any(Record.FromString(record).HasField("exit") for record in tail):
                return True
        except DecodeError:  # a block caught mid-write: read it again
            pass
        if time.monotonic() > deadline:
            logger.warning("wandb: %s was not fully written %.0fs after the run finished", path, timeout)
            return False
        time.sleep(0.01)


def _last_records(path: str) -> list[bytes] | None:
    """The complete records in the last two blocks of a W&B record file (None for an unknown format)."""
    with open(path, "rb") as f:
        header = f.read(len(_LOG_HEADER))
        if len(header) < len(_LOG_HEADER):
            return []  # the file was just created: its header comes next
        if header != _LOG_HEADER:
            return None
        size = os.fstat(f.fileno()).st_size
        start = max((size - 1) // _BLOCK - 1, 0) * _BLOCK  # a block boundary: a chunk starts there
        f.seek(start)
        data = f.read()
    end, pos = start + len(data), max(start, len(_LOG_HEADER))
    records, parts = [], None  # parts: the chunks of a split record, from its FIRST one
    while True:
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:  # too short for a chunk: zero padding up to the next block
            pos += left
            continue
        if pos + _CHUNK_HEADER > end:
            break
        _crc, length, kind = struct.unpack_from("<IHB", data, pos - start)
        chunk = data[pos - start + _CHUNK_HEADER:pos - start + _CHUNK_HEADER + length]
        if kind == 0 or len(chunk) < length:  # not written yet, or written only in part
            break
        pos += _CHUNK_HEADER + length
        if kind == _FULL:
            records.append(chunk)
        elif kind == _FIRST:
            parts = [chunk]
        elif parts is not None:  # MIDDLE or LAST of a record whose FIRST chunk we read
            parts.append(chunk)
            if kind == _LAST:
                records.append(b"".join(parts))
                parts = None
    return records
