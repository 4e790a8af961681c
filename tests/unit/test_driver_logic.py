"""The driver's logic, in-process and without Ray: a Trainer with ``num_workers=2`` whose worker group is
driven by tests/unit/fake_group.py, which replays the messages a 2-rank group sends (raytrainer.protocol).
Everything on the driver's side is the real code: dispatch, the pump, log routing, display callbacks and
stop decisions, the checkpoint registry and its rotation, failure classification, result absorption, and
the warm group's life across calls."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch
from fake_group import Fail, FakeBackend, Reply, WaitForDecision, event

from raytrainer import Trainer, TrainerCallback, TrainingArguments
from raytrainer.callbacks import TrainerState, state_to_dict
from raytrainer.driver.group import WorkerGroup, attach
from raytrainer.hosted_recipe import Recipe
from raytrainer.protocol import (
    Attempt,
    CallbackEvent,
    CheckpointCommitted,
    Kind,
    LogLine,
    Method,
    RankResult,
)
from raytrainer.trainer_utils import TrainOutput

pytestmark = pytest.mark.timeout(120)


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x, labels=None):
        out = self.linear(x).squeeze(-1)
        if labels is None:
            return {"logits": out}
        return {"loss": ((out - labels) ** 2).mean(), "logits": out}


def _data(n=16):
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(2, generator=g), "labels": torch.tensor(1.0)} for _ in range(n)]


class Counter(TrainerCallback):
    """A worker-side callback: what it counts on rank 0 comes back to the driver's instance."""

    def __init__(self):
        self.steps = 0


class Recorder(TrainerCallback):
    """A driver-side callback: it sees rank 0's events, replayed."""

    on_driver = True

    def __init__(self, stop_at_evaluation: int | None = None):
        self.events, self.stop_at = [], stop_at_evaluation
        self.may_stop_training = stop_at_evaluation is not None
        self.evaluations = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("on_log", state.global_step, dict(logs)))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evaluations += 1
        self.events.append(("on_evaluate", state.global_step, dict(metrics)))
        if self.evaluations == self.stop_at:
            control.should_training_stop = True


def _state(step: int, **fields) -> dict:
    state = TrainerState(global_step=step, max_steps=4, epoch=1.0, is_world_process_zero=True,
                         is_local_process_zero=True, **fields)
    return state_to_dict(state)


def _snapshot(step: int) -> dict:
    return {"global_step": step, "max_steps": 4, "epoch": step / 4}


def _train_reply(tmp_path, counter_steps=4, checkpoints=()) -> Reply:
    # the final weights rank 0 would have written to storage (raytrainer.final_weights)
    from safetensors.torch import save_file

    os.makedirs(tmp_path / "weights", exist_ok=True)
    save_file({"linear.weight": torch.full((1, 2), 0.5), "linear.bias": torch.full((1,), -0.25)},
              str(tmp_path / "weights" / "model.safetensors"))
    steps = [
        event(Kind.ATTEMPT, Attempt(0)),
        event(Kind.LOG, LogLine(logging.INFO, "[rank0] INFO user: hello from rank 0")),
        event(Kind.LOG, LogLine(logging.WARNING, "[rank1] WARNING user: rank 1 warns"), rank=1),
        event(Kind.CALLBACK, CallbackEvent("on_train_begin", _snapshot(0), {})),
        event(Kind.CALLBACK, CallbackEvent("on_log", _snapshot(2), {"logs": {"loss": 0.5, "step": 2}})),
        *(event(Kind.CHECKPOINT, CheckpointCommitted(name, step, f"file://{tmp_path}/out/{name}"))
          for name, step in checkpoints),
        event(Kind.CALLBACK, CallbackEvent("on_train_end", _snapshot(4), {})),
    ]
    output = TrainOutput(4, 0.25, {"train_loss": 0.25, "epoch": 1.0})
    history = [{"loss": 0.5, "step": 2}, {"train_loss": 0.25, "step": 4}]
    return Reply(steps, {
        0: RankResult(4, output, _state(4, log_history=history), f"file://{tmp_path}/weights",
                      [("Counter", {"steps": counter_steps})]),
        1: RankResult(4),
    })


def _eval_reply(stop_decision=False) -> Reply:
    metrics = {"eval_loss": 0.125}
    steps = [event(Kind.ATTEMPT, Attempt(0)),
             event(Kind.CALLBACK, CallbackEvent("on_evaluate", _snapshot(4), {"metrics": metrics}))]
    return Reply(steps, {0: RankResult(4, metrics, None, None, []), 1: RankResult(4)})


def _trainer(tmp_path, backend, callbacks=(), **kw):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), num_workers=2, max_steps=4, report_to="none",
                             disable_tqdm=True, per_device_train_batch_size=4, **kw)
    trainer = Trainer(model=Regression(), args=args, train_dataset=_data(), eval_dataset=_data(8),
                      callbacks=list(callbacks))
    attach(trainer, WorkerGroup(trainer.args, backend=backend))
    return trainer


def test_a_call_is_a_command_and_rank_zeros_result_is_taken_in(tmp_path, capsys):
    backend = FakeBackend({"train": _train_reply(tmp_path)})
    counter, recorder = Counter(), Recorder()
    trainer = _trainer(tmp_path, backend, [counter, recorder], save_strategy="no")

    output = trainer.train()

    (command,) = backend.commands
    assert command.method is Method.TRAIN and command.id == 1
    (spec,) = command.spec
    import cloudpickle

    shipped = cloudpickle.loads(spec.trainer)  # what the ranks build the Trainer from: no driver state
    if isinstance(shipped, Recipe):  # transformers' loop: the constructor's arguments, in the object store
        assert shipped.key == trainer._recipe.key and spec.keep == (shipped.key,)
        assert command.spec[0].payload  # fetched by a rank only when it builds the trainer
    else:
        assert type(shipped) is Trainer and shipped.args.num_workers == 2 and "_group" not in vars(shipped)
    assert spec.kwargs["resume_from_checkpoint"] is None
    # rank 0's result, taken into the driver's Trainer and its callbacks
    assert output.global_step == 4 and output.training_loss == 0.25
    assert trainer.state.global_step == 4
    assert trainer.state.log_history == [{"loss": 0.5, "step": 2}, {"train_loss": 0.25, "step": 4}]
    assert counter.steps == 4  # the worker-side instance's count, on the driver's instance
    # the trained weights, from storage into the driver's model on first use
    assert trainer.model.linear.weight.tolist() == [[0.5, 0.5]]
    assert trainer.model.linear.bias.tolist() == [-0.25]
    # rank 0's callback events replayed into the driver-side callback
    assert recorder.events == [("on_log", 2, {"loss": 0.5, "step": 2})]
    # every rank's log lines reach the driver's console
    err = capsys.readouterr().err
    assert "[rank0] INFO user: hello from rank 0" in err and "[rank1] WARNING user: rank 1 warns" in err


def test_the_group_stays_warm_across_calls_and_ends_with_close(tmp_path):
    backend = FakeBackend({"train": _train_reply(tmp_path), "evaluate": _eval_reply()})
    trainer = _trainer(tmp_path, backend, save_strategy="no")
    group = trainer.__dict__["_group"]

    trainer.train()
    metrics = trainer.evaluate()

    assert metrics == {"eval_loss": 0.125}
    assert [c.method for c in backend.commands] == [Method.TRAIN, Method.EVALUATE]
    assert [c.id for c in backend.commands] == [1, 2]
    assert backend.prepared == backend.launched == 1  # one group, started once, for both calls
    assert group.alive
    trainer.close()
    assert not group.alive and backend.channels[0].killed and "_group" not in vars(trainer)


def test_trainers_of_one_process_share_an_idle_group_and_shutdown_ends_it(tmp_path, monkeypatch):
    """A second Trainer of the same shape runs on the first one's idle group (no second group starts); the
    first takes it back for its next call; a collected Trainer leaves it idle for the next one, until
    ``raytrainer.shutdown()``."""
    import gc

    import raytrainer
    from raytrainer.driver import group as group_module

    backend = FakeBackend({"train": _train_reply(tmp_path), "evaluate": _eval_reply()})
    monkeypatch.setattr("raytrainer.driver.ray_train.RayBackend", lambda: backend)  # new groups: this one
    first = _trainer(tmp_path, backend, save_strategy="no")
    group = first.__dict__["_group"]
    first.train()

    args = TrainingArguments(output_dir=str(tmp_path / "second"), num_workers=2, report_to="none",
                             disable_tqdm=True, per_device_eval_batch_size=4)
    second = Trainer(model=Regression(), args=args, eval_dataset=_data(8))
    assert second.evaluate() == {"eval_loss": 0.125}
    assert second.__dict__["_group"] is group and "_group" not in vars(first)
    assert first.evaluate() == {"eval_loss": 0.125}  # taken back: second is idle
    assert first.__dict__["_group"] is group and "_group" not in vars(second)
    # a Trainer of another shape does not take it
    other = Trainer(model=Regression(), args=TrainingArguments(
        output_dir=str(tmp_path / "other"), num_workers=3, report_to="none"), eval_dataset=_data(8))
    assert group_module.idle_group_for(other, backend) is None

    del first, second
    gc.collect()
    assert group.alive and group.owner is None  # idle, for the next Trainer of the same shape
    third = Trainer(model=Regression(), args=args, eval_dataset=_data(8))
    third.evaluate()
    assert third.__dict__["_group"] is group
    assert backend.prepared == backend.launched == 1  # one group served the three Trainers
    assert [c.method for c in backend.commands] == [Method.TRAIN] + [Method.EVALUATE] * 3
    raytrainer.shutdown()
    assert not group.alive and backend.channels[0].killed


def test_trainers_in_turn_leave_one_idle_timer_not_one_each(tmp_path, monkeypatch):
    """Five Trainers of one shape, one after another, each collected after its call: the idle group they
    share has one idle timer (a thread) at a time, stopped when a Trainer takes the group and when it
    closes -- a script's sweep of Trainers left a thread per Trainer, each alive for IDLE_TIMEOUT_S."""
    import gc
    import threading

    import raytrainer

    def idle_timers() -> list[str]:
        return [t.name for t in threading.enumerate() if isinstance(t, threading.Timer) and t.is_alive()]

    backend = FakeBackend({"evaluate": _eval_reply()})
    monkeypatch.setattr("raytrainer.driver.ray_train.RayBackend", lambda: backend)
    args = TrainingArguments(output_dir=str(tmp_path / "sweep"), num_workers=2, report_to="none",
                             disable_tqdm=True, per_device_eval_batch_size=4)
    before = idle_timers()
    for _ in range(5):
        trainer = Trainer(model=Regression(), args=args, eval_dataset=_data(8))
        assert trainer.evaluate() == {"eval_loss": 0.125}
        group = trainer.__dict__["_group"]
        assert group.idle_timer is None  # held: no timer
        del trainer
        gc.collect()
        assert len(idle_timers()) == len(before) + 1
    assert backend.prepared == 1
    raytrainer.shutdown()
    time.sleep(0.1)  # a cancelled timer's thread returns at once
    assert idle_timers() == before and group.idle_timer is None


def test_committed_checkpoints_reach_the_registry_which_rotates_them(tmp_path):
    # three real committed checkpoints in the run's folder, from a run in this process
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, save_steps=1, report_to="none",
                             disable_tqdm=True, per_device_train_batch_size=4)
    Trainer(model=Regression(), train_dataset=_data(), args=args).train()
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    backend = FakeBackend({"train": _train_reply(tmp_path, checkpoints=[("checkpoint-2", 2),
                                                                       ("checkpoint-3", 3)])})
    trainer = _trainer(tmp_path, backend, save_steps=1, save_total_limit=1)

    trainer.train()

    # the driver rotated on each commit: only the latest is left
    assert sorted(n for n in os.listdir(tmp_path / "out") if n.startswith("checkpoint-")) == ["checkpoint-3"]


def test_a_restart_says_where_training_resumes_and_how_many_steps_are_trained_again(tmp_path, caplog):
    reply = _train_reply(tmp_path)
    uri = f"{tmp_path}/out/checkpoint-2"
    reply.steps[3:3] = [  # the first group reached step 3, then lost a worker; the second resumed
        event(Kind.CALLBACK, CallbackEvent("on_step_end", _snapshot(3), {})),
        event(Kind.ATTEMPT, Attempt(1, latest_checkpoint=uri)),
    ]
    trainer = _trainer(tmp_path, FakeBackend({"train": reply}), save_strategy="no")
    with caplog.at_level("WARNING", logger="raytrainer.driver.display"):
        trainer.train()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "raytrainer.driver.display"]
    assert line.startswith("restart 1: Ray Train started the worker group again after it lost a worker")
    assert line.endswith(f"resuming from {uri}; the group before reached step 3: 1 step(s) are trained again")

    from raytrainer.driver.display import restart_line

    assert restart_line(Attempt(2), reached=5).endswith(
        "no checkpoint of this call was committed, so the call runs again from its start")


def test_a_deterministic_failure_raises_the_workers_own_error_and_ends_the_group(tmp_path):
    class LabelError(ValueError):
        pass

    backend = FakeBackend({"train": Reply([event(Kind.ATTEMPT, Attempt(0))],
                                          fail=Fail(LabelError("labels must be float"), rank=1)),
                           "evaluate": _eval_reply()})
    trainer = _trainer(tmp_path, backend, save_strategy="no")

    with pytest.raises(LabelError, match="labels must be float") as caught:
        trainer.train()
    assert any("raised on Ray Train worker rank 1" in note for note in caught.value.__notes__)
    # the group is over; the next call starts another
    assert trainer.evaluate() == {"eval_loss": 0.125}
    assert backend.prepared == backend.launched == 2


def test_a_driver_side_callback_decides_after_each_evaluation(tmp_path):
    reply = _train_reply(tmp_path)
    at = next(i for i, e in enumerate(reply.steps) if e.kind is Kind.CALLBACK and e.payload.name == "on_log")

    def evaluated(step, loss):
        metrics = {"metrics": {"eval_loss": loss}}
        return event(Kind.CALLBACK, CallbackEvent("on_evaluate", _snapshot(step), metrics))

    evaluation = [evaluated(2, 1.0), WaitForDecision(0, 1), evaluated(3, 0.9), WaitForDecision(0, 2)]
    reply.steps[at + 1:at + 1] = evaluation
    backend = FakeBackend({"train": reply})
    recorder = Recorder(stop_at_evaluation=2)
    trainer = _trainer(tmp_path, backend, [recorder], save_strategy="no", eval_strategy="steps", eval_steps=1)

    trainer.train()

    # rank 0 waited for each decision: go on after the first evaluation, stop after the second
    assert backend.decisions == [False, True]
    assert backend.channels[0].stop
    assert [e[0] for e in recorder.events] == ["on_log", "on_evaluate", "on_evaluate"]


def test_a_new_groups_start_is_said_once_each_stage_and_a_warm_groups_calls_say_nothing(tmp_path, capsys):
    """The console says the workers are starting, when they are up and when the first step is done: for
    the group's first call only; the next call on the warm group starts nothing, and says nothing."""
    reply = _train_reply(tmp_path)
    step_ends = [event(Kind.CALLBACK, CallbackEvent("on_step_end", _snapshot(step), {})) for step in (1, 2)]
    reply.steps[4:4] = step_ends  # after on_train_begin
    backend = FakeBackend({"train": reply, "evaluate": _eval_reply()})
    trainer = _trainer(tmp_path, backend, save_strategy="no")

    trainer.train()
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("raytrainer: ")]
    assert [line.split(" in ")[0].split(",")[0] for line in said] == [
        "raytrainer: starting 2 worker(s) on Ray Train (DDP)", "raytrainer: workers up",
        "raytrainer: first step done"], said
    assert said[2].endswith(" s after the workers' start")
    trainer.evaluate()
    assert "raytrainer: " not in capsys.readouterr().err
    trainer.close()


def test_trainer_model_is_the_script_s_module_trained_and_a_new_one_is_what_the_next_call_builds(tmp_path):
    """As in one process: before any call ``trainer.model`` is the module the script gave (no worker
    starts for it); after ``train()`` the same object holds the trained weights, read from storage on first
    use; a module assigned to ``trainer.model`` is the model of the next call's ranks."""
    import cloudpickle
    import ray

    backend = FakeBackend({"train": [_train_reply(tmp_path), _train_reply(tmp_path)]})
    trainer = _trainer(tmp_path, backend, save_strategy="no")
    given = trainer.model
    assert given.linear.weight.tolist() != [[0.5, 0.5]] and backend.commands == []
    trainer.train()
    assert trainer.model is given and given.linear.weight.tolist() == [[0.5, 0.5]]

    replacement = Regression()
    with torch.no_grad():
        replacement.linear.weight.fill_(2.0)
    trainer.model = replacement
    assert trainer.model is replacement
    trainer.train()
    first, second = (cmd.spec[0] for cmd in backend.commands)
    if isinstance(cloudpickle.loads(second.trainer), Recipe):  # transformers' loop: the ranks' recipe
        assert cloudpickle.loads(second.trainer).key != cloudpickle.loads(first.trainer).key
        _, _, kwargs = cloudpickle.loads(ray.get(second.payload[0]))
        assert kwargs["model"].linear.weight.tolist() == [[2.0, 2.0]]
    assert trainer.model is replacement and replacement.linear.weight.tolist() == [[0.5, 0.5]]


def test_the_ranks_build_around_the_script_s_module_as_it_is_at_each_call_until_the_first_train(tmp_path):
    """As transformers' Trainer trains the module it holds: a layer frozen and weights loaded after the
    constructor reach the ranks at the next call (a new recipe); an unchanged module is not pickled again;
    after train() the driver's copy, filled with the trained weights, makes no new recipe."""
    import cloudpickle
    import ray

    backend = FakeBackend({"train": [_train_reply(tmp_path), _train_reply(tmp_path)]})
    trainer = _trainer(tmp_path, backend, save_strategy="no")
    module = trainer.model
    built = trainer._recipe
    module.linear.bias.requires_grad_(False)
    with torch.no_grad():
        module.linear.weight.fill_(3.0)
    trainer.train()
    assert trainer._recipe is not built
    _, _, kwargs = cloudpickle.loads(ray.get(backend.commands[0].spec[0].payload[0]))
    assert kwargs["model"].linear.weight.tolist() == [[3.0, 3.0]]
    assert not kwargs["model"].linear.bias.requires_grad and kwargs["model"].linear.weight.requires_grad

    trained = trainer._recipe
    assert trainer.model is module and module.linear.weight.tolist() == [[0.5, 0.5]]  # filled in place
    trainer.train()
    first, second = (cloudpickle.loads(cmd.spec[0].trainer) for cmd in backend.commands)
    assert trainer._recipe is trained and first.key == second.key


def test_arguments_the_script_changes_after_the_constructor_are_the_ranks_at_the_next_call(tmp_path):
    """``trainer.args.seed = 314`` between two train() calls (transformers' test_model_init): the next
    call's ranks build the trainer with seed 314, from the same payload in the object store (not pickled
    again); the hub token stays on the driver."""
    import cloudpickle

    backend = FakeBackend({"train": [_train_reply(tmp_path), _train_reply(tmp_path)]})
    trainer = _trainer(tmp_path, backend, save_strategy="no", hub_token="hf_secret")
    trainer.train()
    trainer.args.seed = 314
    trainer.train()
    first, second = (cmd.spec[0] for cmd in backend.commands)
    before, after = cloudpickle.loads(first.trainer), cloudpickle.loads(second.trainer)
    assert after.key != before.key and second.payload == first.payload
    _, _, _, plain, targs = after.fetched(second.payload).unpack(world_size=2)
    assert plain.seed == 314 and targs.seed == 314 and targs.hub_token is None
    assert before.fetched(first.payload).unpack(world_size=2)[3].seed == 42
    assert trainer.args.hub_token == "hf_secret"


def test_a_data_set_the_script_assigns_to_the_trainer_is_the_ranks_at_the_next_call(tmp_path):
    """``trainer.train_dataset = other`` between calls, as transformers' Trainer reads it at each call: the
    driver holds it, and the next call's ranks build the trainer with it."""
    import cloudpickle
    import ray

    backend = FakeBackend({"train": [_train_reply(tmp_path), _train_reply(tmp_path)]})
    trainer = _trainer(tmp_path, backend, save_strategy="no")
    trainer.train()
    other = _data(4)
    trainer.train_dataset = other
    assert trainer.train_dataset is other
    trainer.train()
    first, second = (cmd.spec[0] for cmd in backend.commands)
    assert second.payload != first.payload
    assert len(cloudpickle.loads(ray.get(first.payload[0]))[2]["train_dataset"]) == 16
    assert len(cloudpickle.loads(ray.get(second.payload[0]))[2]["train_dataset"]) == 4
