"""report_to integrations against the real trackers: TensorBoard event files read back with TensorBoard's
own reader, an MLflow sqlite store read back with MlflowClient, W&B in offline mode. In-process runs
(num_workers=0); the Ray path (events relayed to the driver, logged once) is in tests/integration."""

from __future__ import annotations

import glob
import json
import os

import pytest

from raytrainer import Trainer
from raytrainer.integrations import get_available_reporting_integrations, get_reporting_integration_callbacks
from raytrainer.integrations.wandb import wait_for_record_file

TOKEN = "hf_integration_secret_token_123"


def _train(make_args, make_classifier, make_examples, report_to, **overrides):
    train, _, _ = make_examples(32)
    evaluation, _, _ = make_examples(16, seed=1)
    args = make_args(report_to=report_to, per_device_train_batch_size=8, num_train_epochs=2,
                     logging_steps=2, eval_strategy="epoch", learning_rate=0.1, run_name="unit-run",
                     hub_token=TOKEN, **overrides)
    trainer = Trainer(model=make_classifier(), args=args, train_dataset=train, eval_dataset=evaluation)
    trainer.train()
    return trainer


def _logged(trainer, key):
    """(step, value) of every log entry holding ``key``, from the Trainer's own log history."""
    return [(e["step"], e[key]) for e in trainer.state.log_history if key in e]


def _same(got, want):
    """Equal steps, values equal to float32 precision (trackers store float32 or float64)."""
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)


def test_report_to_errors_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"report_to='comet_nope'.*tensorboard"):
        get_reporting_integration_callbacks(["comet_nope"])
    assert get_reporting_integration_callbacks("none") == []
    assert {c.__name__ for c in get_reporting_integration_callbacks("all")} >= {"TensorBoardCallback"}
    assert set(get_available_reporting_integrations()) == {"tensorboard", "mlflow", "wandb"}


def test_tensorboard_event_files_hold_the_logged_metrics(tmp_path, make_args, make_classifier,
                                                        make_examples):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = _train(make_args, make_classifier, make_examples, "tensorboard",
                     logging_dir=str(tmp_path / "tb"))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert {"train/loss", "train/learning_rate", "eval/loss", "train/train_loss"} <= set(scalars)
    got = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    want = _logged(trainer, "loss")
    assert len(got) == len(want) == 4  # 8 steps, logging_steps=2
    assert [s for s, _ in got] == [s for s, _ in want] == [2, 4, 6, 8]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)
    evals = [(e.step, e.value) for e in acc.Scalars("eval/loss")]
    _same(evals, _logged(trainer, "eval_loss"))
    args_text = acc.Tensors("args/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(args_text)["learning_rate"] == 0.1
    assert TOKEN not in args_text and "<HUB_TOKEN>" in args_text


def test_mlflow_sqlite_store_holds_params_and_metrics(tmp_path, monkeypatch, make_args, make_classifier,
                                                     make_examples):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "raytrainer-unit")
    trainer = _train(make_args, make_classifier, make_examples, ["mlflow"])
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("raytrainer-unit")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == "unit-run" and run.info.status == "FINISHED"
    assert run.data.params["learning_rate"] == "0.1"
    assert run.data.params["num_train_epochs"] == "2"
    assert run.data.params["hub_token"] == "<HUB_TOKEN>"
    assert TOKEN not in json.dumps(run.data.params)
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    _same(history, _logged(trainer, "loss"))
    evals = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_loss"))
    _same(evals, _logged(trainer, "eval_loss"))
    assert [s for s, _ in evals] == [4, 8]


def test_wandb_offline_run_is_written(tmp_path, monkeypatch, make_args, make_classifier, make_examples):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_PROJECT", "raytrainer-unit")
    trainer = _train(make_args, make_classifier, make_examples, "wandb")
    runs = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*"))
    assert len(runs) == 1
    (path,) = glob.glob(os.path.join(runs[0], "run-*.wandb"))
    # train() returned: the file is complete, its last block (with the exit record) already on disk. Read
    # once, no waiting: wandb-core writes that block only after finish() returns (see wait_for_record_file).
    assert wait_for_record_file(path, timeout=0), "train() returned before the W&B record file was written"
    # wandb 0.31 ships no reader for its offline record file (a protobuf log that `wandb sync` uploads);
    # the records hold the keys and JSON values as plain bytes, which is what we check here.
    with open(path, "rb") as f:
        records = f.read()
    for key in (b"train/loss", b"eval/loss", b"train/global_step", b"learning_rate", b"unit-run"):
        assert key in records, (key, len(records))
    final_eval = _logged(trainer, "eval_loss")[-1][1]
    assert json.dumps(final_eval).encode() in records  # the value logged, as W&B's JSON encodes it
    assert TOKEN.encode() not in records
    assert trainer.state.global_step == 8


def test_wandb_wait_for_record_file_returns_once_the_last_block_is_written(tmp_path, monkeypatch):
    """wandb-core writes a run's last block when it closes the run's stream, just after run.finish()
    returns: the callback waits for it. Simulated here with a file whose tail arrives late."""
    import threading
    import time

    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="raytrainer-unit", dir=str(tmp_path), reinit="create_new")
    for step in range(200):  # enough for several 32 KiB blocks, and records split across two blocks
        run.log({f"train/metric_{k}": step + k / 7 for k in range(20)})
    finished = run.settings.sync_file
    run.finish()
    assert wait_for_record_file(finished)
    with open(finished, "rb") as f:
        complete = f.read()
    block = 32 * 1024
    assert len(complete) > 3 * block

    late = tmp_path / "late.wandb"
    late.write_bytes(complete[:len(complete) // block * block])  # the full blocks: written as they fill

    def write_the_rest():
        with open(late, "ab") as f:
            f.write(complete[len(complete) // block * block:])  # the last block: when the stream closes

    writer = threading.Timer(0.3, write_the_rest)
    start = time.monotonic()
    writer.start()
    assert wait_for_record_file(str(late))
    assert time.monotonic() - start >= 0.3
    writer.join()
    assert late.read_bytes() == complete

    unfinished = tmp_path / "unfinished.wandb"
    unfinished.write_bytes(complete[:7])
    assert not wait_for_record_file(str(unfinished), timeout=0.2)  # never completed: gives up, no error
    unknown = tmp_path / "unknown.wandb"
    unknown.write_bytes(b"not a W&B record file")
    assert not wait_for_record_file(str(unknown))  # a format it does not read: no waiting
    assert not wait_for_record_file(str(tmp_path / "missing.wandb"))
