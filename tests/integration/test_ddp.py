"""DDP on 2 Ray Train workers (gloo): equivalence, cross-rank control, log routing, ordered predict."""

from __future__ import annotations

import copy
import json
import os
import threading

import numpy as np
import pytest
import torch
from models import (
    FlagsOnOneRank,
    LoggingTrainer,
    Regressor,
    SeenRows,
    SlowOnRank,
    StopAtStepOnRank,
    UnusedHead,
    make_data,
)

from raytrainer import ArgumentParser, Trainer, TrainerCallback, TrainingArguments


def _args(tmp_path, name: str, **kw) -> TrainingArguments:
    base = {"output_dir": str(tmp_path / name), "save_strategy": "no", "report_to": "none",
            "disable_tqdm": True, "optim": "adamw_torch", "learning_rate": 0.05, "max_grad_norm": 0.0}
    base.update(kw)
    return TrainingArguments(**base)


def test_two_workers_batch_8_match_one_process_batch_16(tmp_path):
    """2-worker DDP, per-device batch 8 == 1 process, batch 16: weights, eval loss and step count."""
    data, held_out = make_data(96), make_data(21, seed=7)
    model = Regressor()
    start = copy.deepcopy(model.state_dict())

    # SGD: its update is linear in the gradient, so DDP's g/2 + g'/2 against one mean over 16 differs
    # only in the last bits (Adam's 1/sqrt(v) would amplify those bits on tiny gradients).
    same = {"num_train_epochs": 2, "eval_strategy": "epoch", "logging_steps": 4, "optim": "sgd",
            "learning_rate": 0.5}
    ref = Trainer(model=copy.deepcopy(model), train_dataset=data, eval_dataset=held_out,
                  args=_args(tmp_path, "ref", num_workers=0, per_device_train_batch_size=16, **same))
    ref.train()

    ddp = Trainer(model=model, train_dataset=data, eval_dataset=held_out,
                  args=_args(tmp_path, "ddp", num_workers=2, per_device_train_batch_size=8, **same))
    out = ddp.train()

    assert out.global_step == ref.state.global_step == 12  # 96 / 16 per epoch, 2 epochs
    assert ddp.state.global_step == 12
    # The weights came through storage, not Ray: rank 0 wrote them once, the driver loads them on first use.
    assert sorted(os.listdir(tmp_path / "ddp" / ".raytrainer" / "final-model")) == ["model.safetensors"]
    moved = max((ddp.model.state_dict()[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-2, "the driver's model must hold the trained weights"
    for name, ref_param in ref.model.state_dict().items():
        torch.testing.assert_close(ddp.model.state_dict()[name], ref_param, rtol=1e-5, atol=1e-6)
    eval_ddp = [h["eval_loss"] for h in ddp.state.log_history if "eval_loss" in h]
    eval_ref = [h["eval_loss"] for h in ref.state.log_history if "eval_loss" in h]
    assert len(eval_ddp) == 2
    np.testing.assert_allclose(eval_ddp, eval_ref, rtol=1e-5)
    train_losses = [h["loss"] for h in ddp.state.log_history if "loss" in h]
    train_ref = [h["loss"] for h in ref.state.log_history if "loss" in h]
    assert len(train_losses) == 3
    np.testing.assert_allclose(train_losses, train_ref, rtol=1e-3)


def test_override_stop_and_log_levels_on_two_workers(tmp_path, capfd):
    """A subclass's compute_loss runs on every worker; a stop asked on rank 1 stops both ranks at step 3;
    with --log_level warning --log_level_replica error the replica's warning is not shown, the main's is."""
    parser = ArgumentParser(TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(args=[
        "--output_dir", str(tmp_path / "run"), "--num_workers", "2", "--max_steps", "10",
        "--per_device_train_batch_size", "4", "--save_strategy", "no", "--disable_tqdm", "1",
        "--log_level", "warning", "--log_level_replica", "error", "--log_on_each_node", "0",
    ])
    trainer = LoggingTrainer(model=Regressor(), args=args, train_dataset=make_data(64),
                             callbacks=[StopAtStepOnRank(step=3, rank=1)])
    out = trainer.train()
    captured = capfd.readouterr()
    console = captured.out + captured.err

    assert out.global_step == 3 and trainer.state.global_step == 3
    # the override ran on both workers (ERROR passes both levels)
    assert "[rank0] ERROR tests.integration: compute_loss override running on rank 0" in console
    assert "[rank1] ERROR tests.integration: compute_loss override running on rank 1" in console
    # log levels: main's warning shown, replica's not
    assert "[rank0] WARNING tests.integration: warning from rank 0" in console
    assert "warning from rank 1" not in console
    # every rank stopped at step 3 (its own log file says so)
    logs = tmp_path / "run" / "logs"
    for rank in (0, 1):
        text = (logs / f"rank-{rank}.log").read_text()
        assert f"rank {rank} ended at step 3" in text
    assert "warning from rank 1" not in (logs / "rank-1.log").read_text()
    assert "warning from rank 0" in (logs / "rank-0.log").read_text()


def test_predict_two_workers_every_example_once_in_order(tmp_path, caplog):
    """33 examples (odd), eval batch 4 on 2 workers: 33 rows, in dataset order, equal to a local forward.
    The command (kept by the channel for every worker) holds the trainer's recipe and a reference to its
    payload (the model and the datasets, in the object store), not the payload."""
    import logging

    caplog.set_level(logging.DEBUG, logger="raytrainer.driver.group")
    data = make_data(33, seed=3)
    model = Regressor(seed=5)
    with torch.no_grad():
        expected = model(torch.stack([d["x"] for d in data]))[0].numpy()
    trainer = Trainer(model=model, train_dataset=data,
                      args=_args(tmp_path, "pred", num_workers=2, per_device_eval_batch_size=4))
    out = trainer.predict(data)
    assert out.predictions.shape == (33, 3)
    np.testing.assert_allclose(out.predictions, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out.label_ids, [d["labels"] for d in data])
    assert out.metrics["test_loss"] > 0
    assert set(k.split("_")[0] for k in out.metrics) == {"test"}
    sizes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run spec: ")]
    spec_bytes, payload_bytes, command_bytes = (int(w) for w in sizes[0].replace(";", " ").split()
                                                if w.isdigit())
    assert payload_bytes > 5000 > max(spec_bytes, command_bytes)  # the datasets and model go by reference


def test_bad_input_fails_on_the_driver_before_any_worker(tmp_path, ray_session):
    """An unpicklable model_init is named on the driver; no Ray actor is created."""
    from ray_state import alive_actors

    lock = threading.Lock()

    def model_init():  # captures a lock: cannot be pickled
        with lock:
            return Regressor()

    def alive():  # this session's instance, not another's
        return {a["ActorID"] for a in alive_actors()}

    before = alive()
    # refused at train() (raytrainer's own loop) or already at construction (transformers' loop on the
    # workers: the constructor's arguments are pickled there, once)
    with pytest.raises(ValueError, match=r"Trainer\.model_init \(.*model_init\) cannot be pickled"):
        Trainer(model_init=model_init, train_dataset=make_data(16),
                args=_args(tmp_path, "bad", num_workers=2)).train()
    assert alive() <= before
    assert not os.path.exists(tmp_path / "bad" / "logs")


def test_demo_reaches_90_percent_on_two_workers(tmp_path):
    import train_digits

    accuracy = train_digits.main(["--output_dir", str(tmp_path / "demo"), "--disable_tqdm", "1",
                                  "--log_level", "warning"])
    assert accuracy > 0.90


def test_ray_dataset_is_sharded_per_worker(tmp_path):
    """A ray.data.Dataset trains on 2 workers, each reading its equal shard; evaluation sees every row."""
    import ray

    data = make_data(64)
    rows = [{"x": d["x"].numpy(), "label": d["labels"], "note": "unused"} for d in data]
    ds = ray.data.from_items(rows)
    model = Regressor()
    start = copy.deepcopy(model.state_dict())
    trainer = Trainer(model=model, train_dataset=ds, eval_dataset=ds,
                      args=_args(tmp_path, "raydata", num_workers=2, per_device_train_batch_size=8,
                                 per_device_eval_batch_size=8, num_train_epochs=2, eval_strategy="epoch"))
    out = trainer.train()
    # 64 rows split equally: 32 per rank, batch 8 -> 4 steps per epoch, 2 epochs
    assert out.global_step == 8
    assert max((trainer.model.state_dict()[k] - start[k]).abs().max().item() for k in start) > 1e-2
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == 2 and evals[-1]["eval_loss"] < evals[0]["eval_loss"] + 1e-6
    # the final eval loss equals a local evaluation of the returned weights on all 64 rows
    with torch.no_grad():
        x = torch.stack([d["x"] for d in data])
        y = torch.tensor([d["labels"] for d in data])
        expected = torch.nn.functional.cross_entropy(trainer.model(x)[0], y, reduction="none")
    batch_means = expected.view(8, 8).mean(dim=1)  # HF: each batch's mean loss, per example
    assert evals[-1]["eval_loss"] == pytest.approx(float(batch_means.mean()), rel=1e-5)


@pytest.mark.timeout(300)
def test_ray_dataset_rows_are_all_trained_on_in_a_new_order_every_epoch(tmp_path, capfd):
    """65 rows on 2 workers: the driver repeats row 0 so that Ray's equal split drops none (33 per rank, as
    transformers' distributed sampler pads), and each epoch reads them in an order of its own."""
    import re

    import ray
    from models import ReportSeenRows, SeenRows

    rows = [{"x": np.array([i, *d["x"][1:].tolist()], dtype=np.float32), "label": d["labels"]}
            for i, d in enumerate(make_data(65))]
    trainer = Trainer(model=SeenRows(), train_dataset=ray.data.from_items(rows), callbacks=[ReportSeenRows()],
                      args=_args(tmp_path, "raydata-order", num_workers=2, per_device_train_batch_size=11,
                                 num_train_epochs=2, learning_rate=1e-3))
    assert trainer.train().global_step == 6  # 33 rows per rank in batches of 11
    seen = {(int(r), int(e)): json.loads(ids) for r, e, ids in re.findall(
        r"rank (\d) epoch (\d) seen=(\[[\d, ]*\])", "".join(capfd.readouterr()))}
    assert sorted(seen) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    for epoch in (1, 2):
        both = seen[(0, epoch)] + seen[(1, epoch)]
        assert len(seen[(0, epoch)]) == len(seen[(1, epoch)]) == 33
        assert sorted(both) == sorted([*range(65), 0])  # every row, one repeated to fill the split
    for rank in (0, 1):
        assert seen[(rank, 1)] != seen[(rank, 2)]  # a new order each epoch
        assert seen[(rank, 1)] != sorted(seen[(rank, 1)])  # shuffled, not in row order


class _EpochsSeen(TrainerCallback):
    """The row ids a ``SeenRows`` model trained on, epoch by epoch (in this process)."""

    def __init__(self):
        self.seen = []

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        self.seen.append(model.seen[:])
        model.seen.clear()


@pytest.mark.timeout(300)
def test_ray_dataset_trains_and_evaluates_in_this_process_as_a_sized_set(tmp_path):
    """num_workers=0: a Ray Dataset trains as a sized data set in transformers' loop (every row once per
    epoch, a new order every epoch, the steps and epochs transformers counts for 40 rows) and evaluates on
    every row, in order, as the same rows given as a list."""
    import ray

    from raytrainer import set_seed

    rows = [{"x": np.array([i, *d["x"][1:].tolist()], dtype=np.float32), "label": d["labels"]}
            for i, d in enumerate(make_data(40))]
    epochs = _EpochsSeen()
    trainer = Trainer(model=SeenRows(), train_dataset=ray.data.from_items(rows),
                      eval_dataset=ray.data.from_items(rows), callbacks=[epochs],
                      args=_args(tmp_path, "raydata-here", num_workers=0, per_device_train_batch_size=8,
                                 per_device_eval_batch_size=8, num_train_epochs=2, learning_rate=1e-3,
                                 seed=3))
    out = trainer.train()
    assert out.global_step == 10 and trainer.state.epoch == 2.0  # 40 rows in batches of 8, 2 epochs
    assert [sorted(e) for e in epochs.seen] == [list(range(40))] * 2 and epochs.seen[0] != epochs.seen[1]
    set_seed(0)
    listed = Trainer(model=trainer.model, eval_dataset=[{"x": torch.from_numpy(r["x"]), "labels": r["label"]}
                                                        for r in rows],
                     args=_args(tmp_path, "listed", num_workers=0, per_device_eval_batch_size=8))
    assert trainer.evaluate()["eval_loss"] == pytest.approx(listed.evaluate()["eval_loss"], rel=1e-6)


@pytest.mark.timeout(300)
def test_a_ray_dataset_run_resumed_in_the_middle_of_an_epoch_reads_the_rest_of_that_epoch_s_order(tmp_path):
    """num_workers=0, 40 rows in batches of 8 (5 steps an epoch): resumed from step 7 (the second epoch's
    second step), the run reads the rows the uninterrupted run read after that step, in the same order,
    and ends with its weights."""
    import ray

    rows = [{"x": np.array([i, *d["x"][1:].tolist()], dtype=np.float32), "label": d["labels"]}
            for i, d in enumerate(make_data(40))]
    runs = {}
    for name, resume in (("full", None), ("resumed", "checkpoint-7")):
        epochs = _EpochsSeen()
        trainer = Trainer(model=SeenRows(), train_dataset=ray.data.from_items(rows), callbacks=[epochs],
                          args=_args(tmp_path, "raydata-resume", num_workers=0, per_device_train_batch_size=8,
                                     num_train_epochs=2, learning_rate=1e-3, seed=3, save_strategy="steps",
                                     save_steps=7))
        trainer.train(resume_from_checkpoint=resume and str(tmp_path / "raydata-resume" / resume))
        runs[name] = epochs.seen, {k: v.clone() for k, v in trainer.model.state_dict().items()}
    (full, full_weights), (resumed, resumed_weights) = runs["full"], runs["resumed"]
    assert resumed == [full[1][16:]]  # the second epoch's rows after its first two batches, in order
    for key, value in full_weights.items():
        assert torch.allclose(resumed_weights[key], value, atol=1e-6), key


def test_auto_find_batch_size_agrees_on_one_size_across_workers(tmp_path, capfd):
    """Rank 1 runs out of memory above 5 examples, rank 0 never: both must train with 5."""
    from models import OutOfMemoryOnRank1

    args = TrainingArguments(output_dir=str(tmp_path), num_workers=2, per_device_train_batch_size=8,
                             num_train_epochs=1, auto_find_batch_size=True, save_strategy="no",
                             disable_tqdm=True, report_to="none", log_level="warning")
    out = Trainer(model=OutOfMemoryOnRank1(), args=args, train_dataset=make_data(40)).train()
    assert out.global_step == 4  # 40 examples / (2 workers x 5); with 8 it would be 3
    console = "".join(capfd.readouterr())
    assert "batch size 8 does not fit on another worker; trying 7" in console  # rank 0's view
    assert "training with per_device_train_batch_size=5" in console


def test_a_parameter_the_loss_does_not_use_trains_on_two_workers(tmp_path):
    """transformers.Trainer's default, find_unused_parameters=True for such models (ddp_find_unused_parameters
    unset): the used weights train, the unused head stays as it was."""
    model = UnusedHead()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(model=model, train_dataset=make_data(32),
                      args=_args(tmp_path, "unused", num_workers=2, max_steps=4))
    assert trainer.train().global_step == 4
    after = trainer.model.state_dict()
    assert torch.equal(after["unused.weight"], before["unused.weight"])
    assert not torch.equal(after["net.0.weight"], before["net.0.weight"])


def test_flags_set_in_on_log_and_on_evaluate_on_one_rank_are_agreed(tmp_path, capfd):
    """A save asked in on_evaluate on rank 0 only and a stop asked in on_log on rank 1 only: both ranks save
    at that step (a collective) and both stop at the other, as one process would."""
    args = _args(tmp_path, "flags", num_workers=2, max_steps=10, logging_steps=2, eval_strategy="steps",
                 eval_steps=2, save_strategy="steps", save_steps=1000)
    trainer = Trainer(model=Regressor(), args=args, train_dataset=make_data(64),
                      eval_dataset=make_data(16, 2), callbacks=[FlagsOnOneRank(save_at=2, stop_at=4)])
    out = trainer.train()
    assert out.global_step == 4
    assert (tmp_path / "flags" / "checkpoint-2" / "manifest.json").exists()
    assert not (tmp_path / "flags" / "checkpoint-4").exists()
    logs = tmp_path / "flags" / "logs"
    for rank in (0, 1):
        assert f"rank {rank} saved at [2] and ended at step 4" in (logs / f"rank-{rank}.log").read_text()


def test_callbacks_that_never_write_a_flag_cost_no_agreement_per_step(tmp_path):
    """A user callback that only looks (it counts all-reduces) lets the ranks skip the per-step agreement
    on the control flags; one whose code may set a flag gets it after every step (8 here)."""
    from models import FlagSyncCounter, FlagSyncCounterThatMayStop

    counts = {}
    for callback in (FlagSyncCounter(), FlagSyncCounterThatMayStop()):
        trainer = Trainer(model=Regressor(), train_dataset=make_data(64), callbacks=[callback],
                          args=_args(tmp_path, type(callback).__name__, num_workers=2, max_steps=8,
                                     logging_steps=4))
        assert trainer.train().global_step == 8
        counts[type(callback).__name__] = callback.flag_syncs  # rank 0's count, brought back to the driver
    assert counts["FlagSyncCounter"] == 0, counts
    assert counts["FlagSyncCounterThatMayStop"] >= 8, counts  # after each step, and after logs and epochs


def test_a_slow_worker_is_named_by_the_straggler_warning(tmp_path, capfd):
    """Rank 1 reads each batch 0.15 s slower: the driver names rank 1 and its node once, and not rank 0;
    the run's result is the same as the even run's (pace is only measured)."""
    import ray

    args = _args(tmp_path, "slow", num_workers=2, max_steps=8, logging_steps=2)
    trainer = Trainer(model=Regressor(), args=args, train_dataset=make_data(64),
                      data_collator=SlowOnRank(rank=1, seconds=0.15))
    out = trainer.train()
    assert out.global_step == 8
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "is a straggler" in line]
    assert len(warnings) == 1, err
    node = ray.util.get_node_ip_address()
    assert f"rank 1 on node {node} is a straggler: its own work" in warnings[0]
    seconds = float(warnings[0].split(" takes ")[1].split(" s per step")[0])
    assert 0.15 <= seconds < 1.0  # the sleep, measured on rank 1 through the logging all-reduce


def test_a_skeleton_on_the_driver_evaluates_and_trains_as_a_real_model(tmp_path, monkeypatch):
    """A model_init model the driver keeps on the meta device (raytrainer.meta_model; every model counts as
    big here): evaluate() before train() builds the seeded model on the workers, train() matches one process
    with twice the batch, and the driver's module becomes real, in place, with the trained weights."""
    from raytrainer import meta_model

    monkeypatch.setattr(meta_model, "DRIVER_META_ABOVE_PARAMS", 0)
    data, held_out = make_data(48), make_data(21, seed=7)
    same = {"num_train_epochs": 1, "optim": "sgd", "learning_rate": 0.5}
    ref = Trainer(model_init=lambda: Regressor(), train_dataset=data, eval_dataset=held_out,
                  args=_args(tmp_path, "ref", num_workers=0, per_device_train_batch_size=16, **same))
    before_ref = ref.evaluate()["eval_loss"]
    ref.train()

    ddp = Trainer(model_init=lambda: Regressor(), train_dataset=data, eval_dataset=held_out,
                  args=_args(tmp_path, "ddp", num_workers=2, per_device_train_batch_size=8, **same))
    skeleton = ddp.model  # before train(): the driver's model, as transformers' constructor builds it
    assert meta_model.is_skeleton(skeleton)
    assert ddp.evaluate()["eval_loss"] == pytest.approx(before_ref, rel=1e-6)
    assert ddp.model is skeleton and meta_model.is_skeleton(skeleton)  # evaluate's workers built their own
    ddp.train()
    assert ddp.model is skeleton and not meta_model.is_skeleton(ddp.model)
    for name, ref_param in ref.model.state_dict().items():
        torch.testing.assert_close(ddp.model.state_dict()[name], ref_param, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_a_model_class_from_a_folder_the_script_put_on_sys_path_trains_on_the_workers(tmp_path, monkeypatch):
    """A script that adds its source folder at run time (``sys.path.insert(0, "src")``): Ray passes its
    workers only the script's folder and working directory, so the ranks unpickle the Trainer -- whose model
    is of a class from that folder -- with the driver's import path (worker/place.py)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "rt_src_folder_model.py").write_text(
        "import torch\n\n\n"
        "class SrcModel(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        torch.manual_seed(0)\n"
        "        self.linear = torch.nn.Linear(6, 3)\n\n"
        "    def forward(self, x, labels=None):\n"
        "        logits = self.linear(x)\n"
        "        return torch.nn.functional.cross_entropy(logits, labels), logits\n")
    monkeypatch.syspath_prepend(str(src))
    from rt_src_folder_model import SrcModel

    model = SrcModel()
    before = model.linear.weight.detach().clone()
    trainer = Trainer(model=model, train_dataset=make_data(32),
                      args=_args(tmp_path, "src", num_workers=2, max_steps=3, per_device_train_batch_size=4))
    assert trainer.train().global_step == 3
    assert not torch.equal(trainer.model.linear.weight, before)
    trainer.close()
