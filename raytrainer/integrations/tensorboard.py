"""``report_to="tensorboard"``: scalars and the run's arguments as TensorBoard event files."""

from __future__ import annotations

import logging
import os
import socket
from datetime import datetime

from raytrainer.callbacks import TrainerCallback
from raytrainer.integrations._common import numeric, rewrite_logs

logger = logging.getLogger(__name__)


def default_logdir() -> str:
    """PyTorch's (and HF's) default: ``runs/<Mon DD_HH-MM-SS>_<host>``."""
    return os.path.join("runs", datetime.now().strftime("%b%d_%H-%M-%S") + "_" + socket.gethostname())


class TensorBoardCallback(TrainerCallback):
    """Writes every log as ``train/...`` / ``eval/...`` scalars at ``state.global_step``.

    The folder is ``TENSORBOARD_LOGGING_DIR``, else ``args.logging_dir``, else
    ``output_dir/runs/<time>_<host>`` (one subfolder per trial in a search).
    """

    on_driver = True
    same_on_every_rank = True

    def __init__(self, tb_writer=None):
        self.tb_writer = tb_writer
        self.logging_dir = None

    def _init_writer(self, args, state) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if self.logging_dir is None:  # chosen once: an evaluate() after train() writes to the same run
            log_dir = os.getenv("TENSORBOARD_LOGGING_DIR") or args.logging_dir
            if log_dir is None:
                log_dir = os.path.join(args.output_dir, default_logdir())
            if state.trial_name:
                log_dir = os.path.join(log_dir, state.trial_name)
            self.logging_dir = os.path.expanduser(log_dir)
        self.tb_writer = SummaryWriter(log_dir=self.logging_dir)

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if self.tb_writer is None:
            self._init_writer(args, state)
        self.tb_writer.add_text("args", args.to_json_string())
        model = kwargs.get("model")
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            self.tb_writer.add_text("model_config", config.to_json_string())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero:
            return
        if self.tb_writer is None:
            self._init_writer(args, state)
        skipped = sorted(set(logs or {}) - set(numeric(logs or {})))
        if skipped:
            logger.debug("tensorboard: not logging non-numeric values %s", skipped)
        for key, value in rewrite_logs(numeric(logs or {})).items():
            self.tb_writer.add_scalar(key, value, state.global_step)
        self.tb_writer.flush()

    def on_train_end(self, args, state, control, **kwargs):
        if self.tb_writer is not None:
            self.tb_writer.close()
            self.tb_writer = None
