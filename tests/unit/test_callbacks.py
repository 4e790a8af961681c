"""Unit tests for raytrainer.callbacks: flow decisions, control returns, early stopping, state, progress."""

from __future__ import annotations

import enum
import io
import json
import logging
from types import SimpleNamespace

import pytest

from raytrainer.callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    EarlyStoppingCallback,
    ExportableState,
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    state_from_dict,
    state_to_dict,
    state_to_json,
)


def make_args(**overrides):
    fields = dict(
        logging_first_step=False,
        logging_strategy="steps",
        logging_steps=2,
        eval_strategy="no",
        eval_steps=None,
        eval_delay=0,
        save_strategy="steps",
        save_steps=4,
        metric_for_best_model=None,
        greater_is_better=None,
        load_best_model_at_end=False,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


def run_steps(args, max_steps, handler=None):
    """Drive the step events of a loop for max_steps steps; return {step: (log, evaluate, save, stop)}."""
    handler = handler or CallbackHandler([DefaultFlowCallback()])
    state = TrainerState(max_steps=max_steps)
    state.compute_steps(args, max_steps)
    control = TrainerControl()
    decisions = {}
    control = handler.on_train_begin(args, state, control)
    for step in range(1, max_steps + 1):
        control = handler.on_step_begin(args, state, control)
        state.global_step = step
        control = handler.on_step_end(args, state, control)
        decisions[step] = (
            control.should_log,
            control.should_evaluate,
            control.should_save,
            control.should_training_stop,
        )
        if control.should_training_stop:
            break
    return decisions


def flagged(decisions, index):
    return [step for step, flags in decisions.items() if flags[index]]


# --- DefaultFlowCallback -----------------------------------------------------------------------------


def test_flow_steps_strategy_log_eval_save_and_stop():
    args = make_args(logging_steps=2, eval_strategy="steps", eval_steps=3, save_steps=4)
    decisions = run_steps(args, max_steps=10)
    assert flagged(decisions, 0) == [2, 4, 6, 8, 10]
    # evaluated every 3 steps, plus at the last step because 10 is not a multiple of 3
    assert flagged(decisions, 1) == [3, 6, 9, 10]
    # saved every 4 steps, plus at the last step
    assert flagged(decisions, 2) == [4, 8, 10]
    assert flagged(decisions, 3) == [10]
    assert list(decisions) == list(range(1, 11))


def test_flow_logging_first_step_and_eval_delay():
    args = make_args(logging_first_step=True, logging_steps=5, eval_strategy="steps", eval_steps=2,
                     eval_delay=5, save_strategy="no")
    decisions = run_steps(args, max_steps=9)
    assert flagged(decisions, 0) == [1, 5]
    assert flagged(decisions, 1) == [6, 8, 9]
    assert flagged(decisions, 2) == []
    assert flagged(decisions, 3) == [9]


def test_flow_no_strategies_only_stops():
    args = make_args(logging_strategy="no", eval_strategy="no", save_strategy="no")
    decisions = run_steps(args, max_steps=4)
    assert decisions[4] == (False, False, False, True)
    assert all(flags == (False, False, False, False) for step, flags in decisions.items() if step < 4)


class Strategy(str, enum.Enum):
    NO = "no"
    STEPS = "steps"
    EPOCH = "epoch"


def test_flow_epoch_strategies_accept_enums_and_respect_eval_delay():
    args = make_args(logging_strategy=Strategy.EPOCH, eval_strategy=Strategy.EPOCH,
                     save_strategy=Strategy.EPOCH, eval_delay=2)
    flow = DefaultFlowCallback()
    state = TrainerState(max_steps=30)
    state.compute_steps(args, 30)
    results = []
    for epoch in (1.0, 2.0, 3.0):
        control = TrainerControl()
        state.epoch = epoch
        state.global_step = int(epoch * 10)
        flow.on_step_end(args, state, control)
        step_flags = (control.should_log, control.should_evaluate, control.should_save)
        flow.on_epoch_end(args, state, control)
        results.append((step_flags, (control.should_log, control.should_evaluate, control.should_save)))
    # nothing is decided per step with epoch strategies; per epoch: log+save always, evaluate from epoch 2
    assert [r[0] for r in results] == [(False, False, False)] * 3
    assert [r[1] for r in results] == [(True, False, True), (True, True, True), (True, True, True)]


def test_flow_steps_enum_strategy_and_ratio_steps():
    args = make_args(logging_strategy=Strategy.STEPS, logging_steps=0.25, save_strategy=Strategy.NO)
    decisions = run_steps(args, max_steps=8)
    assert flagged(decisions, 0) == [2, 4, 6, 8]
    assert flagged(decisions, 2) == []


# --- control returns ---------------------------------------------------------------------------------


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            return {"should_training_stop": True}
        return None


def test_dict_return_sets_should_training_stop():
    handler = CallbackHandler([DefaultFlowCallback(), StopAt(3)])
    decisions = run_steps(make_args(), max_steps=10, handler=handler)
    assert list(decisions) == [1, 2, 3]
    assert decisions[3][3] is True
    assert decisions[2][3] is False


def test_returned_control_replaces_and_flags_reset_by_handler():
    replacement = TrainerControl(should_save=True)

    class Replace(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            return replacement

    handler = CallbackHandler([Replace()])
    state = TrainerState(max_steps=5)
    control = handler.on_step_end(make_args(), state, TrainerControl())
    assert control is replacement
    control = handler.on_step_begin(make_args(), state, control)
    assert control.should_save is False
    control.should_log = True
    control = handler.on_log(make_args(), state, control, logs={"loss": 1.0})
    assert control.should_log is False


def test_bad_flag_key_raises_value_error_naming_it():
    class Bad(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            return {"should_stop": True}

    handler = CallbackHandler([Bad()])
    control = TrainerControl()
    with pytest.raises(ValueError, match=r"Bad\.on_step_end.*unknown control flag\(s\) 'should_stop'") as err:
        handler.on_step_end(make_args(), TrainerState(), control)
    assert "should_training_stop" in str(err.value)  # lists the valid flags
    assert control == TrainerControl()  # nothing applied


def test_a_mapping_of_flags_is_applied_all_or_nothing():
    class Returns(TrainerCallback):
        def __init__(self, flags):
            self.flags = flags

        def on_step_end(self, args, state, control, **kwargs):
            return self.flags

    control = TrainerControl()
    with pytest.raises(ValueError, match="'nope'"):
        CallbackHandler([Returns({"should_save": True, "nope": True})]).on_step_end(
            make_args(), TrainerState(), control)
    assert control.should_save is False
    out = CallbackHandler([Returns({"should_save": True, "should_log": 1})]).on_step_end(
        make_args(), TrainerState(), control)
    assert out is control and (control.should_save, control.should_log) == (True, True)


def test_int_return_raises_type_error_naming_callback_and_event():
    class ReturnsInt(TrainerCallback):
        def on_epoch_end(self, args, state, control, **kwargs):
            return 1

    handler = CallbackHandler([ReturnsInt()])
    with pytest.raises(TypeError, match=r"ReturnsInt\.on_epoch_end returned int"):
        handler.on_epoch_end(make_args(), TrainerState(), TrainerControl())


def test_call_event_passes_handler_objects_and_event_kwargs():
    seen = {}

    class Recorder(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            seen.update(kwargs)

    model, optimizer = object(), object()
    handler = CallbackHandler([Recorder()], model=model, processing_class=None, optimizer=optimizer,
                              lr_scheduler=None)
    handler.eval_dataloader = [1, 2]
    control = TrainerControl(should_evaluate=True)
    control = handler.on_evaluate(make_args(), TrainerState(), control, metrics={"eval_loss": 0.5})
    assert control.should_evaluate is False
    assert seen["model"] is model and seen["optimizer"] is optimizer
    assert seen["eval_dataloader"] == [1, 2] and seen["train_dataloader"] is None
    assert seen["metrics"] == {"eval_loss": 0.5}
    assert set(seen) == {"model", "processing_class", "optimizer", "lr_scheduler", "train_dataloader",
                         "eval_dataloader", "metrics"}


def test_every_overridden_event_reaches_its_callback():
    """The handler skips TrainerCallback's own (empty) events; an event a callback defines -- in a subclass,
    on the instance, or on a duck-typed callback -- is called every time."""
    calls = []

    class Sub(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            calls.append("subclass")

    class Duck:
        def on_step_begin(self, args, state, control, **kwargs):
            calls.append("duck")

    on_instance = TrainerCallback()
    on_instance.on_step_begin = lambda args, state, control, **kwargs: calls.append("instance")
    handler = CallbackHandler([Sub(), TrainerCallback(), on_instance, Duck()])
    for _ in range(2):
        handler.on_step_begin(make_args(), TrainerState(), TrainerControl())
    assert calls == ["subclass", "instance", "duck"] * 2


def test_base_callback_events_are_noops():
    cb = TrainerCallback()
    events = ["on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
              "on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_substep_end", "on_step_end",
              "on_evaluate", "on_predict", "on_save", "on_log", "on_prediction_step", "on_push_begin"]
    control = TrainerControl()
    for event in events:
        assert getattr(cb, event)(make_args(), TrainerState(), control, metrics={}, logs={}) is None
        assert hasattr(CallbackHandler, event)
    assert control == TrainerControl()


# --- CallbackHandler management ------------------------------------------------------------------------


def test_handler_add_pop_remove():
    printer = PrinterCallback()
    handler = CallbackHandler([DefaultFlowCallback, printer])
    assert handler.callback_list == "DefaultFlowCallback\nPrinterCallback"
    assert isinstance(handler.callbacks[0], DefaultFlowCallback)

    seen = []  # transformers' warning, on its logger (which may not propagate to caplog's root handler)
    capture = logging.Handler()
    capture.emit = lambda record: seen.append(record.getMessage())
    hf_logger = logging.getLogger("transformers.trainer_callback")
    hf_logger.addHandler(capture)
    try:
        handler.add_callback(DefaultFlowCallback())
    finally:
        hf_logger.removeHandler(capture)
    assert len(seen) == 1 and "DefaultFlowCallback'> to the callbacks" in seen[0]
    assert "there is already one" in seen[0]
    assert handler.callback_list == "DefaultFlowCallback\nPrinterCallback\nDefaultFlowCallback"

    popped = handler.pop_callback(PrinterCallback)
    assert popped is printer
    assert handler.pop_callback(printer) is None
    assert handler.callback_list == "DefaultFlowCallback\nDefaultFlowCallback"

    handler.remove_callback(DefaultFlowCallback)
    assert handler.callback_list == "DefaultFlowCallback"
    remaining = handler.callbacks[0]
    handler.remove_callback(remaining)
    assert handler.callbacks == []
    with pytest.raises(ValueError):  # transformers' handler: list.remove's error
        handler.remove_callback(printer)


# --- EarlyStoppingCallback -----------------------------------------------------------------------------


def run_evals(callback, args, values):
    """Feed evaluations, updating best_metric as the Trainer does; return the 1-based eval that stopped."""
    state = TrainerState()
    handler = CallbackHandler([callback])
    control = handler.on_train_begin(args, state, TrainerControl())
    greater = args.greater_is_better
    for i, value in enumerate(values, start=1):
        control = handler.on_evaluate(args, state, control, metrics={args.metric_for_best_model: value})
        if state.best_metric is None or (value > state.best_metric if greater else value < state.best_metric):
            state.best_metric = value
        if control.should_training_stop:
            return i
    return None


def test_early_stopping_lower_is_better():
    args = make_args(eval_strategy="steps", metric_for_best_model="eval_loss", greater_is_better=False,
                     load_best_model_at_end=True)
    # improves at evals 1-3, then 4 and 5 do not improve -> patience 2 stops at eval 5
    cb = EarlyStoppingCallback(early_stopping_patience=2)
    assert run_evals(cb, args, [1.0, 0.8, 0.7, 0.75, 0.7, 0.1]) == 5
    assert cb.early_stopping_patience_counter == 2
    # a counter resets on improvement
    cb = EarlyStoppingCallback(early_stopping_patience=2)
    assert run_evals(cb, args, [1.0, 1.1, 0.9, 1.0, 0.5, 0.6]) is None


def test_early_stopping_greater_is_better_and_threshold():
    args = make_args(eval_strategy="epoch", metric_for_best_model="accuracy", greater_is_better=True,
                     load_best_model_at_end=True)
    cb = EarlyStoppingCallback(early_stopping_patience=1)
    # metric name without eval_ prefix is looked up as eval_accuracy
    state = TrainerState()
    control = TrainerControl()
    cb.on_evaluate(args, state, control, metrics={"eval_accuracy": 0.5})
    assert cb.early_stopping_patience_counter == 0
    state.best_metric = 0.5
    cb.on_evaluate(args, state, control, metrics={"eval_accuracy": 0.6})
    assert cb.early_stopping_patience_counter == 0 and not control.should_training_stop
    state.best_metric = 0.6
    cb.on_evaluate(args, state, control, metrics={"eval_accuracy": 0.4})
    assert control.should_training_stop is True

    # improvements smaller than the threshold do not count
    cb = EarlyStoppingCallback(early_stopping_patience=3, early_stopping_threshold=0.05)
    args = make_args(eval_strategy="steps", metric_for_best_model="eval_accuracy", greater_is_better=True)
    assert run_evals(cb, args, [0.5, 0.52, 0.54, 0.56]) == 4


def test_early_stopping_requires_metric_and_eval_strategy(caplog):
    cb = EarlyStoppingCallback()
    # transformers' own callback: its assertions and warning
    with pytest.raises(AssertionError, match="metric_for_best_model"):
        cb.on_train_begin(make_args(eval_strategy="steps"), TrainerState(), TrainerControl())
    with pytest.raises(AssertionError, match="IntervalStrategy of steps or epoch"):
        cb.on_train_begin(make_args(eval_strategy="no", metric_for_best_model="loss"), TrainerState(),
                          TrainerControl())
    with caplog.at_level(logging.WARNING, logger="transformers.trainer_callback"):
        cb.on_train_begin(make_args(eval_strategy=Strategy.STEPS, metric_for_best_model="loss"),
                          TrainerState(), TrainerControl())
    assert "load_best_model_at_end" in caplog.text


def test_early_stopping_missing_metric_warns_and_skips(caplog):
    args = make_args(eval_strategy="steps", metric_for_best_model="f1", greater_is_better=True)
    cb = EarlyStoppingCallback()
    control = TrainerControl()
    with caplog.at_level(logging.WARNING, logger="transformers.trainer_callback"):
        cb.on_evaluate(args, TrainerState(best_metric=1.0), control, metrics={"eval_loss": 0.3})
    assert "did not find eval_f1" in caplog.text
    assert cb.early_stopping_patience_counter == 0 and not control.should_training_stop


def test_early_stopping_state_round_trip():
    cb = EarlyStoppingCallback(early_stopping_patience=4, early_stopping_threshold=0.1)
    cb.early_stopping_patience_counter = 3
    restored = EarlyStoppingCallback.from_state(json.loads(json.dumps(cb.state())))
    assert (restored.early_stopping_patience, restored.early_stopping_threshold,
            restored.early_stopping_patience_counter) == (4, 0.1, 3)


# --- TrainerState / TrainerControl serialisation ----------------------------------------------------------


def test_trainer_state_json_round_trip(tmp_path):
    cb = EarlyStoppingCallback(early_stopping_patience=2)
    cb.early_stopping_patience_counter = 1
    state = TrainerState(
        epoch=1.5, global_step=30, max_steps=40, train_batch_size=8, num_train_epochs=2,
        num_input_tokens_seen=1234, total_flos=5.5e12,
        log_history=[{"loss": 0.5, "step": 10}, {"eval_loss": 0.4, "step": 20}],
        best_metric=0.4, best_global_step=20, best_model_checkpoint="out/checkpoint-20",
        is_world_process_zero=False, trial_name="t0", trial_params={"lr": 0.001},
        stateful_callbacks=[cb, TrainerControl(should_save=True)],
    )
    assert state.stateful_callbacks["EarlyStoppingCallback"]["attributes"] == {
        "early_stopping_patience_counter": 1
    }
    assert state.stateful_callbacks["TrainerControl"]["args"]["should_save"] is True

    path = tmp_path / "trainer_state.json"
    state.save_to_json(path)
    loaded = TrainerState.load_from_json(path)
    assert loaded == state
    assert json.loads(path.read_text()) == state_to_dict(state)
    assert state_from_dict(state_to_dict(state)) == state
    assert state_to_json(loaded) == path.read_text()

    restored_control = TrainerControl.from_state(loaded.stateful_callbacks["TrainerControl"])
    assert restored_control == TrainerControl(should_save=True)


def test_trainer_state_defaults_and_unknown_keys(caplog):
    a, b = TrainerState(), TrainerState()
    a.log_history.append({"loss": 1.0})
    assert b.log_history == []  # no shared mutable default
    with caplog.at_level(logging.WARNING, logger="raytrainer.callbacks"):
        state = state_from_dict({"global_step": 7, "from_the_future": 1})
    assert state.global_step == 7
    assert "from_the_future" in caplog.text


def test_stateful_callbacks_rejects_non_exportable_and_lists_duplicates():
    with pytest.raises(TypeError, match="PrinterCallback"):
        TrainerState(stateful_callbacks=[PrinterCallback()])
    state = TrainerState(stateful_callbacks=[EarlyStoppingCallback(1), EarlyStoppingCallback(2)])
    entries = state.stateful_callbacks["EarlyStoppingCallback"]
    assert [e["args"]["early_stopping_patience"] for e in entries] == [1, 2]
    with pytest.raises(NotImplementedError):
        ExportableState().state()


def test_compute_steps_ratios_and_absolute_values():
    state = TrainerState()
    state.compute_steps(SimpleNamespace(logging_steps=0.1, eval_steps=0.25, save_steps=50), max_steps=101)
    assert (state.logging_steps, state.eval_steps, state.save_steps) == (11, 26, 50)
    state = TrainerState()
    state.compute_steps(SimpleNamespace(logging_steps=5, eval_steps=None, save_steps=0.5), max_steps=9)
    assert (state.logging_steps, state.eval_steps, state.save_steps) == (5, 500, 5)


def test_control_resets():
    control = TrainerControl(True, True, True, True, True)
    control._new_step()
    assert (control.should_save, control.should_evaluate, control.should_log) == (False, False, False)
    assert control.should_epoch_stop and control.should_training_stop
    control._new_epoch()
    assert not control.should_epoch_stop and control.should_training_stop
    control._new_training()
    assert control == TrainerControl()


# --- ProgressCallback / PrinterCallback -----------------------------------------------------------------


def test_progress_bar_follows_global_step_with_missing_events():
    out = io.StringIO()
    cb = ProgressCallback(file=out)
    args, control = make_args(), TrainerControl()
    state = TrainerState(max_steps=10)
    cb.on_train_begin(args, state, control)
    bar = cb.training_bar
    for step in (3, 7, 10):
        state.global_step = step
        cb.on_step_end(args, state, control)
        assert bar.n == step
    assert bar.total == 10
    cb.on_log(args, state, control, logs={"loss": 0.123456789, "learning_rate": 2.5e-05, "total_flos": 1.0,
                                          "note": "x" * 200})
    assert bar.postfix == "loss=0.1235, learning_rate=2.5e-05"  # beside steps/s and the ETA
    cb.on_log(args, state, control, logs={"eval_loss": 0.5})  # an evaluation's log leaves the bar's loss
    assert bar.postfix == "loss=0.1235, learning_rate=2.5e-05"
    cb.on_train_end(args, state, control)
    assert bar.n == 10 and cb.training_bar is None
    text = out.getvalue()
    assert "10/10" in text and "it/s, loss=0.1235, learning_rate=2.5e-05]" in text
    assert "'loss': '0.1235'" in text
    assert "total_flos" not in text
    assert "String too long to display, length: 200 > 100" in text


def test_a_search_trial_s_bar_is_named_after_the_trial():
    cb = ProgressCallback(file=io.StringIO())
    cb.on_train_begin(make_args(), TrainerState(max_steps=4, trial_name="3"), TrainerControl())
    assert cb.training_bar.desc == "trial 3"
    cb.on_train_begin(make_args(), TrainerState(max_steps=4), TrainerControl())
    assert cb.training_bar.desc == ""


def test_progress_bar_catches_up_at_train_end_and_resume():
    out = io.StringIO()
    cb = ProgressCallback(file=out)
    args, control = make_args(), TrainerControl()
    state = TrainerState(max_steps=10, global_step=4)  # resumed from checkpoint-4
    cb.on_train_begin(args, state, control)
    bar = cb.training_bar
    assert bar.n == 4
    state.global_step = 6
    cb.on_step_end(args, state, control)
    assert bar.n == 6
    state.global_step = 10  # last step event never relayed
    cb.on_train_end(args, state, control)
    assert bar.n == 10


def test_progress_prediction_bar_and_non_zero_rank():
    out = io.StringIO()
    cb = ProgressCallback(file=out)
    args, control = make_args(), TrainerControl()
    state = TrainerState(max_steps=5)
    for _ in range(3):
        cb.on_prediction_step(args, state, control, eval_dataloader=[0, 1, 2])
    assert cb.prediction_bar.n == 3 and cb.prediction_bar.total == 3
    cb.on_evaluate(args, state, control, metrics={})
    assert cb.prediction_bar is None
    cb.on_prediction_step(args, state, control, eval_dataloader=iter([0]))  # no length: no bar
    assert cb.prediction_bar is None

    other = ProgressCallback(file=io.StringIO())
    rank1 = TrainerState(max_steps=5, is_world_process_zero=False)
    other.on_train_begin(args, rank1, control)
    rank1.global_step = 5
    other.on_step_end(args, rank1, control)
    other.on_log(args, rank1, control, logs={"loss": 1.0})
    other.on_train_end(args, rank1, control)
    assert other.training_bar is None and other.file.getvalue() == ""


def test_printer_callback_prints_without_private_keys(capsys):
    cb = PrinterCallback()
    logs = {"loss": 0.25, "total_flos": 3.0, "step": 4}
    cb.on_log(make_args(), TrainerState(), TrainerControl(), logs=logs)
    assert capsys.readouterr().out.strip() == "{'loss': '0.25', 'step': 4}"
    cb.on_log(make_args(), TrainerState(is_local_process_zero=False), TrainerControl(), logs=logs)
    assert capsys.readouterr().out == ""


def test_the_drivers_display_handler_has_no_flow_and_no_warning_about_it(tmp_path, caplog):
    """The driver only shows what the workers' handlers decided: its handler has the driver's callbacks
    alone, and transformers' warning about a missing DefaultFlowCallback (printed once per run) stays out."""
    import torch

    from raytrainer import Trainer, TrainingArguments
    from raytrainer.driver.display import DriverDisplay

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", disable_tqdm=False)
    trainer = Trainer(model=torch.nn.Linear(2, 1), args=args)
    with caplog.at_level(logging.WARNING):
        display = DriverDisplay(trainer)
    assert "DefaultFlowCallback" not in caplog.text
    names = [type(cb).__name__ for cb in display.handler.callbacks]
    assert names == ["ProgressCallback"], names
