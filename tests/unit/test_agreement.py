"""A hosted trainer's CallbackHandler agrees the ranks' control flags during training
(raytrainer/worker/agreement.py), on two gloo ranks in two processes: transformers' own CallbackHandler,
events called as transformers' loop calls them. The runs on Ray workers, one per host, are in
tests/integration/test_guarantees.py."""

from __future__ import annotations

import torch
from transformers.trainer_callback import (
    CallbackHandler,
    DefaultFlowCallback,
    TrainerCallback,
    TrainerControl,
)
from two_ranks import run_two_ranks

from raytrainer.rank_context import RankContext
from raytrainer.worker.agreement import agree_on_flags


class OnRankOne(TrainerCallback):
    """Rank 1 asks: a stop after a micro-batch, an evaluation in on_log."""

    def __init__(self, rank):
        self.rank = rank

    def on_substep_end(self, args, state, control, **kwargs):
        if self.rank == 1:
            control.should_training_stop = True

    def on_log(self, args, state, control, **kwargs):
        if self.rank == 1:
            control.should_evaluate = True


class Looks(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        self.seen = state.global_step


class Trainer:
    def __init__(self, callbacks):
        self.callback_handler = CallbackHandler([DefaultFlowCallback(), *callbacks], None, None, None, None)


def _all_reduces() -> list:
    """Counts torch.distributed.all_reduce calls (the agreement's one collective)."""
    calls = []
    real = torch.distributed.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    torch.distributed.all_reduce = counting
    return calls


def _rank(rank: int, store_path: str, results) -> None:
    import torch.distributed as dist
    from transformers import TrainerState, TrainingArguments

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"file://{store_path}")
    try:
        ctx = RankContext(world_size=2, rank=rank)
        args, state = TrainingArguments(output_dir="unused", report_to="none"), TrainerState()
        calls = _all_reduces()
        out = {}
        # only looking: no agreement, not even during training
        quiet = Trainer([Looks()])
        agree_on_flags(quiet, ctx)
        handler = quiet.callback_handler
        control = handler.on_train_begin(args, state, TrainerControl())
        control = handler.on_step_end(args, state, control)
        handler.on_train_end(args, state, control)
        out["quiet all-reduces"] = len(calls)
        # a callback that decides on rank 1 only
        trainer = Trainer([OnRankOne(rank)])
        agree_on_flags(trainer, ctx)
        handler = trainer.callback_handler
        # outside training nothing is agreed: rank 1 alone may log (a call only rank 0 makes cannot hang)
        if rank == 1:
            handler.on_log(args, state, TrainerControl(), logs={})
        out["before training"] = len(calls)
        control = handler.on_train_begin(args, state, TrainerControl())
        control = handler.on_substep_end(args, state, control)
        out["stop after a micro-batch"] = control.should_training_stop
        control = handler.on_log(args, state, control, logs={"loss": 1.0})
        out["evaluate after on_log"] = control.should_evaluate
        handler.on_train_end(args, state, control)
        out["training all-reduces"] = len(calls) - out["before training"]
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def test_flags_one_rank_sets_are_every_ranks_during_training_only(tmp_path):
    items = run_two_ranks(_rank, str(tmp_path / "store"))
    got = dict(items)
    expected = {"quiet all-reduces": 0, "before training": 0, "stop after a micro-batch": True,
                "evaluate after on_log": True, "training all-reduces": 2}
    assert got == {0: expected, 1: expected}, got


def test_a_hosted_handler_takes_what_raytrainers_handler_takes_from_a_callback(tmp_path):
    """transformers' loop in one process, its handler made agreeing as on a hosted rank: a callback may
    return a mapping of flags (it stops the run at step 3), and a return value of another type is refused,
    naming the callback, where transformers' handler would put it in place of the control."""
    import pytest
    import transformers

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 2)

        def forward(self, x, labels=None):
            return {"loss": torch.nn.functional.cross_entropy(self.linear(x), labels)}

    class StopAtThree(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            return {"should_training_stop": True} if state.global_step == 3 else None

    class Returns42(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            return 42

    rows = [{"x": torch.randn(4), "labels": i % 2} for i in range(64)]

    def trainer(callback):
        args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=8, report_to="none",
                                              per_device_train_batch_size=4, use_cpu=True,
                                              save_strategy="no", disable_tqdm=True)
        built = transformers.Trainer(model=Net(), args=args, train_dataset=rows, callbacks=[callback])
        agree_on_flags(built, RankContext())
        return built

    assert trainer(StopAtThree()).train().global_step == 3
    with pytest.raises(TypeError, match=r"callback Returns42\.on_step_end returned int 42"):
        trainer(Returns42()).train()
