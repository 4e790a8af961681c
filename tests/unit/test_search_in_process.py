"""hyperparameter_search in-process (num_workers=0): HF semantics, Optuna pruning, resuming a sqlite study,
multi-objective, argument checks and the picklability preflight. The distributed runs are in
tests/integration/test_search.py (the basename differs: the whole suite runs in one pytest session
without packages, where two test_search.py files would clash)."""

from __future__ import annotations

import logging
import math
import threading

import optuna
import pytest
import torch
import transformers.trainer_utils

from raytrainer import Trainer, TrainerCallback
from raytrainer.search import BestRun, default_compute_objective
from raytrainer.search.common import TrialSummary, default_hp_space_optuna, default_hp_space_ray

optuna.logging.set_verbosity(optuna.logging.WARNING)


class TinyClassifier(torch.nn.Module):
    """conftest's TinyClassifier (the test modules cannot import conftest: the integration tests have one
    too, and a whole-suite run imports that one as ``conftest``)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        if labels is None:
            return {"logits": logits}
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def _space(trial):
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 0.5, log=True),
            "per_device_train_batch_size": trial.suggest_categorical("per_device_train_batch_size", [8, 16])}


class _Recorder:
    """model_init that records the trial it was given (and builds a seeded TinyClassifier)."""

    def __init__(self):
        self.calls = []

    def __call__(self, trial):
        self.calls.append(trial)
        return TinyClassifier()


def _tiny():
    return TinyClassifier()


def _trainer(make_args, data, model_init, **args):
    defaults = {"eval_strategy": "epoch", "num_train_epochs": 2}
    return Trainer(model_init=model_init, args=make_args(**{**defaults, **args}), train_dataset=data,
                   eval_dataset=data[:32])


def test_default_objective_is_eval_loss_or_sum_of_metrics():
    assert default_compute_objective is transformers.trainer_utils.default_compute_objective
    assert default_compute_objective({"eval_loss": 0.7, "epoch": 2.0, "eval_runtime": 3.0}) == 0.7
    metrics = {"eval_loss": 0.7, "eval_accuracy": 0.5, "eval_f1": 0.25, "eval_samples_per_second": 9.0,
               "eval_steps_per_second": 1.0, "epoch": 1.0}
    assert default_compute_objective(metrics) == 0.75


def test_default_spaces_are_hf_spaces():
    assert default_hp_space_optuna is transformers.trainer_utils.default_hp_space_optuna
    assert default_hp_space_ray is transformers.trainer_utils.default_hp_space_ray
    study = optuna.create_study()
    for _ in range(20):
        params = default_hp_space_optuna(study.ask())
        assert 1e-6 <= params["learning_rate"] <= 1e-4
        assert params["num_train_epochs"] in range(1, 6) and params["seed"] in range(1, 41)
        assert params["per_device_train_batch_size"] in (4, 8, 16, 32, 64)
    space = default_hp_space_ray(None)
    assert (space["learning_rate"].lower, space["learning_rate"].upper) == (1e-6, 1e-4)
    assert sorted(space["per_device_train_batch_size"].categories) == [4, 8, 16, 32, 64]
    assert sorted(space["num_train_epochs"].categories) == [1, 2, 3, 4, 5]


def test_a_float_seed_from_the_ray_space_becomes_an_int(make_args, tmp_path):
    from raytrainer.search.common import trial_args

    args = trial_args(make_args(output_dir=str(tmp_path)), {"seed": 17.6}, "0")  # tune.uniform(1, 40)
    assert args.seed == 17 and isinstance(args.seed, int)  # cast to the field's type, as transformers


def test_optuna_search_in_process(make_args, make_examples, tmp_path):
    data, _, _ = make_examples(64)
    init = _Recorder()
    trainer = _trainer(make_args, data, init, save_strategy="epoch", save_total_limit=1)
    init.calls.clear()  # Trainer() itself calls model_init once, without a trial (as HF)
    best = trainer.hyperparameter_search(hp_space=_space, n_trials=3,
                                         sampler=optuna.samplers.TPESampler(seed=0))

    assert isinstance(best, BestRun)
    # model_init: once per trial, with the live optuna trial
    assert [t.number for t in init.calls] == [0, 1, 2]
    assert all(isinstance(t, optuna.trial.Trial) for t in init.calls)
    assert 1e-3 <= best.hyperparameters["learning_rate"] <= 0.5
    assert best.hyperparameters["per_device_train_batch_size"] in (8, 16)
    summaries = [TrialSummary.load(str(tmp_path / f"run-{i}")) for i in range(3)]
    # each trial ran with its own batch size: 64 examples -> 64/bs steps per epoch, 2 epochs
    for s in summaries:
        assert s.global_step == 2 * math.ceil(64 / s.hyperparameters["per_device_train_batch_size"])
        assert len(s.evaluations) == 2 and s.objective == s.evaluations[-1]["objective"]
        assert s.objective == s.evaluations[-1]["metrics"]["eval_loss"]
        assert [p.rsplit("/", 1)[-1] for p in s.checkpoints] == [f"checkpoint-{s.global_step}"]  # limit 1
    best_summary = min(summaries, key=lambda s: s.objective)
    assert best.run_id == best_summary.trial_id
    assert best.objective == best_summary.objective == best.run_summary.objective
    assert best.run_summary.best_checkpoint == best_summary.checkpoints[-1]
    assert best.run_summary.output_dir == str(tmp_path / f"run-{best.run_id}")


class WorseThanFirst(optuna.pruners.BasePruner):
    """Prunes a trial whose evaluation is no better than trial 0's at the same step (deterministic)."""

    def prune(self, study, trial):
        step = trial.last_step
        first = study.trials[0].intermediate_values.get(step)
        return trial.number > 0 and first is not None and trial.intermediate_values[step] >= first


def test_pruner_stops_planted_bad_trial_before_its_last_epoch(make_args, make_examples, tmp_path):
    data, _, _ = make_examples(64)
    trainer = _trainer(make_args, data, _Recorder(), num_train_epochs=5, per_device_train_batch_size=16)
    storage = f"sqlite:///{tmp_path / 'prune.db'}"
    planted = optuna.create_study(storage=storage, study_name="p")  # the user plants the trials to run
    planted.enqueue_trial({"learning_rate": 0.01})
    planted.enqueue_trial({"learning_rate": 0.0})  # learns nothing: its loss stays at the start value

    best = trainer.hyperparameter_search(
        hp_space=lambda t: {"learning_rate": t.suggest_float("learning_rate", 0.0, 0.5)}, n_trials=2,
        storage=storage, study_name="p", load_if_exists=True, pruner=WorseThanFirst())
    good = TrialSummary.load(str(tmp_path / "run-0"))
    bad = TrialSummary.load(str(tmp_path / "run-1"))
    assert good.global_step == 20 and not good.pruned  # 4 steps per epoch, 5 epochs
    assert bad.pruned and bad.hyperparameters == {"learning_rate": 0.0}
    assert bad.global_step == 4 and len(bad.evaluations) == 1  # stopped right after its first evaluation
    states = [t.state.name for t in optuna.load_study(study_name="p", storage=storage).trials]
    assert states == ["COMPLETE", "PRUNED"]
    assert best.run_id == "0" and best.objective == good.objective


def test_sqlite_study_resumes_without_repeating_finished_trials(make_args, make_examples, tmp_path):
    data, _, _ = make_examples(32)
    storage = f"sqlite:///{tmp_path / 'search.db'}"
    seen = []

    def model_init(trial):
        seen.append(trial.params["learning_rate"])
        if len(seen) == 2:
            raise KeyboardInterrupt  # the user presses Ctrl-C during the second trial
        return TinyClassifier()

    trainer = _trainer(make_args, data, lambda: TinyClassifier(), num_train_epochs=1)
    trainer.model_init = model_init
    kw = {"hp_space": _space, "n_trials": 3, "storage": storage, "study_name": "s", "load_if_exists": True}
    with pytest.raises(KeyboardInterrupt):
        trainer.hyperparameter_search(**kw)
    study = optuna.load_study(study_name="s", storage=storage)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "FAIL"]
    first_lr = study.trials[0].params["learning_rate"]

    # resumed: n_trials more, as in transformers (here the 2 still wanted); trial 0 is not run again
    best = trainer.hyperparameter_search(**{**kw, "n_trials": 2})
    study = optuna.load_study(study_name="s", storage=storage)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    assert len(seen) == 4 and seen[0] == first_lr and first_lr not in seen[2:]
    assert best.objective == study.best_value
    assert best.run_summary is not None and best.run_summary.output_dir.endswith(f"run-{best.run_id}")


def test_multi_objective_returns_a_best_run_per_pareto_trial(make_args, make_examples):
    data, _, _ = make_examples(32)
    trainer = _trainer(make_args, data, lambda: TinyClassifier(), num_train_epochs=1)

    def objectives(metrics):
        return [metrics["eval_loss"], metrics["eval_loss"] * 2]

    runs = trainer.hyperparameter_search(hp_space=_space, n_trials=3, direction=["minimize", "maximize"],
                                         compute_objective=objectives)
    assert isinstance(runs, list) and runs and all(isinstance(r, BestRun) for r in runs)
    for r in runs:
        assert r.objective == [r.run_summary.objective[0], r.run_summary.objective[1]]
        assert r.objective[1] == pytest.approx(2 * r.objective[0])


def test_hyperparameters_not_in_args_reach_model_init_or_are_named(make_args, make_examples, caplog):
    data, _, _ = make_examples(32)
    widths = []

    class Wide(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 3))

        def forward(self, x, labels=None):
            logits = self.net(x)
            return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}

    def model_init(trial):
        width = 4 if trial is None else trial.params["width"]
        widths.append(width)
        return Wide(width)

    def space(trial):
        return {"width": trial.suggest_int("width", 2, 3),
                "learning_rte": trial.suggest_float("learning_rte", 0.1, 0.2)}

    trainer = _trainer(make_args, data, model_init, num_train_epochs=1)
    with caplog.at_level(logging.WARNING):
        best = trainer.hyperparameter_search(hp_space=space, n_trials=2)
    out = trainer.args.output_dir
    assert widths[1:] == [TrialSummary.load(f"{out}/run-{i}").hyperparameters["width"] for i in (0, 1)]
    assert best.hyperparameters["width"] in (2, 3) and "learning_rte" in best.hyperparameters
    assert "'learning_rte' (did you mean 'learning_rate'?)" in caplog.text

    caplog.clear()
    trainer = _trainer(make_args, data, lambda: TinyClassifier(), num_train_epochs=1)
    with caplog.at_level(logging.WARNING):
        trainer.hyperparameter_search(hp_space=lambda t: {"width": t.suggest_int("width", 2, 3)}, n_trials=1)
    assert "hyperparameters ['width'] are not TrainingArguments fields" in caplog.text


def test_checks_before_any_trial(make_args, make_examples):
    data, _, _ = make_examples(16)
    with pytest.raises(RuntimeError, match="needs a model_init"):
        Trainer(model=TinyClassifier(), args=make_args(), train_dataset=data).hyperparameter_search()
    with pytest.raises((ValueError, RuntimeError), match="optimizers"):  # transformers' Trainer refuses it
        model = TinyClassifier()
        Trainer(model_init=_tiny, args=make_args(), train_dataset=data,
                optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))
    trainer = Trainer(model_init=_tiny, args=make_args(), train_dataset=data)
    with pytest.raises(ValueError, match="direction='up'"):
        trainer.hyperparameter_search(direction="up")
    with pytest.raises(ValueError, match="backend='sigopt'"):
        trainer.hyperparameter_search(backend="sigopt")
    with pytest.raises(TypeError, match=r"unknown arguments \['n_job'\]"):
        trainer.hyperparameter_search(backend="optuna", n_job=2)


class _HoldsLock(TrainerCallback):
    def __init__(self):
        self.lock = threading.Lock()


def test_preflight_names_the_unpicklable_object(make_args, make_examples):
    data, _, _ = make_examples(16)
    lock = threading.Lock()

    def compute_metrics(pred):
        with lock:
            return {"n": len(pred.predictions)}

    args = make_args(num_workers=2)  # a distributed search: everything must reach Ray workers
    # refused when the Trainer is made (where the ranks' recipe is pickled) or when the search starts
    with pytest.raises(ValueError, match=r"compute_metrics.*cannot be pickled"):
        Trainer(model_init=_tiny, args=args, train_dataset=data,
                compute_metrics=compute_metrics).hyperparameter_search(n_trials=1)
    with pytest.raises(ValueError, match=r"callback.* ?_HoldsLock"):
        Trainer(model_init=_tiny, args=args, train_dataset=data,
                callbacks=[_HoldsLock()]).hyperparameter_search(n_trials=1)
    with pytest.raises(ValueError, match="hp_space"):
        Trainer(model_init=_tiny, args=args, train_dataset=data).hyperparameter_search(
            hp_space=lambda t, _lock=lock: {}, n_trials=1)


def test_the_workers_get_a_picklable_trial_that_answers_as_the_live_one(tmp_path):
    """With num_workers > 0, model_init(trial) runs on the trial's workers: an Optuna trial reaches them as a
    SuggestedTrial of hp_space's parameters (the live one holds the study's storage); Tune's dict as is."""
    import cloudpickle

    from raytrainer.search.common import worker_trial

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}")
    live = study.ask()
    lr = live.suggest_float("learning_rate", 1e-3, 0.5, log=True)
    width = live.suggest_int("width", 2, 8)
    sent = cloudpickle.loads(cloudpickle.dumps(worker_trial(live)))
    assert type(sent).__name__ == "SuggestedTrial" and sent.number == live.number == 0
    assert sent.params == {"learning_rate": lr, "width": width}
    assert sent.suggest_float("learning_rate", 1e-3, 0.5, log=True) == lr
    assert sent.suggest_int("width", 2, 8) == width
    with pytest.raises(ValueError, match=r"model_init asked the trial for 'depth', which hp_space did not "
                                         r"suggest.*Suggest 'depth' in hp_space"):
        sent.suggest_int("depth", 1, 3)
    config = {"learning_rate": 0.1}
    assert worker_trial(config) is config and worker_trial(None) is None


def test_suggestions_made_in_model_init_reach_the_workers_trial(make_args, make_examples, tmp_path):
    """transformers' own tests suggest in model_init, with an hp_space of {}: the driver runs model_init
    once on the meta device with the live trial (no weights), so the study records those suggestions and
    the workers' trial answers them, without a model built in the search's process."""
    import cloudpickle

    from raytrainer.search.common import worker_trial

    built = []

    def model_init(trial):
        classes = trial.suggest_int("classes", 2, 8) if trial is not None else 3
        model = torch.nn.Linear(4, classes)
        built.append(next(model.parameters()).device.type)
        return model

    data, _, _ = make_examples(8)
    trainer = Trainer(model_init=model_init, args=make_args(), train_dataset=data)
    built.clear()
    live = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}").ask()
    sent = cloudpickle.loads(cloudpickle.dumps(worker_trial(live, trainer)))
    assert built == ["meta"]  # model_init ran once, on the meta device
    assert "classes" in live.params and sent.params == live.params
    assert sent.suggest_int("classes", 2, 8) == live.params["classes"]


def test_a_trial_that_never_evaluated_evaluates_at_its_last_step(make_args, make_examples):
    """HF evaluates once after train() when a trial never did; raytrainer does it at the last step, where
    the model is (EvaluateAtTheEnd), so that evaluation is the trial's objective and the only one."""
    data, _, _ = make_examples(32)
    trainer = _trainer(make_args, data, lambda: TinyClassifier(), max_steps=3, eval_strategy="no")
    trainer.hyperparameter_search(hp_space=_space, n_trials=1)
    summary = TrialSummary.load(f"{trainer.args.output_dir}/run-0")
    assert [e["step"] for e in summary.evaluations] == [3]
    assert summary.objective == summary.evaluations[0]["objective"] == summary.evaluations[0]["metrics"][
        "eval_loss"]
