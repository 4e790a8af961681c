"""report_to on Ray workers: transformers' trackers run where transformers runs them under ``accelerate
launch``, on world rank 0, so each value is logged once (not once per worker), at its step, with the model's
config; their settings come from the driver's environment, set here after the session's Ray instance
started (its workers did not inherit them), as a running cluster's workers never inherit a script's."""

from __future__ import annotations

import os
import sqlite3

import pytest
from models import RecordRaytrainerFile, make_data, tiny_hf_regressor

import raytrainer
from raytrainer import Trainer, TrainingArguments


@pytest.mark.timeout(300)
def test_trackers_log_each_value_once_from_rank_zero_with_the_drivers_settings(tmp_path, monkeypatch):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "raytrainer-ray")
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), num_workers=2, report_to=["tensorboard", "mlflow"],
        run_name="ray-run", disable_tqdm=True, optim="sgd",
        learning_rate=0.1, per_device_train_batch_size=4, max_steps=6, logging_steps=2, eval_strategy="steps",
        eval_steps=3, save_strategy="no")
    where = RecordRaytrainerFile()
    trainer = Trainer(model_init=tiny_hf_regressor, args=args, train_dataset=make_data(48),
                      eval_dataset=make_data(16, seed=2), callbacks=[where])
    trainer.train()

    # the workers ran this checkout's raytrainer, in processes other than this one
    assert sorted(where.files) == [0]  # rank 0's callback state comes back to the driver's instance
    assert where.files[0][0] == raytrainer.__file__ and where.files[0][1] != os.getpid()

    losses = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    evals = [(e["step"], e["eval_loss"]) for e in trainer.state.log_history if "eval_loss" in e]
    assert [s for s, _ in losses] == [2, 4, 6] and [s for s, _ in evals] == [3, 6]

    # TensorBoard: one event file, written by rank 0's process (its pid is in the name), each value once
    (events,) = os.listdir(tmp_path / "tb")
    assert events.startswith("events.out.tfevents.") and f".{where.files[0][1]}." in events
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in got] == [2, 4, 6]
    assert [v for _, v in got] == pytest.approx([v for _, v in losses], rel=1e-6)
    got = [(e.step, e.value) for e in acc.Scalars("eval/loss")]
    assert [s for s, _ in got] == [3, 6]
    assert [v for _, v in got] == pytest.approx([v for _, v in evals], rel=1e-6)
    config = acc.Tensors("model_config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"model_type": "raytrainer-tiny-tracked"' in config

    # MLflow: one run, ended, each value once
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("raytrainer-ray").experiment_id])
    assert run.info.run_name == "ray-run" and run.info.status == "FINISHED"
    params = run.data.params
    # the arguments transformers' loop runs with, as under accelerate launch (not the Ray fields)
    assert params["model_type"] == "raytrainer-tiny-tracked" and params["learning_rate"] == "0.1"
    assert params["max_steps"] == "6" and "num_workers" not in params
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert [s for s, _ in history] == [2, 4, 6]
    assert [v for _, v in history] == pytest.approx([v for _, v in losses], rel=1e-6)
    with sqlite3.connect(tmp_path / "mlflow.db") as db:  # no other row of it anywhere in the store
        assert db.execute("select count(*) from metrics where key='loss'").fetchone()[0] == 3
