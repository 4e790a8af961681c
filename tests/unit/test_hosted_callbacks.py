"""The driver's ``callback_handler`` of a trainer on Ray workers lists what transformers' Trainer lists in one
process (raytrainer/hosted_callbacks.py), and its edits are replayed on each rank. No Ray: nothing here
starts a worker (the edits' run on 2 workers: tests/integration/test_warm_workers.py)."""

from __future__ import annotations

import threading
from unittest import mock

import pytest
import torch
import transformers
from transformers import DefaultFlowCallback, EarlyStoppingCallback, TrainerCallback

from raytrainer import Trainer, TrainingArguments
from raytrainer.driver.display import DriverDisplay


class Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(state.global_step)


class OnDriver(TrainerCallback):
    on_driver = True

    def __init__(self):
        self.lock = threading.Lock()  # never pickled: it stays in the driver


def _names(trainer) -> list[str]:
    return [type(cb).__name__ for cb in trainer.callback_handler.callbacks]


def _pair(tmp_path, callbacks, **fields):
    """transformers' Trainer in one process and raytrainer's on 2 workers, built alike (no worker starts)."""
    fields = {"report_to": "none", "disable_tqdm": False, **fields}
    theirs = transformers.Trainer(model=torch.nn.Linear(2, 1), callbacks=callbacks and list(callbacks),
                                  args=transformers.TrainingArguments(str(tmp_path / "t"), **fields))
    ours = Trainer(model=torch.nn.Linear(2, 1), callbacks=callbacks and list(callbacks),
                   args=TrainingArguments(str(tmp_path / "r"), num_workers=2, **fields))
    assert "_group" not in vars(ours)
    return theirs, ours


@pytest.mark.parametrize("callbacks, fields", [
    (None, {}),
    (None, {"disable_tqdm": True}),
    ([Recorder, EarlyStoppingCallback(early_stopping_patience=2)], {}),
    ([Recorder(), Recorder()], {"report_to": ["tensorboard"]}),
], ids=["defaults", "printer", "class-and-instance", "tracker-and-two-of-a-class"])
def test_the_driver_lists_each_ranks_callbacks_as_transformers_does_in_one_process(tmp_path, callbacks,
                                                                                    fields, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    theirs, ours = _pair(tmp_path, callbacks, **fields)
    assert _names(ours) == _names(theirs)
    given = [cb for cb in callbacks or () if not isinstance(cb, type)]
    assert all(any(cb is mine for mine in ours.callback_handler.callbacks) for cb in given)  # the script's
    # of them, only the display runs in the driver, fed rank 0's events; a tracker runs on rank 0
    shown = [type(cb).__name__ for cb in DriverDisplay(ours).handler.callbacks]
    assert shown == ["PrinterCallback" if fields.get("disable_tqdm") else "ProgressCallback"]


def test_a_class_given_twice_is_warned_about_on_the_driver(tmp_path):
    with mock.patch("transformers.trainer_callback.logger.warning") as warning:
        Trainer(model=torch.nn.Linear(2, 1), callbacks=[Recorder, Recorder],
                args=TrainingArguments(str(tmp_path), num_workers=2, report_to="none"))
    assert warning.called and "Recorder" in warning.call_args[0][0]


def test_edits_on_the_driver_are_transformers_and_are_made_on_each_rank(tmp_path):
    """add/pop/remove on the driver change its list as transformers' Trainer's; each rank, built from the
    same payload (a new trainer: a new recipe key), makes the same edits after building its trainer."""
    theirs, ours = _pair(tmp_path, [Recorder, EarlyStoppingCallback(early_stopping_patience=3)])
    recipe = ours._recipe
    for trainer in (theirs, ours):
        added = Recorder()
        trainer.add_callback(added)
        trainer.add_callback(EarlyStoppingCallback)
        assert trainer.pop_callback(added) is added
        trainer.remove_callback(DefaultFlowCallback)
        first = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, EarlyStoppingCallback))
        trainer.remove_callback(first)
        assert trainer.pop_callback(Recorder) is not None
        assert trainer.pop_callback(Recorder) is None  # nothing left of the class: nothing edited
        with pytest.raises(ValueError):  # an instance not listed, as transformers says
            trainer.remove_callback(Recorder())
    assert _names(ours) == _names(theirs) == ["ProgressCallback", "EarlyStoppingCallback"]

    assert ours._recipe.key != recipe.key and ours._recipe.ref is recipe.ref and recipe.edits is None
    rank = transformers.Trainer(model=torch.nn.Linear(2, 1),
                                callbacks=[Recorder, EarlyStoppingCallback(early_stopping_patience=3)],
                                args=transformers.TrainingArguments(str(tmp_path / "rank"), report_to="none"))
    from raytrainer.hosted_callbacks import apply_edits

    apply_edits(rank, ours._recipe.callback_edits())
    assert _names(rank) == _names(ours)
    # the instance removed was the constructor's (the first of its class), the one added by class stays
    assert rank.callback_handler.callbacks[1].early_stopping_patience == 1


def test_a_callback_added_to_run_on_the_driver_stays_there(tmp_path):
    """A callback with ``on_driver = True`` added on the driver runs in the driver (shown rank 0's events);
    it is no edit of the ranks' lists, so it need not pickle."""
    _, ours = _pair(tmp_path, None)
    recipe = ours._recipe
    mine = OnDriver()
    ours.add_callback(mine)
    assert ours.callback_handler.callbacks[-1] is mine and ours._recipe is recipe
    assert DriverDisplay(ours).handler.callbacks[-1] is mine


def test_a_callback_added_that_cannot_be_pickled_is_refused_naming_it(tmp_path):
    class Local(TrainerCallback):
        def __init__(self):
            self.lock = threading.Lock()

    _, ours = _pair(tmp_path, None)
    with pytest.raises(ValueError, match=r"add_callback\(.*Local.*\): the callback cannot be pickled"):
        ours.add_callback(Local())
    assert _names(ours) == ["DefaultFlowCallback", "ProgressCallback"] and not ours._callback_edits


class KeepsItsTrainer(TrainerCallback):
    def __init__(self):
        self.trainer, self.seen = None, [1, 2]


def test_a_callback_that_keeps_its_trainer_sends_its_state_without_it(tmp_path):
    """The driver sends its callbacks' states with each call (a rank that builds the trainer starts from
    them): a trainer kept by a callback stays behind, wherever it is (here: the driver's, whose pickle
    would hold the model)."""
    from raytrainer.worker.rank import callback_states

    keeper = KeepsItsTrainer()
    _, ours = _pair(tmp_path, [keeper])
    keeper.trainer = ours
    states = dict(callback_states(ours.callback_handler.callbacks))
    assert states["KeepsItsTrainer"] == {"seen": [1, 2]}
    assert "ProgressCallback" not in states  # the display runs here, never on a rank
