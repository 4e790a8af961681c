"""When a search's stop verdict makes a trial "pruned" (raytrainer/search/common.py::TrialReporter)."""

from __future__ import annotations

import pytest

from raytrainer import TrainerControl, TrainerState, TrainingArguments
from raytrainer.search.common import TrialReporter


def _evaluate(reporter, step: int, max_steps: int = 4) -> TrainerControl:
    control = TrainerControl()
    state = TrainerState(global_step=step, max_steps=max_steps)
    reporter.on_evaluate(TrainingArguments(output_dir="unused"), state, control, metrics={"eval_loss": 0.5})
    return control


@pytest.mark.parametrize("at_the_end_prunes", [True, False])
def test_a_stop_before_the_last_step_prunes_for_every_backend(at_the_end_prunes):
    reporter = TrialReporter(lambda m: m["eval_loss"], lambda *a: True,
                             stop_at_the_end_prunes=at_the_end_prunes)
    assert _evaluate(reporter, 2).should_training_stop and reporter.pruned
    assert reporter.evaluations == [{"step": 2, "objective": 0.5, "metrics": {"eval_loss": 0.5}}]


def test_a_tune_stop_at_the_last_step_is_the_trial_reaching_its_end():
    """ASHA answers STOP when a trial reaches max_t; on the run's last evaluation that ends nothing early,
    and the Trainable's cleanup (which calls stop()) after it leaves the trial complete."""
    tune_like = TrialReporter(lambda m: m["eval_loss"], lambda *a: True, stop_at_the_end_prunes=False)
    assert _evaluate(tune_like, 4).should_training_stop and not tune_like.pruned
    tune_like.stop()
    assert not tune_like.pruned
    # an Optuna pruner's verdict at the last evaluation still prunes, as transformers raises TrialPruned there
    optuna_like = TrialReporter(lambda m: m["eval_loss"], lambda *a: True)
    _evaluate(optuna_like, 4)
    assert optuna_like.pruned


def test_stopped_between_evaluations_is_pruned():
    reporter = TrialReporter(lambda m: m["eval_loss"], lambda *a: False, stop_at_the_end_prunes=False)
    assert not _evaluate(reporter, 2).should_training_stop and not reporter.pruned
    reporter.stop()  # Tune ends the trial before its last step (another trial's PBT exploit, a time budget)
    assert reporter.pruned
