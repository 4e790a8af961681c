"""``report_to="mlflow"``: the run's arguments as MLflow params, every log as metrics at the global step.

Configured as in HF, by environment variables read on the driver:

- ``MLFLOW_TRACKING_URI``: the tracking store or server (MLflow's default otherwise, e.g. a sqlite file)
- ``MLFLOW_EXPERIMENT_NAME``: the experiment (created when missing; MLflow's default experiment otherwise)
- ``MLFLOW_RUN_ID``: log into this existing run instead of creating one
- ``MLFLOW_TAGS``: a JSON object of tags for the run

It talks to the store through ``MlflowClient`` (no process-global active run is started).
"""

from __future__ import annotations

import json
import os
import time

from raytrainer.callbacks import TrainerCallback
from raytrainer.integrations._common import numeric

_MAX_PARAM_LENGTH = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000


class MLflowCallback(TrainerCallback):
    on_driver = True
    same_on_every_rank = True

    def __init__(self):
        self._client = None
        self.run_id: str | None = None
        self._created_run = False

    def setup(self, args, state, model=None) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        tracking_uri = os.getenv("MLFLOW_TRACKING_URI")
        self._client = MlflowClient(tracking_uri=tracking_uri)
        self.run_id = os.getenv("MLFLOW_RUN_ID")
        if not self.run_id:
            experiment_id = self._experiment_id(os.getenv("MLFLOW_EXPERIMENT_NAME"))
            tags = json.loads(os.getenv("MLFLOW_TAGS", "{}"))
            run = self._client.create_run(experiment_id, run_name=args.run_name or state.trial_name,
                                          tags=tags)
            self.run_id, self._created_run = run.info.run_id, True
        params = dict(args.to_dict())  # tokens are hidden by to_dict
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            params = {**config.to_dict(), **params}
        items = [Param(k, str(v)[:_MAX_PARAM_LENGTH]) for k, v in sorted(params.items())]
        for i in range(0, len(items), _PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=items[i:i + _PARAMS_PER_BATCH])

    def _experiment_id(self, name: str | None) -> str:
        if not name:
            return "0"  # MLflow's "Default" experiment
        experiment = self._client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment else self._client.create_experiment(name)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero and self._client is None:
            self.setup(args, state, model)

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        if self._client is None:
            self.setup(args, state, model)
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, state.global_step) for k, v in numeric(logs or {}).items()]
        for i in range(0, len(metrics), _METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i:i + _METRICS_PER_BATCH])

    def on_train_end(self, args, state, control, **kwargs):
        if self._client is not None and self._created_run:
            self._client.set_terminated(self.run_id)

    def __getstate__(self):  # shipped to the workers inside the Trainer: no client connection
        return {**self.__dict__, "_client": None}
