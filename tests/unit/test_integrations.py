"""report_to: transformers' own integration callbacks against the real trackers, each read back from what it
wrote -- TensorBoard event files (TensorBoard's reader), an MLflow sqlite store (MlflowClient), a W&B offline
run's record file, codecarbon's emissions.csv, DVCLive's files, a Trackio project database (Trackio's
storage). In-process runs (num_workers=0); a 2-worker run logging once from the driver is in
tests/integration/test_trackers.py."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap

import cloudpickle
import pytest
import torch
import transformers
from torch import nn
from tracker_records import offline_runs, wandb_config, wandb_history, wandb_records
from transformers import PretrainedConfig, PreTrainedModel
from transformers.integrations import integration_utils as hf

from raytrainer import Trainer, TrainerCallback
from raytrainer.integrations import (
    PACKAGES,
    for_trial,
    get_reporting_integration_callbacks,
    is_tracker,
    runs_on_driver,
)
from raytrainer.search.common import check_picklable

TOKEN = "hf_integration_secret_token_123"


class TinyConfig(PretrainedConfig):
    model_type = "raytrainer-tiny-tracker"

    def __init__(self, in_features: int = 4, num_labels: int = 3, **kwargs):
        self.in_features = in_features
        super().__init__(num_labels=num_labels, **kwargs)


class TinyHFClassifier(PreTrainedModel):
    """A transformers model (it has a ``config``, which the trackers log) as small as conftest's."""

    config_class = TinyConfig

    def __init__(self, config):
        super().__init__(config)
        self.linear = nn.Linear(config.in_features, config.num_labels)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        if labels is None:
            return {"logits": logits}
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def _model():
    torch.manual_seed(0)
    return TinyHFClassifier(TinyConfig())


def _train(make_args, make_examples, report_to, **overrides):
    train, _, _ = make_examples(32)
    evaluation, _, _ = make_examples(16, seed=1)
    args = make_args(report_to=report_to, per_device_train_batch_size=8, num_train_epochs=2,
                     logging_steps=2, eval_strategy="epoch", learning_rate=0.1, run_name="unit-run",
                     hub_token=TOKEN, **overrides)
    trainer = Trainer(model=_model(), args=args, train_dataset=train, eval_dataset=evaluation)
    trainer.train()
    return trainer


def _logged(trainer, key):
    """(step, value) of every log entry holding ``key``, from the Trainer's own log history."""
    return [(e["step"], e[key]) for e in trainer.state.log_history if key in e]


def _same(got, want):
    """Equal steps (each logged once), values equal to float32 precision."""
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)


# -- names and refusals ------------------------------------------------------------------------------------
def test_report_to_takes_transformers_names_and_refuses_bad_ones_when_the_trainer_is_built(
        make_args, make_examples):
    assert set(PACKAGES) == set(hf.INTEGRATION_TO_CALLBACK)  # the install hints cover every name
    assert get_reporting_integration_callbacks("none") == get_reporting_integration_callbacks([]) == []
    assert get_reporting_integration_callbacks(["tensorboard", "codecarbon"]) == [
        hf.TensorBoardCallback, hf.CodeCarbonCallback]
    assert get_reporting_integration_callbacks("all") == [
        hf.INTEGRATION_TO_CALLBACK[n] for n in hf.get_available_reporting_integrations()]

    train, _, _ = make_examples(8)
    with pytest.raises(ValueError, match=r"report_to='tensorbord' is not an integration transformers knows"
                                         r".*codecarbon.*tensorboard.*trackio.*wandb"):
        Trainer(model=_model(), args=make_args(report_to="tensorbord", num_workers=2), train_dataset=train)

    missing = [n for n, (modules, _) in PACKAGES.items()
               if modules and not all(hf.importlib.util.find_spec(m.split("|")[0].split(".")[0])
                                      for m in modules)]
    assert missing, "every tracker package is installed here: nothing to check the refusal with"
    name = missing[0]
    package = PACKAGES[name][0][0].split("|")[0]
    with pytest.raises(ValueError, match=rf"report_to='{name}' needs the '{package}' package.*"
                                         rf"pip install {PACKAGES[name][1]}"):
        Trainer(model=_model(), args=make_args(report_to=["tensorboard", name], num_workers=2),
                train_dataset=train)


def test_trackers_run_on_the_driver_and_never_travel_to_the_workers(make_args, make_examples, tmp_path,
                                                                     monkeypatch):
    """Pickled for the workers, the Trainer carries a stand-in per tracker (a codecarbon tracker, an open
    writer need not pickle); a search trial's process builds the tracker anew from it."""
    train, _, _ = make_examples(8)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))  # transformers 5's setting
    trainer = Trainer(model=_model(), args=make_args(report_to=["tensorboard", "codecarbon"]),
                      train_dataset=train)
    assert all(runs_on_driver(cb) for cb in trainer.callback_handler.callbacks[1:3])
    trackers = [cb for cb in trainer.callback_handler.callbacks if is_tracker(cb)]
    assert [type(cb) for cb in trackers] == [hf.TensorBoardCallback, hf.CodeCarbonCallback]
    assert trackers[1].tracker is not None  # built by on_init_end, in this process
    trackers[0].tb_writer = trackers[0]._SummaryWriter(log_dir=str(tmp_path / "tb"))  # an open writer
    with pytest.raises(TypeError):  # a thread lock, among others
        cloudpickle.dumps(trackers[0])

    shipped = cloudpickle.loads(cloudpickle.dumps(trainer)).callback_handler.callbacks
    # the copy is built anew from the constructor's arguments, its trackers from report_to
    theirs = [cb for cb in shipped if is_tracker(cb)]
    assert [type(cb) for cb in theirs] == [hf.TensorBoardCallback, hf.CodeCarbonCallback]
    assert not {id(cb) for cb in theirs} & {id(cb) for cb in trackers}
    assert theirs[0].tb_writer is None and theirs[0].logging_dir == str(tmp_path / "tb")
    assert trainer.callback_handler.callbacks[1] is trackers[0]  # the driver keeps its own

    # a search's picklability preflight leaves the trackers out; each trial gets its own
    check_picklable(trainer)
    for tracker in trackers:
        mine = for_trial(tracker, trainer.args)
        assert type(mine) is type(tracker) and mine is not tracker
    assert for_trial(trainer.callback_handler.callbacks[0], trainer.args) is None  # not a tracker
    trackers[0].tb_writer.close()


# -- each tracker, read back ---------------------------------------------------------------------------------
def test_tensorboard_event_files_hold_each_logged_value_once(tmp_path, make_args, make_examples, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    trainer = _train(make_args, make_examples, "tensorboard")
    assert len([f for f in os.listdir(tmp_path / "tb") if f.startswith("events.out.tfevents")]) == 1
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/learning_rate", "eval/loss", "train/train_loss"} <= scalars
    got = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in got] == [2, 4, 6, 8]  # 8 steps, logging_steps=2
    _same(got, _logged(trainer, "loss"))
    _same([(e.step, e.value) for e in acc.Scalars("eval/loss")], _logged(trainer, "eval_loss"))
    args_text = acc.Tensors("args/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(args_text)["learning_rate"] == 0.1
    assert TOKEN not in args_text
    config = json.loads(acc.Tensors("model_config/text_summary")[0].tensor_proto.string_val[0].decode())
    assert config["model_type"] == "raytrainer-tiny-tracker" and config["in_features"] == 4


def test_mlflow_sqlite_store_holds_params_config_and_metrics(tmp_path, monkeypatch, make_args, make_examples):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "raytrainer-unit")
    trainer = _train(make_args, make_examples, ["mlflow"])
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("raytrainer-unit").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == "unit-run" and run.info.status == "FINISHED"
    params = run.data.params
    assert params["learning_rate"] == "0.1" and params["num_train_epochs"] == "2"
    assert params["model_type"] == "raytrainer-tiny-tracker" and params["in_features"] == "4"  # model.config
    assert TOKEN not in json.dumps(params)
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    _same(history, _logged(trainer, "loss"))
    evals = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_loss"))
    assert [s for s, _ in evals] == [4, 8]
    _same(evals, _logged(trainer, "eval_loss"))


def test_wandb_offline_run_holds_each_logged_value_once(tmp_path, monkeypatch, make_args, make_examples):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_PROJECT", "raytrainer-unit")
    os.makedirs(tmp_path / "wb")
    try:
        trainer = _train(make_args, make_examples, "wandb")
    finally:
        wandb.finish()  # transformers' callback leaves the run open (an evaluate() after train() logs to it)
    (run,) = offline_runs(tmp_path / "wb")
    (path,) = [os.path.join(run, f) for f in os.listdir(run) if f.endswith(".wandb")]
    records = wandb_records(path)
    assert any(r.HasField("exit") for r in records)
    history = wandb_history(records)
    losses = [(h["train/global_step"], h["train/loss"]) for h in history if "train/loss" in h]
    _same(losses, _logged(trainer, "loss"))
    evals = [(h["train/global_step"], h["eval/loss"]) for h in history if "eval/loss" in h]
    _same(evals, _logged(trainer, "eval_loss"))
    config = wandb_config(records)
    assert config["learning_rate"] == 0.1 and config["in_features"] == 4
    assert config["model/num_parameters"] == 15
    assert any(r.HasField("run") and r.run.display_name == "unit-run" for r in records)
    with open(path, "rb") as f:
        assert TOKEN.encode() not in f.read()


def test_codecarbon_writes_one_emissions_row_for_the_run(tmp_path, monkeypatch, make_args, make_examples):
    """codecarbon offline: no location service reachable, it falls back to its default country."""
    monkeypatch.setenv("CODECARBON_LOG_LEVEL", "error")
    trainer = _train(make_args, make_examples, "codecarbon")
    with open(tmp_path / "emissions.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1  # one tracker, in this process
    runtime = trainer.state.log_history[-1]["train_runtime"]
    assert 0 < float(rows[0]["duration"]) < runtime + 5
    assert float(rows[0]["energy_consumed"]) > 0


def test_dvclive_files_hold_each_logged_value_once(tmp_path, monkeypatch, make_args, make_examples):
    """DVCLive writes ``dvclive/`` in the working directory; its step is its own count of on_log calls."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    trainer = _train(make_args, make_examples, "dvclive", output_dir=str(tmp_path / "out"))

    def tsv(name):
        with open(tmp_path / "dvclive" / "plots" / "metrics" / name) as f:
            rows = list(csv.reader(f, delimiter="\t"))[1:]  # after the header
        return [(int(step), float(value)) for step, value in rows]

    history = trainer.state.log_history
    _same(tsv("loss.tsv"), [(i, e["loss"]) for i, e in enumerate(history) if "loss" in e])
    _same(tsv("eval/loss.tsv"), [(i, e["eval_loss"]) for i, e in enumerate(history) if "eval_loss" in e])
    with open(tmp_path / "dvclive" / "params.yaml") as f:
        params = f.read()
    assert "learning_rate: 0.1\n" in params and "run_name: unit-run\n" in params and TOKEN not in params


def test_trackio_local_project_holds_each_logged_value_once(tmp_path, make_examples):
    """Trackio reads TRACKIO_DIR when it is imported: the run and the read-back are in a fresh process."""
    script = textwrap.dedent(f"""
        import json, sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_integrations import _model
        from raytrainer import Trainer, TrainingArguments
        g = torch.Generator().manual_seed(0)
        data = [{{"x": torch.randn(4, generator=g), "labels": torch.tensor(i % 3)}} for i in range(32)]
        args = TrainingArguments(
            output_dir={str(tmp_path / "out")!r}, num_workers=0, report_to="trackio",
            project="raytrainer-unit", run_name="unit-run", per_device_train_batch_size=8,
            num_train_epochs=2, logging_steps=2, eval_strategy="epoch", learning_rate=0.1,
            disable_tqdm=True, save_strategy="no")
        trainer = Trainer(model=_model(), args=args, train_dataset=data, eval_dataset=data[:16])
        trainer.train()
        from trackio.sqlite_storage import SQLiteStorage
        print("RESULT", json.dumps({{"runs": SQLiteStorage.get_runs("raytrainer-unit"),
                                    "logs": SQLiteStorage.get_logs("raytrainer-unit", "unit-run"),
                                    "config": SQLiteStorage.get_run_config("raytrainer-unit", "unit-run"),
                                    "history": trainer.state.log_history}}, default=str))
    """)
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert result["runs"] == ["unit-run"]
    want = [(e["step"], e["loss"]) for e in result["history"] if "loss" in e]
    got = [(e["train/global_step"], e["train/loss"]) for e in result["logs"] if "train/loss" in e]
    _same(got, want)
    assert [s for s, _ in got] == [2, 4, 6, 8]
    assert result["config"]["learning_rate"] == 0.1 and result["config"]["in_features"] == 4


class _TrialSeen(TrainerCallback):
    """Records what each trial's run tells its callbacks about the trial (copies of it run in each trial)."""

    seen: list = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.seen.append((state.is_hyper_param_search, state.trial_name, dict(state.trial_params or {})))


def test_each_search_trial_reports_to_its_own_tracker_run(tmp_path, monkeypatch, make_args, make_examples):
    """transformers starts a tracker run per trial; here each trial gets its own tracker instances, and its
    state says which trial it is (is_hyper_param_search, trial_name, trial_params), as transformers' does."""
    import optuna
    from mlflow import MlflowClient

    from raytrainer.search.common import TrialSummary

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "raytrainer-search")
    train, _, _ = make_examples(32)
    monkeypatch.setenv("CODECARBON_LOG_LEVEL", "error")
    args = make_args(report_to=["mlflow", "codecarbon"], per_device_train_batch_size=8, num_train_epochs=1,
                     logging_steps=2, eval_strategy="epoch", output_dir=str(tmp_path / "search"))
    _TrialSeen.seen.clear()
    trainer = Trainer(model_init=_model, args=args, train_dataset=train, eval_dataset=train[:16],
                      callbacks=[_TrialSeen()])
    trainer.hyperparameter_search(
        hp_space=lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 0.01, 0.2)},
        n_trials=2, backend="optuna", sampler=optuna.samplers.RandomSampler(seed=0))

    lrs = [TrialSummary.load(str(tmp_path / "search" / f"run-{i}")).hyperparameters["learning_rate"]
           for i in range(2)]
    assert lrs[0] != lrs[1]
    # transformers' loop names a trial by hp_name only (None without one); raytrainer's own loop by its number
    one_loop = issubclass(Trainer, transformers.Trainer)
    assert _TrialSeen.seen == [(True, None if one_loop else str(i), {"learning_rate": lr})
                               for i, lr in enumerate(lrs)]
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("raytrainer-search").experiment_id],
                              order_by=["attributes.start_time ASC"])
    assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)
    assert [float(r.data.params["learning_rate"]) for r in runs] == lrs
    for run in runs:
        assert run.data.params["model_type"] == "raytrainer-tiny-tracker"
        history = sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss"))
        assert history == [2, 4]  # each trial's own losses, once
    for i in range(2):  # codecarbon: each trial's tracker, built for the trial's output_dir
        with open(tmp_path / "search" / f"run-{i}" / "emissions.csv") as f:
            assert len(list(csv.DictReader(f))) == 1
