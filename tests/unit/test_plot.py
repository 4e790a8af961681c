"""``raytrainer plot``: PNGs of a real in-process run's ``trainer_state.json`` (num_workers=0, no Ray), and of
a hyperparameter search's ``run-<trial id>/trial_summary.json`` files, written by hand here (that is their
on-disk format; a real search needs Ray). Each PNG is opened and checked for drawn, coloured content."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest
import torch
from torch import nn

from raytrainer import cli
from raytrainer.plot import (
    PlotError,
    best_so_far,
    find_trainer_state,
    find_trial_summaries,
    first_objective,
    metric_families,
    metric_series,
    normalise,
)

RUN_PNGS = {"loss.png", "learning_rate.png", "grad_norm.png"}  # no eval_runtime.png: a speed, not a metric
SEARCH_PNGS = {"search_objective.png", "search_best_so_far.png", "search_parallel_coordinates.png",
               "search_trials.png"}


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        if labels is None:
            return {"logits": logits}
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(trainer, output_dir) of 8 real steps: loss every step, evaluation every 2, a checkpoint every 4."""
    from raytrainer import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g)
    data = [{"x": x[i], "labels": int(y[i])} for i in range(32)]
    output_dir = str(tmp_path_factory.mktemp("run"))
    args = TrainingArguments(output_dir=output_dir, num_workers=0, per_device_train_batch_size=4,
                             learning_rate=0.1, eval_strategy="steps", eval_steps=2, logging_steps=1,
                             save_strategy="steps", save_steps=4, max_steps=8, report_to="none",
                             disable_tqdm=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        trainer = Trainer(model=Tiny(), args=args, train_dataset=data, eval_dataset=data[:8])
        trainer.train()
    return trainer, output_dir


def assert_drawn(path: str) -> None:
    """A real picture: over 100x100 pixels, several colours, ink on it, and coloured marks (the data;
    axes, ticks and text are black or grey)."""
    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert width > 100 and height > 100, path
    rgb = image[..., :3].reshape(-1, 3)
    assert (rgb != rgb[0]).any(), f"{path} is one colour"
    assert (rgb < 0.9).any(axis=1).mean() > 0.01, f"{path} is almost blank"
    assert ((rgb.max(axis=1) - rgb.min(axis=1)) > 0.3).sum() > 200, f"{path} has no coloured data on it"


def run_cli(capsys, *argv: str) -> tuple[int, list[str], str]:
    code = cli.main(["plot", *argv])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def assert_written(printed: list[str], out_dir: str, expected: set[str]) -> None:
    assert set(os.listdir(out_dir)) == expected
    assert sorted(printed) == sorted(os.path.join(out_dir, name) for name in expected)
    for path in printed:
        assert_drawn(path)


# -- a run ------------------------------------------------------------------------------------------------
def test_plots_a_runs_curves_from_its_latest_checkpoint(trained, capsys):
    trainer, output_dir = trained
    assert sorted(os.listdir(output_dir)) == ["checkpoint-4", "checkpoint-8"]
    code, printed, err = run_cli(capsys, output_dir)
    assert code == 0, err
    assert_written(printed, os.path.join(output_dir, "plots"), RUN_PNGS)  # the default --out
    assert os.path.basename(printed[0]) == "loss.png"  # the loss first

    path = find_trainer_state(output_dir)
    assert path == os.path.join(output_dir, "checkpoint-8", "trainer_state.json")
    with open(path) as f:
        series = metric_series(json.load(f)["log_history"])
    assert series["loss"][0] == list(range(1, 9)) and series["eval_loss"][0] == [2, 4, 6, 8]
    logged = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    assert series["learning_rate"][1] == pytest.approx(logged)
    assert "epoch" not in series and "step" not in series
    assert metric_families(series)["loss"] == ["loss", "eval_loss"]


def test_picks_the_trainer_state_with_the_most_steps(trained, tmp_path, monkeypatch):
    trainer, output_dir = trained
    run = tmp_path / "run"
    shutil.copytree(output_dir, run, ignore=shutil.ignore_patterns("plots"))
    latest = str(run / "checkpoint-8" / "trainer_state.json")
    # a partial checkpoint (no manifest.json: its save never committed) is not read, whatever its step
    (run / "checkpoint-12").mkdir()
    state = json.loads((run / "checkpoint-8" / "trainer_state.json").read_text())
    (run / "checkpoint-12" / "trainer_state.json").write_text(json.dumps({**state, "global_step": 12}))
    assert find_trainer_state(str(run)) == latest
    # an older save_state() loses to the newer checkpoint
    (run / "trainer_state.json").write_text(json.dumps({**state, "global_step": 4}))
    assert find_trainer_state(str(run)) == latest
    # save_state() after training: same step as the last checkpoint, written after it, with the summary
    monkeypatch.setattr(trainer.args, "output_dir", str(run))
    trainer.save_state()
    assert find_trainer_state(str(run)) == str(run / "trainer_state.json")
    history = json.loads((run / "trainer_state.json").read_text())["log_history"]
    assert "train_runtime" in history[-1] and "train_loss" in history[-1]
    # the same PNGs as from the checkpoint: no train_runtime.png, total_flos.png, train_loss.png...
    assert {f"{stem}.png" for stem in metric_families(metric_series(history))} == RUN_PNGS


def test_a_run_on_workers_that_saved_no_checkpoint_plots_from_its_final_state(trained, tmp_path, capsys):
    """A run on Ray workers keeps its final trainer state in .raytrainer/ (driver/runner.keep_final_state):
    with no checkpoint (save_strategy="no", the demo) that is what is drawn; a later checkpoint wins."""
    trainer, _ = trained
    run = tmp_path / "run"
    (run / ".raytrainer").mkdir(parents=True)
    trainer.state.save_to_json(str(run / ".raytrainer" / "trainer_state.json"))
    assert find_trainer_state(str(run)) == str(run / ".raytrainer" / "trainer_state.json")
    code, printed, err = run_cli(capsys, str(run))
    assert code == 0, err
    assert_written(printed, str(run / "plots"), RUN_PNGS)
    ahead = run / "checkpoint-9"
    ahead.mkdir()
    (ahead / "manifest.json").write_text("{}")
    state = json.loads((run / ".raytrainer" / "trainer_state.json").read_text())
    (ahead / "trainer_state.json").write_text(json.dumps({**state, "global_step": 9}))
    assert find_trainer_state(str(run)) == str(ahead / "trainer_state.json")


def test_the_loss_comes_first_then_evaluation_metrics_then_the_rest():
    names = ["grad_norm", "learning_rate", "eval_accuracy", "eval_loss", "loss", "eval_f1"]
    assert list(metric_families(names)) == ["loss", "eval_accuracy", "eval_f1", "grad_norm", "learning_rate"]


def test_metric_series_skips_non_numbers_and_the_summary():
    history = [
        {"loss": 2.0, "grad_norm": float("nan"), "note": "warmup", "flag": True, "epoch": 0.5, "step": 1},
        {"loss": 1.5, "eval_accuracy": 0.75, "step": 2},
        {"eval_accuracy": 0.5},  # no step
        {"train_runtime": 3.0, "train_loss": 1.7, "total_flos": 10.0, "step": 2},
    ]
    assert metric_series(history) == {"loss": ([1, 2], [2.0, 1.5]), "eval_accuracy": ([2], [0.75])}
    assert metric_families(["eval_accuracy", "loss", "eval_loss"]) == {
        "eval_accuracy": ["eval_accuracy"], "loss": ["loss", "eval_loss"]}


def test_a_folder_with_nothing_to_plot_is_exit_status_2(tmp_path, capsys):
    (tmp_path / "checkpoint-4").mkdir()  # a partial checkpoint only
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text('{"global_step": 4, "log_history": []}')
    code, printed, err = run_cli(capsys, str(tmp_path))
    assert code == 2 and printed == []
    assert err.startswith("raytrainer: error: nothing to plot in " + str(tmp_path))
    assert "trainer_state.json" in err and "run-<trial id>/trial_summary.json" in err
    assert not (tmp_path / "plots").exists()
    code, _, err = run_cli(capsys, str(tmp_path / "missing"))
    assert code == 2 and "missing is not a folder" in err


# -- a search ---------------------------------------------------------------------------------------------
def write_trial(root, trial_id: str, hyperparameters: dict, objectives: list, pruned: bool = False) -> None:
    folder = root / f"run-{trial_id}"
    evaluations = [{"step": 10 * (i + 1), "objective": o, "metrics": {"eval_loss": o}}
                   for i, o in enumerate(objectives)]
    summary = {"trial_id": trial_id, "output_dir": str(folder), "hyperparameters": hyperparameters,
               "objective": objectives[-1] if objectives else None,
               "best_checkpoint": str(folder / "checkpoint-20"),
               "checkpoints": [str(folder / "checkpoint-10"), str(folder / "checkpoint-20")],
               "evaluations": evaluations, "global_step": 10 * len(objectives), "pruned": pruned}
    folder.mkdir()
    (folder / "trial_summary.json").write_text(json.dumps(summary))


@pytest.fixture
def search(tmp_path):
    root = tmp_path / "search"
    root.mkdir()
    write_trial(root, "0", {"learning_rate": 1e-5, "optim": "adamw_torch", "warmup_steps": 0}, [1.2, 0.9])
    write_trial(root, "1", {"learning_rate": 1e-3, "optim": "sgd", "warmup_steps": 10}, [1.0, 0.7])
    write_trial(root, "2", {"learning_rate": 3e-4, "optim": "sgd", "warmup_steps": 5}, [0.5], pruned=True)
    write_trial(root, "10", {"learning_rate": 1e-4, "optim": "adamw_torch", "warmup_steps": 5}, [1.1, 0.8])
    (root / "run-3").mkdir()  # a trial that never finished: no summary
    return root


def test_plots_a_search(search, tmp_path, capsys):
    assert [t["trial_id"] for t in find_trial_summaries(str(search))] == ["0", "1", "2", "10"]
    code, printed, err = run_cli(capsys, str(search))
    assert code == 0, err
    assert_written(printed, str(search / "plots"), SEARCH_PNGS)

    maximized = tmp_path / "max"
    code, printed, err = run_cli(capsys, str(search), "--direction", "maximize", "--out", str(maximized))
    assert code == 0, err
    assert_written(printed, str(maximized), SEARCH_PNGS)
    best = [matplotlib.image.imread(str(d / "search_best_so_far.png")) for d in (search / "plots", maximized)]
    assert not np.array_equal(*best)  # the direction reaches the curve

    with pytest.raises(SystemExit):
        cli.main(["plot", str(search), "--direction", "up"])


def test_multi_objective_trials_plot_their_first_objective(tmp_path, capsys):
    write_trial(tmp_path, "a", {"lr": 0.1}, [[0.9, 3.0], [0.6, 2.0]])
    write_trial(tmp_path, "b", {"lr": 0.2}, [[0.8, 1.0]], pruned=True)
    code, printed, err = run_cli(capsys, str(tmp_path), "--out", str(tmp_path / "pngs"))
    assert code == 0, err
    assert_written(printed, str(tmp_path / "pngs"), SEARCH_PNGS)
    assert first_objective([0.6, 2.0]) == 0.6 and first_objective(0.5) == 0.5
    assert first_objective(None) is None and first_objective([]) is None


def test_best_so_far_follows_the_direction():
    values = [0.8, 0.9, None, 0.6, 1.0, 0.7]
    assert best_so_far(values, "minimize") == [0.8, 0.8, 0.8, 0.6, 0.6, 0.6]
    assert best_so_far(values, "maximize") == [0.8, 0.9, 0.9, 0.9, 1.0, 1.0]
    assert best_so_far(values) == best_so_far(values, "minimize")  # transformers' default
    assert best_so_far([None, 0.3, None], "maximize") == [None, 0.3, 0.3]
    with pytest.raises(PlotError, match="direction 'up'"):
        best_so_far(values, "up")


def test_importing_the_command_imports_no_matplotlib():
    code = ("import sys, raytrainer, raytrainer.cli, raytrainer.plot; "
            "print(sorted(m for m in ('matplotlib', 'torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_parallel_coordinate_axes():
    positions, ticks = normalise(["sgd", "adamw", None, "sgd"])  # categorical: index among sorted values
    assert positions == [1.0, 0.0, None, 1.0] and ticks == [(0.0, "adamw"), (1.0, "sgd")]
    positions, _ = normalise([1e-5, 1e-4, 1e-3])  # over 100x: log scale
    assert positions == pytest.approx([0.0, 0.5, 1.0])
    positions, ticks = normalise([8, 16, 32])
    assert positions == pytest.approx([0.0, 1 / 3, 1.0]) and ticks == [(0.0, "8"), (1.0, "32")]
    assert normalise([4, 4])[0] == [0.5, 0.5]
    assert normalise([True, False])[0] == [1.0, 0.0]  # booleans are categories
