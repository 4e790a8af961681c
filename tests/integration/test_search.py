"""hyperparameter_search with 2 Ray workers per trial: Optuna (2 concurrent trials, a planted bad trial
pruned at its first evaluation, its workers stopped there by the driver) and Ray Tune (ASHA)."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import optuna
import pytest
import torch
from models import Regressor, SlowStepLog, make_data

from raytrainer import Trainer, TrainingArguments
from raytrainer.search import BestRun, TrialSummary

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _args(tmp_path, **kw) -> TrainingArguments:
    base = {"output_dir": str(tmp_path / "search"), "num_workers": 2, "report_to": "none",
            "disable_tqdm": True, "optim": "sgd", "per_device_train_batch_size": 8, "eval_strategy": "steps",
            "eval_steps": 2,
            "save_strategy": "steps", "save_steps": 2, "save_total_limit": 1, "max_steps": 12,
            "max_grad_norm": 0.0}
    base.update(kw)
    return TrainingArguments(**base)


def _record_model_init(folder: str):
    """model_init(trial) that leaves one file per call with the trial it got and the process it ran in."""

    def model_init(trial):
        if trial is not None:
            lr = trial.params["learning_rate"] if hasattr(trial, "params") else trial["learning_rate"]
            if hasattr(trial, "suggest_float"):  # an Optuna trial answers a suggestion hp_space made
                assert trial.suggest_float("learning_rate", 0.0, 1.0) == lr
            with open(os.path.join(folder, f"init-{os.getpid()}-{time.time_ns()}.json"), "w") as f:
                json.dump({"type": type(trial).__name__, "learning_rate": lr, "pid": os.getpid(),
                           "device": torch.empty(0).device.type}, f)  # the device it builds on
        return Regressor()

    return model_init


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _calls(folder: str) -> list[dict]:
    return [json.load(open(os.path.join(folder, n))) for n in sorted(os.listdir(folder))]


class Planted(optuna.samplers.BaseSampler):
    """Trial 0 learns (learning rate 0.5); trial 1 is the planted bad trial (0: it learns nothing)."""

    def infer_relative_search_space(self, study, trial):
        return {}

    def sample_relative(self, study, trial, search_space):
        return {}

    def sample_independent(self, study, trial, name, distribution):
        return (0.5, 0.0)[trial.number]


class StuckAtStart(optuna.pruners.BasePruner):
    """Prunes a trial whose evaluation loss has not moved below the untrained model's."""

    def __init__(self, start: float):
        self.start = start

    def prune(self, study, trial):
        return trial.intermediate_values[trial.last_step] >= self.start - 1e-4


@pytest.mark.timeout(300)
def test_optuna_two_workers_per_trial_prunes_planted_bad_trial(tmp_path):
    calls = tmp_path / "calls"
    calls.mkdir()
    eval_data = make_data(32, seed=5)
    trainer = Trainer(model_init=_record_model_init(str(calls)), args=_args(tmp_path, max_steps=40),
                      train_dataset=make_data(64), eval_dataset=eval_data)
    with torch.no_grad():  # the untrained model's eval loss (4 batches of 8: their mean is the mean)
        x, y = torch.stack([e["x"] for e in eval_data]), torch.tensor([e["labels"] for e in eval_data])
        start = torch.nn.functional.cross_entropy(Regressor().net(x), y).item()
    storage = f"sqlite:///{tmp_path / 'study.db'}"

    best = trainer.hyperparameter_search(
        hp_space=lambda t: {"learning_rate": t.suggest_float("learning_rate", 0.0, 1.0)}, n_trials=2,
        storage=storage, study_name="s", sampler=Planted(), pruner=StuckAtStart(start), n_jobs=2)

    assert isinstance(best, BestRun) and best.run_id == "0"
    assert 0.0 <= best.hyperparameters["learning_rate"] <= 1.0
    study = optuna.load_study(study_name="s", storage=storage)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "PRUNED"]
    assert study.trials[1].intermediate_values[2] == pytest.approx(start, abs=1e-5)
    good = TrialSummary.load(str(tmp_path / "search" / "run-0"))
    bad = TrialSummary.load(str(tmp_path / "search" / "run-1"))
    # the two trials ran at the same time (n_jobs=2), each on its own 2 workers
    assert min(t.datetime_complete for t in study.trials) > max(t.datetime_start for t in study.trials)
    # the objective is the best trial's last reported one, as Optuna recorded it
    assert best.objective == good.objective == study.best_value == good.evaluations[-1]["objective"]
    assert study.trials[0].intermediate_values[40] == good.objective
    assert good.global_step == 40 and len(good.evaluations) == 20
    # pruned at its first evaluation (step 2): the workers waited for the decision and stopped right there
    assert bad.pruned and [e["step"] for e in bad.evaluations] == [2]
    assert bad.global_step == 2, f"pruned trial ran on to step {bad.global_step}"
    # outputs per trial, rotation per trial (save_total_limit=1), the best checkpoint is committed
    assert [os.path.basename(p) for p in good.checkpoints] == ["checkpoint-40"]
    assert best.run_summary.best_checkpoint == str(tmp_path / "search" / "run-0" / "checkpoint-40")
    assert os.path.exists(os.path.join(best.run_summary.best_checkpoint, "manifest.json"))
    # model_init: built on each of the trial's 2 workers, with the trial's parameters; in this driver only
    # once per trial on the meta device (no weights), with the live trial, for suggestions it may make
    made = [c for c in _calls(str(calls)) if c["pid"] != os.getpid()]
    assert sorted((c["type"], c["learning_rate"], c["device"]) for c in made) == [
        ("SuggestedTrial", 0.0, "cpu")] * 2 + [("SuggestedTrial", 0.5, "cpu")] * 2
    assert all(len({c["pid"] for c in made if c["learning_rate"] == lr}) == 2 for lr in (0.0, 0.5))
    here = [c for c in _calls(str(calls)) if c["pid"] == os.getpid()]
    assert sorted((c["type"], c["learning_rate"], c["device"]) for c in here) == [
        ("Trial", 0.0, "meta"), ("Trial", 0.5, "meta")]


TOKEN = "hf_planted_tune_token_5e1f"


def _assert_token_nowhere(folder, bucket) -> None:
    """The planted hub token is in no file of the output folder, no object of the bucket (Tune's experiment
    and trial state, checkpoints, Ray Train's records), and no file of the Ray session (its logs)."""
    import ray

    session = ray._private.worker._global_node.get_session_dir_path()
    token = TOKEN.encode()
    places = 0
    for root in (str(folder), session):
        for dirpath, _, names in os.walk(root):
            for name in names:
                path = os.path.join(dirpath, name)
                if os.path.isfile(path) and not os.path.islink(path):
                    places += 1
                    with open(path, "rb") as f:
                        assert token not in f.read(), path
    for key in bucket.list_objects(""):
        places += 1
        assert token not in bucket.get_object(key), key
    assert places > 50  # the scan did read the run's files


@pytest.mark.timeout(300)
def test_ray_tune_with_num_workers_0_trains_each_trial_in_its_own_actor(tmp_path):
    """backend="ray" with ``num_workers=0``: Tune's trial actors each get a copy of the trainer (raytrainer's
    Trainer on transformers' loop is rebuilt there from its constructor's arguments: transformers'
    ``Accelerator`` does not pickle) and train it in their own process, model_init(trial) included."""
    from ray import tune

    calls = tmp_path / "calls"
    calls.mkdir()
    trainer = Trainer(model_init=_record_model_init(str(calls)),
                      args=_args(tmp_path, num_workers=0, max_steps=8, eval_steps=4, save_steps=4),
                      train_dataset=make_data(64), eval_dataset=make_data(32, seed=5))
    best = trainer.hyperparameter_search(
        hp_space=lambda _: {"learning_rate": tune.grid_search([0.0, 0.5])}, n_trials=1, backend="ray",
        max_concurrent_trials=1)
    assert best.hyperparameters == {"learning_rate": 0.5}  # 0.0 learns nothing
    made = _calls(str(calls))
    assert sorted(c["learning_rate"] for c in made) == [0.0, 0.5]  # once per trial, with its values
    assert os.getpid() not in {c["pid"] for c in made}  # in the trial actors, not this process
    for trial_id in os.listdir(tmp_path / "search"):
        if trial_id.startswith("run-"):
            ran = TrialSummary.load(str(tmp_path / "search" / trial_id))
            assert ran.global_step == 8 and len(ran.evaluations) == 2, (trial_id, ran)
    assert trainer.evaluate()["eval_loss"] > 0  # the caller's trainer still works in this process
    assert best.objective < TrialSummary.load(
        str(tmp_path / "search" / next(n for n in os.listdir(tmp_path / "search")
                                       if n.startswith("run-") and n != f"run-{best.run_id}"))).objective


@pytest.mark.timeout(600)
def test_ray_tune_asha_two_workers_per_trial(tmp_path, s3_bucket, caplog, monkeypatch, capfd):
    """With storage_path in a bucket (the S3 test server): Tune's experiment folder and every trial's
    run-<id> folder are there. A planted hub token is nowhere in them, nor in Ray's session files.
    One trial at a time, so ASHA's decisions are known: trial 0.5 runs to the end (first at every rung),
    trial 0.0 is stopped at its first evaluation (worse than 0.5 there), and every trial after it runs on
    the same warm workers -- the stopped trial's group included."""
    import cloudpickle
    from ray import tune
    from ray.tune import with_parameters
    from ray.tune.schedulers import ASHAScheduler
    from ray_state import live_placement_groups

    calls = tmp_path / "calls"
    calls.mkdir()
    storage = f"{s3_bucket.uri}/search"
    args = _args(tmp_path, max_steps=16, eval_steps=4, save_steps=4, storage_path=storage, push_to_hub=True,
                 hub_model_id=f"file://{tmp_path}/hub", hub_token=TOKEN, disable_tqdm=False)
    trainer = Trainer(model_init=_record_model_init(str(calls)), args=args, train_dataset=make_data(64),
                      eval_dataset=make_data(32, seed=5))
    rates = [0.5, 0.0, 0.2, 1e-4]
    given = []  # what goes into Tune's trial state: the arguments of tune.with_parameters (the real one runs)
    monkeypatch.setattr(tune, "with_parameters",
                        lambda trainable, **kw: given.append(kw) or with_parameters(trainable, **kw))
    sigint_before = signal.getsignal(signal.SIGINT)
    groups_before = live_placement_groups()
    with caplog.at_level("WARNING", logger="raytrainer"):
        best = trainer.hyperparameter_search(
            hp_space=lambda _: {"learning_rate": tune.grid_search(rates)}, n_trials=1, backend="ray",
            scheduler=ASHAScheduler(time_attr="training_iteration", max_t=4, grace_period=1,
                                    reduction_factor=2),
            max_concurrent_trials=1)
    assert "the trials do not push to the Hub" in caplog.text and not (tmp_path / "hub").exists()
    # Tune's own Ctrl-C handler is gone again: the next Ctrl-C interrupts the caller's next call
    after = signal.getsignal(signal.SIGINT)
    assert after is sigint_before and getattr(after, "__name__", "") != "signal_interrupt_tune_run", after
    console = "".join(capfd.readouterr())  # a line per trial start and end, none of Tune's status tables
    assert console.count(" started: {'learning_rate': ") == 4 and console.count(" trial(s) ended)") == 4
    # while they ran: a status line per running trial, redrawn at each of its evaluations
    assert re.search(r"trial \w+: step 4, 1 evaluation\(s\), objective [0-9.]+", console), console[-3000:]
    for tune_table in ("Trial status:", "Configuration for experiment", "Current time:", "View detailed"):
        assert tune_table not in console, tune_table
    assert trainer.args.hub_token == TOKEN and trainer.args.push_to_hub  # the caller's arguments, untouched
    assert len(given) == 1 and TOKEN.encode() not in given[0]["spec"]
    assert cloudpickle.loads(given[0]["spec"]).args.hub_token is None
    _assert_token_nowhere(tmp_path, s3_bucket)

    assert isinstance(best, BestRun) and best.hyperparameters["learning_rate"] in rates
    results = tune.ExperimentAnalysis(f"{storage}/.raytrainer/tune")  # Tune's records, with raytrainer's
    last = {df["run_id"].iloc[-1]: df for df in results.trial_dataframes.values() if len(df)}
    assert len(last) == 4
    # the best run's objective is the lowest last-reported objective of all trials (scope "last")
    finals = {tid: df["objective"].iloc[-1] for tid, df in last.items()}
    assert best.objective == min(finals.values()) == finals[best.run_id]
    # ASHA stopped at least one trial before its 4th evaluation, and its workers stopped right there
    iterations = {tid: len(df) for tid, df in last.items()}
    assert max(iterations.values()) == 4 and min(iterations.values()) < 4, iterations
    for tid, df in last.items():
        ran = TrialSummary.load(str(tmp_path / "search" / f"run-{tid}"))
        assert ran.global_step == df["global_step"].iloc[-1] == 4 * len(df), (tid, ran.global_step)
    summary = best.run_summary
    assert summary.output_dir == str(tmp_path / "search" / f"run-{best.run_id}")
    assert summary.best_checkpoint.startswith(f"{storage}/run-{best.run_id}/checkpoint-")
    committed = s3_bucket.committed(f"search/run-{best.run_id}")  # manifests match the objects
    assert summary.best_checkpoint.rsplit("/", 1)[1] in committed
    # model_init: on each of the trial's 2 workers (not in the Tune trial actor), with the Tune config dict
    made = _calls(str(calls))
    assert sorted(c["learning_rate"] for c in made) == sorted(rates * 2)
    assert {c["type"] for c in made} == {"dict"}
    assert all(len({c["pid"] for c in made if c["learning_rate"] == lr}) == 2 for lr in rates)
    # warm workers: every trial ran on the first trial's 2 worker processes, in the grid's order, and the one
    # ASHA stopped at its first evaluation (0.0) left its group to the next trial (0.2)
    assert len({c["pid"] for c in made}) == 2, made
    in_time = sorted(os.listdir(calls), key=lambda n: int(n.rsplit("-", 1)[1].split(".")[0]))
    assert [json.loads((calls / n).read_text())["learning_rate"] for n in in_time][::2] == rates
    rate_of = {tid: TrialSummary.load(str(tmp_path / "search" / f"run-{tid}")).hyperparameters[
        "learning_rate"] for tid in last}
    evaluated = {rate_of[tid]: n for tid, n in iterations.items()}
    assert evaluated[0.5] == 4 and evaluated[0.0] == 1, evaluated
    # ...and no group outlives the search: Tune ended the trial's actor, which closed its group
    deadline = time.time() + 60
    while any(_alive(c["pid"]) for c in made) and time.time() < deadline:
        time.sleep(1)
    assert not any(_alive(c["pid"]) for c in made), made
    # nor a placement group: the trials' and their worker groups' are gone (no State API, so no Ray Train
    # cleaner on this instance: Ray Train's controllers and the search remove them)
    while live_placement_groups() - groups_before and time.time() < deadline:
        time.sleep(1)
    assert not live_placement_groups() - groups_before


@pytest.mark.timeout(400)
def test_a_ray_tune_trial_whose_actor_dies_gives_back_its_worker_group_s_placement_group_at_once(tmp_path):
    """Two trials, one at a time. Trial 0's actor is SIGKILLed while its worker group trains: its Ray Train
    controller dies with it, and the worker group's placement group -- which Ray keeps for as long as the
    search's driver lives -- is removed while trial 1 trains, not when the search ends (before: it held
    the 2 CPUs of its workers until then)."""
    import threading

    from ray import tune
    from ray_state import alive_actors

    from raytrainer.driver.ray_train import orphaned_placement_groups

    steps = tmp_path / "steps"
    args = _args(tmp_path, max_steps=40, eval_steps=20, save_steps=20)
    trainer = Trainer(model_init=lambda trial: Regressor(), args=args, train_dataset=make_data(64),
                      eval_dataset=make_data(16, seed=5), callbacks=[SlowStepLog(str(steps), 0.3)])
    found: dict = {}

    def search():
        try:
            found["best"] = trainer.hyperparameter_search(
                hp_space=lambda _: {"learning_rate": tune.grid_search([0.1, 0.2])}, n_trials=1, backend="ray",
                max_concurrent_trials=1)
        except BaseException as exc:  # raised in the test's thread below
            found["error"] = exc

    def groups() -> list[list[int]]:  # the steps rank 0 logged, per worker group
        lines = [line.split() for line in steps.read_text().splitlines()] if steps.exists() else []
        pids = list(dict.fromkeys(pid for pid, _ in lines))
        return [[int(s) for pid, s in lines if pid == p] for p in pids]

    def wait_for(what, done, timeout=180):
        deadline = time.time() + timeout
        while not done():
            assert time.time() < deadline, f"no {what} within {timeout} s: {found}"
            assert thread.is_alive() or what == "the search's end", f"the search ended before {what}: {found}"
            time.sleep(0.2)

    thread = threading.Thread(target=search, daemon=True)
    thread.start()
    wait_for("step 3 of trial 0", lambda: groups() and len(groups()[0]) >= 3)
    trials = [a for a in alive_actors() if a["ActorClassName"].endswith("ResourceTrainable")]  # Tune's
    assert len(trials) == 1, [a["ActorClassName"] for a in alive_actors()]
    (trial_actor,) = trials
    os.kill(trial_actor["Pid"], signal.SIGKILL)
    wait_for("step 3 of trial 1", lambda: len(groups()) == 2 and len(groups()[1]) >= 3)
    # trial 0's worker group's placement group is gone while trial 1 still trains
    wait_for("removal of trial 0's worker group's placement group", lambda: not orphaned_placement_groups(),
             timeout=30)
    assert len(groups()[1]) < 40  # trial 1 still trained then
    wait_for("the search's end", lambda: not thread.is_alive(), timeout=240)
    assert "error" not in found, found
    assert found["best"].hyperparameters == {"learning_rate": 0.2}  # the one trial that ended
    assert groups()[0][-1] < 40 and groups()[1][-1] == 40
