"""Ray's preemption notice on Ray workers: every rank saves a checkpoint at the same step boundary, commits
it and takes no further step; Ray Train restarts the group at the notice's deadline, and the restart resumes
from that checkpoint, ending where an uninterrupted run ends (worker/preemption.py)."""

from __future__ import annotations

import json

import pytest
from models import STRATEGY_ARGS, PreemptionNoticeAt, Regressor, StepLog, make_data, rng_files

from raytrainer import Trainer, TrainingArguments


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_a_notice_saves_on_every_rank_and_the_restart_at_its_deadline_resumes_there_bitwise(tmp_path, capfd,
                                                                                         strategy):
    """DDP, FSDP (a DCP checkpoint, each rank its shard) and ZeRO-3."""
    def args(out: str) -> TrainingArguments:
        return TrainingArguments(output_dir=str(tmp_path / out), num_workers=2, max_steps=8, max_failures=0,
                                 per_device_train_batch_size=4, save_strategy="no", logging_steps=1,
                                 report_to="none", disable_tqdm=True, seed=3, **STRATEGY_ARGS[strategy])

    plain = Trainer(model=Regressor(), args=args("plain"), train_dataset=make_data(64))
    plain.train()
    trainer = Trainer(model=Regressor(), args=args("out"), train_dataset=make_data(64),
                      callbacks=[PreemptionNoticeAt(rank=1, step=3, deadline_s=3.0), StepLog()])
    capfd.readouterr()
    assert trainer.train().global_step == 8
    console = "".join(capfd.readouterr())
    # rank 1 flagged the notice at step 3; the ranks agreed on it at the end of step 4 (one check behind)
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-4"]
    checkpoint = tmp_path / "out" / "checkpoint-4"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 4
    files = {p.name for p in checkpoint.iterdir()}
    assert {"manifest.json", *rng_files(0, 1)} <= files  # committed
    if strategy != "ddp":  # sharded: each rank's part of the model and optimizer, no consolidated model
        assert "model.safetensors" not in files
    assert "every rank saves a checkpoint at step 4, then waits for the node to go" in console
    assert "checkpoint-4 is committed; no step until the node goes" in console
    # Ray Train restarted the group at the deadline (a preemption: max_failures=0 is not spent), and the
    # restart resumed from checkpoint-4; the first group took no step after it
    assert "restart 1: Ray Train started the worker group again" in console
    assert f"resuming from {checkpoint}" in console
    lines = [line.split() for line in (tmp_path / "out" / "steps").read_text().splitlines()]
    groups = list(dict.fromkeys(pid for pid, _ in lines))
    assert [[int(s) for pid, s in lines if pid == g] for g in groups] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    for (name, a), b in zip(plain.model.state_dict().items(), trainer.model.state_dict().values()):
        assert a.equal(b), name  # where the uninterrupted run ends, bit for bit
    plain.close()
    trainer.close()
