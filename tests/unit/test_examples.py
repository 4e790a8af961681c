"""The examples in their smoke setting: each run as written (its ``main`` with the flags a user would pass),
in this process (``--num_workers 0``), asserting the outcome the script checks for itself. Their runs on
Ray workers (the strategy configs) are tests/integration/test_examples_on_workers.py."""

from __future__ import annotations

import os
import sqlite3
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

QUIET = ["--num_workers", "0", "--disable_tqdm", "1", "--report_to", "none"]


def test_finetune_a_pretrained_model_offline(tmp_path, capsys):
    import finetune_sentiment

    out = finetune_sentiment.main([*QUIET, "--output_dir", str(tmp_path), "--max_steps", "40",
                                   "--eval_examples", "300", "--min_accuracy", "0.75"])
    assert out["steps"] == 40
    labels = out["labels"]
    assert 0.3 < labels.mean() < 0.7  # both classes in the test words
    assert out["after"] >= 0.75 and out["after"] > out["before"] + 0.15  # the pretrained encoder learns fast
    assert "fine-tuned all-MiniLM-L6-v2 for 40 steps on 1 worker(s)" in capsys.readouterr().out


def test_causal_lm_from_a_config_with_and_without_neftune(tmp_path):
    import train_gpt2

    smoke = [*QUIET, "--max_steps", "60", "--max_perplexity", "15", "--logging_steps", "10"]
    plain = train_gpt2.main([*smoke, "--output_dir", str(tmp_path / "plain")])
    noisy = train_gpt2.main([*smoke, "--output_dir", str(tmp_path / "neftune"), "--neftune_noise_alpha", "5"])
    for run in (plain, noisy):
        assert run["steps"] == 60 and run["before"] > 50 and run["after"] < 15
    assert plain["before"] == pytest.approx(noisy["before"], rel=1e-6)  # same model, same seed
    losses = [[h["loss"] for h in run["trainer"].state.log_history if "loss" in h] for run in (plain, noisy)]
    assert len(losses[0]) == len(losses[1]) == 6
    assert losses[0][0] != losses[1][0]  # NEFTune's noise changed the training forward from the first step
    embeddings = noisy["trainer"].model.get_input_embeddings()
    assert not embeddings._forward_hooks  # removed after training: evaluation sees clean embeddings


def test_weighted_compute_loss_finds_the_rare_class(tmp_path, capsys):
    import weighted_loss

    recalls = weighted_loss.main([*QUIET, "--output_dir", str(tmp_path)])
    assert recalls["weighted"] >= 0.85 and recalls["weighted"] > recalls["plain"] + 0.3
    assert "recall of 9s on the test set" in capsys.readouterr().out


def test_early_stopping_stops_and_restores_the_best_checkpoint(tmp_path):
    import early_stopping

    out = early_stopping.main([*QUIET, "--output_dir", str(tmp_path)])
    losses = out["eval_losses"]
    best = losses.index(min(losses))
    assert out["epochs"] == len(losses) == best + 1 + 2  # patience 2: two evaluations past the best
    assert out["epochs"] < 60
    assert out["final"] == pytest.approx(min(losses), abs=1e-6)
    assert out["best_checkpoint"].startswith(str(tmp_path / "checkpoint-"))


def test_optuna_search_with_a_sqlite_study_resumes(tmp_path):
    import search_optuna

    smoke = [*QUIET, "--output_dir", str(tmp_path), "--num_train_epochs", "2", "--min_accuracy", "0.8"]
    first = search_optuna.main([*smoke, "--n_trials", "3"])
    assert first["trials"] == 3
    again = search_optuna.main([*smoke, "--n_trials", "2"])  # the rerun adds 2 to the stored 3
    assert again["trials"] == 5 and again["best"].objective >= first["best"].objective
    with sqlite3.connect(tmp_path / "search.db") as db:
        assert db.execute("select count(*) from trials").fetchone()[0] == 5
