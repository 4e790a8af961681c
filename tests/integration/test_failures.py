"""Failures classified on Ray workers: a deterministic one ends the run at once whatever max_failures says."""

from __future__ import annotations

import pytest
from models import CountTrainingStarts, InfLossOnRank, Regressor, make_data

from raytrainer import TrainingArguments
from raytrainer.worker.nonfinite import NonFiniteLossError


def test_a_nonfinite_loss_on_one_rank_stops_the_run_and_is_not_retried(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), num_workers=2, max_failures=1, max_steps=4,
                             per_device_train_batch_size=4, save_strategy="steps", save_steps=1,
                             report_to="none", disable_tqdm=True)
    trainer = InfLossOnRank(model=Regressor(), args=args, train_dataset=make_data(32),
                            callbacks=[CountTrainingStarts()])
    with pytest.raises(NonFiniteLossError, match=r"rank 1 computed a training loss of inf in the update to "
                                                 r"step 2") as info:
        trainer.train()
    assert any("rank 1; a deterministic failure: not retried" in note
               for note in getattr(info.value, "__notes__", []))
    # Ray restarted the workers (max_failures=1), but nothing trained again: one start per rank
    assert sorted((tmp_path / "train-starts").read_text().split("\n")) == ["", "rank 0", "rank 1"]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]  # before the bad step


def test_the_console_shows_the_run_and_its_prints_not_ray_s_internals(tmp_path, capfd):
    """At default log levels: what the workers' code prints reaches the console once per line (with its
    rank), Ray's own lines (controller, worker-group start) do not, nor transformers' INFO lines."""
    from models import PrintingTrainer

    args = TrainingArguments(output_dir=str(tmp_path), num_workers=2, max_steps=3, save_strategy="no",
                             per_device_train_batch_size=4, report_to="none", disable_tqdm=True)
    capfd.readouterr()
    PrintingTrainer(model=Regressor(), args=args, train_dataset=make_data(32)).train()
    console = "".join(capfd.readouterr())
    assert console.count("PRINTED-BY-RANK-0") == 1 and "[rank0] PRINTED-BY-RANK-0" in console
    assert console.count("PRINTED-BY-RANK-1") == 1 and "[rank1] PRINTED-BY-RANK-1" in console
    for internal in ("TrainController", "Attempting to start training worker group", "RayTrainWorker",
                     "PlacementGroupCleaner", "Running training"):
        assert internal not in console, internal


def test_a_lost_worker_is_replaced_and_the_run_resumes_bitwise(tmp_path):
    """max_failures=1: rank 1's process dies at step 5; Ray starts a new worker group, which resumes from the
    last committed checkpoint; the final weights equal an uninterrupted run's, bit for bit."""
    import torch
    from models import DieOnceOnRank

    from raytrainer import Trainer

    def run(out, callbacks):
        args = TrainingArguments(output_dir=str(out), num_workers=2, max_failures=1, max_steps=8,
                                 per_device_train_batch_size=4, save_strategy="steps", save_steps=2,
                                 report_to="none", disable_tqdm=True, seed=3)
        trainer = Trainer(model=Regressor(), args=args, train_dataset=make_data(32), callbacks=callbacks)
        trainer.train()
        return trainer

    reference = run(tmp_path / "reference", [])
    resumed = run(tmp_path / "killed", [DieOnceOnRank(step=5, rank=1)])
    assert (tmp_path / "killed" / "died").exists()  # the worker did die
    assert resumed.state.global_step == 8
    for name, tensor in reference.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
