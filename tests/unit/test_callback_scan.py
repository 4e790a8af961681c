"""Which callbacks need the ranks' per-step agreement on the control flags (raytrainer.callback_scan, read
by ``same_on_every_rank``); the run that counts the agreements is in tests/integration/test_ddp.py."""

from __future__ import annotations

import functools

import pytest
from transformers.trainer_callback import TrainerControl

from raytrainer import EarlyStoppingCallback, TrainerCallback
from raytrainer.callback_scan import leaves_control_alone
from raytrainer.callbacks import same_on_every_rank


class Looks(TrainerCallback):
    """Records, times, reads a flag, returns control unchanged: never decides."""

    def __init__(self):
        self.seen, self.state = [], {}

    def __setstate__(self, state):
        self.__dict__.update(state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if control.should_log and state.is_world_process_zero:
            self.seen.append(dict(logs or {}))
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self._note(state.global_step)

    def _note(self, step):
        self.state["step"] = [s for s in range(step) if s % 2]


class SetsAFlag(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > 3:
            control.should_training_stop = True


class ThroughAHelperMethod(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        self._decide(control)

    def _decide(self, c):
        c.should_save = True


class ReturnsAMapping(TrainerCallback):
    def on_evaluate(self, args, state, control, **kwargs):
        return {"should_training_stop": True}


class ReturnsANewControl(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        return TrainerControl(should_save=True)


class InANestedFunction(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        def stop():
            control.should_training_stop = True
        stop()


class ThroughTheTrainer(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.control.should_evaluate = True


class WithSetattr(TrainerCallback):
    def on_log(self, args, state, control, **kwargs):
        setattr(control, "should_save", True)  # noqa: B010 (the shape under test)


class StarArguments(TrainerCallback):
    def on_step_end(self, *args, **kwargs):
        pass


class APartial(TrainerCallback):
    on_step_end = functools.partial(print)


class AliasesControl(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        flags = control
        flags.should_log = True


class InAProperty(TrainerCallback):
    @property
    def stop(self):
        self.control.should_training_stop = True


@pytest.mark.parametrize("cls", [SetsAFlag, ThroughAHelperMethod, ReturnsAMapping, ReturnsANewControl,
                                 InANestedFunction, ThroughTheTrainer, WithSetattr, StarArguments, APartial,
                                 AliasesControl, InAProperty])
def test_a_callback_whose_code_may_write_a_flag_needs_the_agreement(cls):
    assert not leaves_control_alone(cls())
    assert not same_on_every_rank(cls())


def test_a_callback_that_only_looks_needs_none():
    assert leaves_control_alone(Looks())
    assert same_on_every_rank(Looks())


def test_an_event_set_on_the_instance_is_not_read():
    cb = Looks()
    cb.on_epoch_end = lambda args, state, control, **kw: None
    assert not leaves_control_alone(cb)


def test_a_declaration_wins_over_the_reading_and_transformers_callbacks_keep_theirs():
    class DeclaredDifferent(Looks):
        same_on_every_rank = False

    class DeclaredSame(SetsAFlag):
        same_on_every_rank = True

    assert not same_on_every_rank(DeclaredDifferent())
    assert same_on_every_rank(DeclaredSame())
    early = EarlyStoppingCallback(early_stopping_patience=2)
    assert not leaves_control_alone(early) and same_on_every_rank(early)  # it decides, alike everywhere
