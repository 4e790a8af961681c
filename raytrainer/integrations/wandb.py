"""``report_to="wandb"``: Weights & Biases. ``WANDB_MODE=offline`` keeps the run on disk (``wandb sync``
uploads it later); ``WANDB_PROJECT`` names the project (``huggingface`` by default, as in HF);
``WANDB_DIR`` is where runs are written (``output_dir`` by default)."""

from __future__ import annotations

import os

from raytrainer.callbacks import TrainerCallback
from raytrainer.integrations._common import numeric, rewrite_logs


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
        if self._run is not None:
            self._run.finish()
            self._run = None

    def __getstate__(self):  # shipped to the workers inside the Trainer: no live run
        return {**self.__dict__, "_run": None}
