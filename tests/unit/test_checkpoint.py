"""Checkpoints in-process: layout, manifest commit, bitwise resume, rotation, best model, safety, URIs."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from torch import nn

from raytrainer import Trainer, TrainerCallback, TrainingArguments
from raytrainer.checkpoint import CheckpointError, committed_checkpoints
from raytrainer.storage import Storage


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def data(n=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return [{"x": x[i], "labels": int(y[i])} for i in range(n)]


def args(out, **kw):
    base = {"output_dir": str(out), "num_workers": 0, "per_device_train_batch_size": 4,
            "num_train_epochs": 3, "learning_rate": 0.01, "save_strategy": "steps", "save_steps": 4,
            "disable_tqdm": True, "report_to": "none", "logging_steps": 5, "optim": "adamw_torch"}
    base.update(kw)
    return TrainingArguments(**base)


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_layout_and_manifest(tmp_path):
    trainer = Trainer(model=DropoutNet(), args=args(tmp_path, max_steps=4, logging_steps=2),
                      train_dataset=data())
    trainer.train()
    folder = tmp_path / "checkpoint-4"
    names = sorted(os.listdir(folder))
    assert names == sorted(["manifest.json", "model.safetensors", "optimizer.pt", "rng_state.pth",
                            "scheduler.pt", "trainer_state.json", "training_args.bin", "training_args.json"])
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["global_step"] == 4
    assert set(manifest["files"]) == set(names) - {"manifest.json"}
    for name, meta in manifest["files"].items():
        assert meta["size"] == os.path.getsize(folder / name) and len(meta["sha256"]) == 64
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and state["log_history"]


@pytest.mark.parametrize("stop_at", [4, 12])  # mid-epoch (10 steps per epoch), and in the 2nd epoch
def test_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path, stop_at):
    full = Trainer(model=DropoutNet(), args=args(tmp_path / "full", logging_steps=2), train_dataset=data())
    full.train()
    resumed = Trainer(model=DropoutNet(), args=args(tmp_path / "resumed", logging_steps=2),
                      train_dataset=data())
    out = resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{stop_at}"))
    assert out.global_step == full.state.global_step == 30
    for name, tensor in full.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
    # the resumed run's log history continues the saved one, and each loss after the resume is the mean of
    # its own window (the first one too: not divided by the steps before the resume as well)
    logged = [(h["step"], h["loss"]) for h in full.state.log_history if "loss" in h]
    assert [(h["step"], h["loss"]) for h in resumed.state.log_history if "loss" in h] == logged
    assert len(logged) == 15


class CountingDataset:
    """A map-style dataset that records the positions read, from the start of the training loop on."""

    def __init__(self, examples):
        self.examples, self.reads = examples, []

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        self.reads.append(i)
        return self.examples[i]


class ReadsFromTrainBegin(TrainerCallback):
    """Forgets the reads made before the loop (column and pre-flight checks): only training's count."""

    def __init__(self, dataset):
        self.dataset = dataset

    def on_train_begin(self, args, state, control, **kwargs):
        self.dataset.reads.clear()


def test_a_mid_epoch_resume_reads_only_the_examples_it_trains_on(tmp_path):
    # 40 examples, batches of 4, 2 batches per update: 5 updates an epoch, 15 in 3 epochs; checkpoint-3
    # is 6 batches (24 examples) into epoch 0, which the resume skips at the sampler, reading none of them
    def run(out, **kw):
        dataset = CountingDataset(data())
        trainer = Trainer(model=DropoutNet(), train_dataset=dataset, callbacks=[ReadsFromTrainBegin(dataset)],
                          args=args(out, gradient_accumulation_steps=2, save_steps=3))
        trainer.train(**kw)
        return trainer, dataset.reads

    full, full_reads = run(tmp_path / "full")
    assert len(full_reads) == 120
    resumed, resumed_reads = run(tmp_path / "resumed",
                                 resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    assert len(resumed_reads) == 16 + 80  # the rest of epoch 0, then epochs 1 and 2
    assert resumed_reads == full_reads[24:]  # the same examples, in the same order
    assert resumed.state.global_step == 15
    for name, tensor in full.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name


@pytest.mark.parametrize("stop_at", [3, 10])  # mid-epoch (skipped at the sampler), and at an epoch's end
def test_resume_with_persistent_loader_workers_is_bitwise_equal(tmp_path, stop_at):
    # the loader's one draw of its workers' seed, made by the uninterrupted run in epoch 0, must not move
    # the global RNG (dropout here) when a resumed run makes it at a later epoch
    workers = {"dataloader_num_workers": 1, "dataloader_persistent_workers": True, "num_train_epochs": 2}
    full = Trainer(model=DropoutNet(), args=args(tmp_path / "full", save_steps=stop_at, **workers),
                   train_dataset=data())
    full.train()
    resumed = Trainer(model=DropoutNet(), args=args(tmp_path / "resumed", **workers), train_dataset=data())
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{stop_at}"))
    assert resumed.state.global_step == 20
    for name, tensor in full.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name


def test_resume_true_takes_the_latest_committed_and_skips_a_partial_one(tmp_path, caplog):
    full = Trainer(model=DropoutNet(), args=args(tmp_path, max_steps=10), train_dataset=data())
    full.train()  # saves 4, 8 and 10; the uninterrupted reference
    os.remove(tmp_path / "checkpoint-10" / "manifest.json")  # as if the last save never finished
    storage = Storage.from_uri(str(tmp_path))
    with caplog.at_level("WARNING", logger="raytrainer"):
        found = committed_checkpoints(storage)
    assert [step for step, _ in found] == [4, 8]
    assert "skipping partial checkpoint" in caplog.text and "checkpoint-10" in caplog.text

    again = Trainer(model=DropoutNet(), args=args(tmp_path, max_steps=10), train_dataset=data())
    out = again.train(resume_from_checkpoint=True)  # from checkpoint-8
    assert out.global_step == 10
    assert [h["step"] for h in again.state.log_history if "loss" in h] == [5, 10]
    for name, tensor in full.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], tensor), name


def test_flipped_bytes_in_a_checkpoint_are_refused_by_name(tmp_path):
    """A committed checkpoint whose weights changed after the commit (bit rot, a partial copy): the sha256
    in its manifest catches it when the weights are read, and the error names the file."""
    Trainer(model=DropoutNet(), args=args(tmp_path, max_steps=8), train_dataset=data()).train()
    weights_file = tmp_path / "checkpoint-8" / "model.safetensors"
    raw = bytearray(weights_file.read_bytes())
    raw[-5] ^= 0xFF  # inside the last tensor's data: the file still parses
    weights_file.write_bytes(bytes(raw))
    again = Trainer(model=DropoutNet(), args=args(tmp_path, max_steps=12), train_dataset=data())
    with pytest.raises(CheckpointError, match=r"checkpoint-8/model.safetensors does not match its manifest "
                                              r"checksum"):
        again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-8"))
    assert again.state.global_step == 0


def test_resume_true_falls_back_past_a_damaged_latest_checkpoint(tmp_path, caplog, capsys):
    """resume_from_checkpoint=True chose the latest committed checkpoint, whose weights were damaged after
    the commit: the damage is found when the weights are read, and the run resumes from the checkpoint
    before it, with a warning naming both -- ending bitwise where an uninterrupted run ends. The console
    says each checkpoint a resume starts from, and the step."""
    full = Trainer(model=DropoutNet(), args=args(tmp_path / "full", max_steps=12), train_dataset=data())
    full.train()
    out = tmp_path / "damaged"
    Trainer(model=DropoutNet(), args=args(out, max_steps=12), train_dataset=data()).train()
    for name in os.listdir(out / "checkpoint-12"):  # as if the run had stopped after checkpoint-8
        os.remove(out / "checkpoint-12" / name)
    os.rmdir(out / "checkpoint-12")
    weights_file = out / "checkpoint-8" / "model.safetensors"
    raw = bytearray(weights_file.read_bytes())
    raw[-5] ^= 0xFF  # same size: only the checksum can tell
    weights_file.write_bytes(bytes(raw))

    again = Trainer(model=DropoutNet(), args=args(out, max_steps=12), train_dataset=data())
    with caplog.at_level("WARNING", logger="raytrainer"):
        result = again.train(resume_from_checkpoint=True)
    assert f"{out}/checkpoint-8 is damaged" in caplog.text
    assert "model.safetensors does not match its manifest checksum" in caplog.text
    assert f"resuming from {out}/checkpoint-4" in caplog.text
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("raytrainer: resuming")]
    assert said == [f"raytrainer: resuming from {out}/checkpoint-8: training continues after step 8",
                    f"raytrainer: resuming from {out}/checkpoint-4: training continues after step 4"]
    assert result.global_step == 12
    assert [h["step"] for h in again.state.log_history if "loss" in h] == [5, 10]
    for name, tensor in full.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], tensor), name
    assert [step for step, _ in committed_checkpoints(Storage.from_uri(str(out)))] == [4, 8, 12]

    # the checkpoint-8 written again verifies; naming a damaged one explicitly is an error, not a fallback
    weights_file = out / "checkpoint-12" / "model.safetensors"
    raw = bytearray(weights_file.read_bytes())
    raw[-5] ^= 0xFF
    weights_file.write_bytes(bytes(raw))
    explicit = Trainer(model=DropoutNet(), args=args(out, max_steps=16), train_dataset=data())
    with pytest.raises(CheckpointError, match=r"checkpoint-12/model\.safetensors does not match"):
        explicit.train(resume_from_checkpoint=str(out / "checkpoint-12"))


class FullDiskNet(DropoutNet):
    """Writing its weights into ``checkpoint-<full_at>`` fails half-way, as a full disk does (ENOSPC)."""

    full_at = 8

    def save_pretrained(self, folder, state_dict=None, **kwargs):
        from safetensors.torch import save_file

        if os.path.basename(folder) == f"checkpoint-{self.full_at}":
            with open(os.path.join(folder, "model.safetensors"), "wb") as f:
                f.write(b"\0" * 64)
            raise OSError(28, "No space left on device", os.path.join(folder, "model.safetensors"))
        save_file(state_dict, os.path.join(folder, "model.safetensors"))


class FullDiskTrainer(Trainer):
    """transformers' loop saves a module that is not a PreTrainedModel itself (``_save``), not through its
    ``save_pretrained``: the same failure, one call up."""

    def _save(self, output_dir=None, state_dict=None):
        if os.path.basename(output_dir) != f"checkpoint-{FullDiskNet.full_at}":
            return super()._save(output_dir, state_dict)
        with open(os.path.join(output_dir, "model.safetensors"), "wb") as f:
            f.write(b"\0" * 64)
        raise OSError(28, "No space left on device", os.path.join(output_dir, "model.safetensors"))


def test_a_save_into_full_storage_names_the_path_and_leaves_older_checkpoints_intact(tmp_path):
    trainer = FullDiskTrainer(model=FullDiskNet(), args=args(tmp_path, max_steps=12), train_dataset=data())
    with pytest.raises(RuntimeError, match=rf"writing checkpoint {tmp_path}/checkpoint-8 failed, so it is "
                                           r"not committed .*No space left on device") as info:
        trainer.train()
    assert str(tmp_path / "checkpoint-8" / "model.safetensors") in str(info.value)
    storage = Storage.from_uri(str(tmp_path))
    assert [step for step, _ in committed_checkpoints(storage, warn=False)] == [4]  # 8 never committed
    assert not (tmp_path / "checkpoint-8" / "manifest.json").exists()
    again = Trainer(model=DropoutNet(), args=args(tmp_path, max_steps=12), train_dataset=data())
    assert again.train(resume_from_checkpoint=True).global_step == 12  # from checkpoint-4, intact


def test_bad_resume_targets_are_named(tmp_path):
    trainer = Trainer(model=DropoutNet(), args=args(tmp_path / "a", max_steps=4), train_dataset=data())
    trainer.train()
    fresh = Trainer(model=DropoutNet(), args=args(tmp_path / "b", max_steps=4), train_dataset=data())
    before = weights(fresh.model)
    with pytest.raises(CheckpointError, match="does not exist"):
        fresh.train(resume_from_checkpoint=str(tmp_path / "nowhere"))
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="not a raytrainer checkpoint"):
        fresh.train(resume_from_checkpoint=str(tmp_path / "foreign"))
    os.remove(tmp_path / "a" / "checkpoint-4" / "manifest.json")
    with pytest.raises(CheckpointError, match="partial checkpoint"):
        fresh.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    with pytest.raises(CheckpointError, match="holds no committed checkpoint"):
        fresh.train(resume_from_checkpoint=True)
    assert all(torch.equal(before[k], v) for k, v in fresh.model.state_dict().items())


def test_checkpoint_of_another_model_shape_names_the_tensor(tmp_path):
    Trainer(model=DropoutNet(), args=args(tmp_path / "a", max_steps=4), train_dataset=data()).train()

    class Wider(DropoutNet):
        def __init__(self):
            super().__init__()
            self.net[0] = nn.Linear(6, 64)
            self.net[3] = nn.Linear(64, 3)

    with pytest.raises(CheckpointError, match=r"tensor 'net\.0\.weight' has shape \(32, 6\)"):
        Trainer(model=Wider(), args=args(tmp_path / "b", max_steps=8), train_dataset=data()).train(
            resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))


class _Planted:
    def __reduce__(self):
        return (open, ("/tmp/raytrainer-planted-payload-ran", "w"))


def test_a_pickle_payload_is_refused_and_never_runs(tmp_path):
    marker = "/tmp/raytrainer-planted-payload-ran"
    if os.path.exists(marker):
        os.remove(marker)
    Trainer(model=DropoutNet(), args=args(tmp_path / "a", max_steps=4), train_dataset=data()).train()
    folder = tmp_path / "a" / "checkpoint-4"
    optimizer_state = torch.load(folder / "optimizer.pt", weights_only=True)
    optimizer_state["payload"] = _Planted()
    with open(folder / "optimizer.pt", "wb") as f:
        pickle.dump(optimizer_state, f)
    # keep the manifest consistent, so the refusal comes from the loader, not the checksum
    manifest = json.loads((folder / "manifest.json").read_text())
    from raytrainer.checkpoint import digest_files

    manifest["files"].update(digest_files(str(folder), ["optimizer.pt"]))
    (folder / "manifest.json").write_text(json.dumps(manifest))
    # transformers' loop loads it with torch's weights_only unpickler, which refuses it
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        Trainer(model=DropoutNet(), args=args(tmp_path / "b", max_steps=8), train_dataset=data()).train(
            resume_from_checkpoint=str(folder))
    assert not os.path.exists(marker)


def test_rotation_keeps_the_limit_the_best_and_the_newest_among_them(tmp_path):
    class WorsensAfterFirstEval(Trainer):
        calls = 0

        def evaluate(self, *a, **kw):
            metrics = super().evaluate(*a, **kw)
            WorsensAfterFirstEval.calls += 1
            metrics["eval_loss"] = float(WorsensAfterFirstEval.calls)  # the first eval is the best
            return metrics

    trainer = WorsensAfterFirstEval(
        model=DropoutNet(), train_dataset=data(), eval_dataset=data(12, seed=3),
        args=args(tmp_path, max_steps=20, save_total_limit=2, eval_strategy="steps", eval_steps=4,
                  metric_for_best_model="loss", load_best_model_at_end=True))
    trainer.train()
    kept = sorted(int(n.split("-")[1]) for n in os.listdir(tmp_path) if n.startswith("checkpoint-"))
    # transformers' rule: save_total_limit checkpoints, the best and the newest among them
    assert kept == [4, 20]
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-4")
    # load_best_model_at_end: trainer.model holds checkpoint-4's weights
    from safetensors.torch import load_file

    best = load_file(str(tmp_path / "checkpoint-4" / "model.safetensors"))
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in best.items())
    final = load_file(str(tmp_path / "checkpoint-20" / "model.safetensors"))
    assert not all(torch.equal(final[k], v) for k, v in best.items())


def test_storage_path_uri_round_trips(tmp_path):
    uri = f"file://{tmp_path}/remote"
    trainer = Trainer(model=DropoutNet(), args=args(tmp_path / "out", max_steps=12, storage_path=uri),
                      train_dataset=data())
    trainer.train()
    assert sorted(os.listdir(tmp_path / "remote")) == ["checkpoint-12", "checkpoint-4", "checkpoint-8"]
    out = tmp_path / "out"  # nothing of the run's is written there (not even the folder)
    assert not out.exists() or not any(n.startswith("checkpoint-") for n in os.listdir(out))
    again = Trainer(model=DropoutNet(), args=args(tmp_path / "out2", max_steps=12), train_dataset=data())
    again.train(resume_from_checkpoint=f"{uri}/checkpoint-8")
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], tensor), name


class WiderNet(DropoutNet):
    def __init__(self):
        super().__init__()
        self.net[0] = nn.Linear(6, 48)
        self.net[3] = nn.Linear(48, 3)


def test_a_checkpoint_of_another_model_is_refused_on_the_driver_before_ray_starts(tmp_path, monkeypatch):
    import ray

    from raytrainer.driver import launch

    launched = []  # a spy: the launch on Ray workers must never be reached
    monkeypatch.setattr(launch, "launch", lambda *a, **k: launched.append(a))
    ray_before = ray.is_initialized()  # a whole-suite run shares one Ray instance with the integration tests
    Trainer(model=DropoutNet(), args=args(tmp_path / "a", max_steps=4), train_dataset=data()).train()
    wider = Trainer(model=WiderNet(), args=args(tmp_path / "b", num_workers=2, max_steps=8),
                    train_dataset=data())
    with pytest.raises(CheckpointError, match=r"checkpoint-4: tensor 'net.0.weight' has shape \(32, 6\) in "
                                              r"the checkpoint but \(48, 6\) in the model"):
        wider.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    assert launched == [] and ray.is_initialized() == ray_before and wider.state.global_step == 0


def test_a_storage_uri_pyarrow_cannot_serve_names_the_way_out(tmp_path):
    trainer = Trainer(model=DropoutNet(), args=args(tmp_path, storage_path="ftp://host/runs"),
                      train_dataset=data())
    with pytest.raises(ValueError, match=r"storage 'ftp://host/runs': pyarrow has no filesystem for it.*"
                                         r"storage_filesystem="):
        trainer.train()


def test_unwritable_storage_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    trainer = Trainer(model=DropoutNet(), args=args(tmp_path / "o", storage_path=str(blocker / "x")),
                      train_dataset=data())
    before = weights(trainer.model)
    with pytest.raises(ValueError, match="cannot be written"):
        trainer.train()
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


@pytest.mark.parametrize("method", ["train", "evaluate"])
def test_unwritable_storage_on_workers_fails_before_ray_without_saving(tmp_path, method):
    """save_strategy="no" on workers still writes under storage (Ray Train's run folder, the final weights):
    the driver checks it before Ray starts, as when saving, for train() and for a call that starts a group."""
    import time

    import ray

    trainer = Trainer(model=DropoutNet(), args=args(tmp_path, num_workers=2, save_strategy="no",
                                                    storage_path="/proc/raytrainer-runs"),
                      train_dataset=data(), eval_dataset=data(8))
    ray_before, started = ray.is_initialized(), time.monotonic()
    with pytest.raises(ValueError, match=r"storage_path '/proc/raytrainer-runs' cannot be written"):
        getattr(trainer, method)()
    assert time.monotonic() - started < 5
    assert ray.is_initialized() == ray_before


def test_save_total_limit_below_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="save_total_limit"):
        args(tmp_path, save_total_limit=0)


def test_save_model_writes_consolidated_safetensors_loadable_alone(tmp_path):
    from safetensors.torch import load_file

    trainer = Trainer(model=DropoutNet(), args=args(tmp_path, max_steps=3, save_strategy="no"),
                      train_dataset=data())
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    loaded = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert set(loaded) == set(trainer.model.state_dict())
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in loaded.items())


def test_a_failed_upload_is_an_error_naming_files_and_destination(tmp_path):
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "checkpoint-4").write_text("a file where the checkpoint folder must go")
    trainer = Trainer(model=DropoutNet(), args=args(tmp_path / "o", max_steps=8,
                                                    storage_path=f"file://{remote}"), train_dataset=data())
    with pytest.raises(RuntimeError, match=r"checkpoint-4 \(its files: .*model\.safetensors.*\) failed"):
        trainer.train()
    assert not (remote / "checkpoint-8").exists()  # nothing after the failed save was committed


def test_early_stopping_state_survives_resume(tmp_path):
    from raytrainer import EarlyStoppingCallback

    def run(out, restore=False, **kw):
        calls = {"n": 0}

        def worsening(pred):  # each evaluation scores worse than the one before (lower is better)
            calls["n"] += 1
            return {"score": float(calls["n"])}

        trainer = Trainer(model=DropoutNet(), train_dataset=data(), eval_dataset=data(8, seed=2),
                          compute_metrics=worsening,
                          callbacks=[EarlyStoppingCallback(early_stopping_patience=3)],
                          args=args(out, eval_strategy="steps", eval_steps=2, save_steps=2,
                                    metric_for_best_model="score", greater_is_better=False,
                                    load_best_model_at_end=True,
                                    restore_callback_states_from_checkpoint=restore))
        return trainer.train(**kw)

    assert run(tmp_path / "full").global_step == 8  # best at 2, then 3 evaluations without improvement
    # resumed at 6 with the callback's counter (2) and best score (1.0) restored: the next evaluation
    # (scoring 1.0 again, no improvement) is the third without improvement -> stop at 8, not 12
    checkpoint = str(tmp_path / "full" / "checkpoint-6")
    resumed = run(tmp_path / "resumed", restore=True, resume_from_checkpoint=checkpoint)
    assert resumed.global_step == 8
    # transformers' default (restore_callback_states_from_checkpoint=False): the callback starts afresh,
    # its counter reaches 3 at the third evaluation after the resume (steps 8, 10, 12)
    fresh = run(tmp_path / "fresh", resume_from_checkpoint=checkpoint)
    assert fresh.global_step == 12


def test_verification_is_shared_by_bytes_not_by_file_count():
    from raytrainer.checkpoint import _share_by_size
    from raytrainer.rank_context import RankContext

    sizes = {"global_step4/mp_rank_00_model_states.pt": 12_600,
             "global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt": 1_200_000_000,
             "global_step4/mp_rank_01_model_states.pt": 12_600,
             "global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt": 1_200_000_000}
    names = sorted(sizes)
    shares = [_share_by_size(names, sizes, RankContext(world_size=2, rank=r))[r] for r in (0, 1)]
    assert sorted(shares[0] + shares[1]) == names  # every file verified once
    read = [sum(sizes[n] for n in share) for share in shares]
    assert read[0] == read[1] == 1_200_012_600  # one partition and one small file each


def test_weights_rewritten_in_transformers_sharded_layout_resume_and_a_partial_save_is_still_refused(
        tmp_path, caplog):
    """A committed checkpoint whose model.safetensors the user rewrote as transformers' sharded layout (an
    index and one shard per tensor) resumes exactly, its new weight files read unverified with a warning;
    the weight file gone with nothing in its place is still damaged, and a save without its manifest is
    still partial (raytrainer's own files are there), not taken for another trainer's checkpoint."""
    from safetensors.torch import load_file, save_file

    full = Trainer(model=DropoutNet(), args=args(tmp_path / "full", max_steps=10), train_dataset=data())
    full.train()
    folder = tmp_path / "full" / "checkpoint-8"
    state = load_file(folder / "model.safetensors")
    os.remove(folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"is damaged: model\.safetensors is missing"):
        Trainer(model=DropoutNet(), args=args(tmp_path / "x", max_steps=10),
                train_dataset=data()).train(resume_from_checkpoint=str(folder))
    shards = {key: f"model-{i + 1:05d}-of-{len(state):05d}.safetensors" for i, key in enumerate(state)}
    for key, shard in shards.items():
        save_file({key: state[key]}, folder / shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))

    resumed = Trainer(model=DropoutNet(), args=args(tmp_path / "resumed", max_steps=10), train_dataset=data())
    with caplog.at_level("WARNING", logger="raytrainer"):
        resumed.train(resume_from_checkpoint=str(folder))
    assert "its model weights were rewritten after it was committed" in caplog.text
    for name, tensor in full.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name

    os.remove(tmp_path / "full" / "checkpoint-4" / "manifest.json")
    with pytest.raises(CheckpointError, match="is a partial checkpoint"):
        Trainer(model=DropoutNet(), args=args(tmp_path / "y", max_steps=10),
                train_dataset=data()).train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-4"))


def test_a_model_that_loads_its_own_way_resumes_through_its_load_state_dict(tmp_path):
    """A model that resizes a buffer to the saved one in its own load_state_dict (a record that grows as it
    trains) resumes: its method decides what fits, as transformers calls it, not raytrainer's shape check."""

    class Recording(DropoutNet):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros(0))

        def forward(self, x, labels=None):
            if self.training:
                self.seen = torch.cat([self.seen, x[:, 0]])
            return super().forward(x, labels)

        def load_state_dict(self, state_dict, strict=True, assign=False):
            self.seen = torch.empty_like(state_dict["seen"])
            return super().load_state_dict(state_dict, strict, assign)

    full = Trainer(model=Recording(), args=args(tmp_path / "full", max_steps=10), train_dataset=data())
    full.train()
    resumed = Trainer(model=Recording(), args=args(tmp_path / "resumed", max_steps=10), train_dataset=data())
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-8"))
    assert resumed.model.seen.shape == (40,)  # 8 batches from the checkpoint, 2 after the resume
    assert torch.equal(resumed.model.seen, full.model.seen)


class _Counter:
    """A Stateful of its own: what a new kind of checkpointed state looks like to the writer."""

    def __init__(self):
        self.value, self.loaded = 0, None

    def state_dict(self):
        self.value += 1
        return {"saves": self.value, "tensor": torch.arange(3) * self.value}

    def load_state_dict(self, state):
        self.loaded = state


def test_a_file_a_subclass_adds_to_its_checkpoints_is_committed_and_read_back_on_resume(tmp_path):
    """A subclass keeping state of its own in each checkpoint, as transformers users do (``_save_checkpoint``
    and ``_load_from_checkpoint`` overridden): its file is written, hashed and committed like the others, and
    the resume reads it back."""
    counter = _Counter()

    class WithCounter(Trainer):
        def _save_checkpoint(self, model, trial):
            super()._save_checkpoint(model, trial)
            folder = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
            torch.save(counter.state_dict(), os.path.join(folder, "counter.pt"))

        def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            counter.load_state_dict(torch.load(os.path.join(resume_from_checkpoint, "counter.pt")))

    WithCounter(model=DropoutNet(), args=args(tmp_path, max_steps=8), train_dataset=data()).train()
    folder = tmp_path / "checkpoint-8"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert "counter.pt" in manifest["files"]  # written, hashed and committed like the others
    assert torch.load(folder / "counter.pt")["saves"] == 2  # the second save's state (steps 4 and 8)
    assert set(manifest["files"]) >= {"optimizer.pt", "scheduler.pt", "trainer_state.json",
                                      "model.safetensors"}

    WithCounter(model=DropoutNet(), args=args(tmp_path, max_steps=8), train_dataset=data()).train(
        resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert counter.loaded["saves"] == 1 and torch.equal(counter.loaded["tensor"], torch.arange(3))


def test_save_only_model_writes_the_trainer_state_piece_alone(tmp_path):
    Trainer(model=DropoutNet(), args=args(tmp_path, max_steps=4, save_only_model=True),
            train_dataset=data()).train()
    names = sorted(os.listdir(tmp_path / "checkpoint-4"))
    assert names == ["manifest.json", "model.safetensors", "trainer_state.json", "training_args.bin",
                     "training_args.json"]


def _sharded_checkpoint(folder, model) -> str:
    """A committed checkpoint holding ``model`` as an FSDP run with SHARDED_STATE_DICT writes it: DCP under
    the key ``model`` in pytorch_model_fsdp_0/, no consolidated weights (written here in one process)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from raytrainer.checkpoint import digest_files, write_manifest

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder / "checkpoint-7" /
                                                                   "pytorch_model_fsdp_0"), no_dist=True)
    (folder / "checkpoint-7" / "trainer_state.json").write_text(json.dumps({"global_step": 7}))
    names = sorted(os.path.relpath(os.path.join(r, n), folder / "checkpoint-7")
                   for r, _, ns in os.walk(folder / "checkpoint-7") for n in ns)
    storage = Storage.from_uri(str(folder))
    write_manifest(storage, "checkpoint-7", [digest_files(str(folder / "checkpoint-7"), names)], 7)
    return str(folder / "checkpoint-7")


def test_a_checkpoint_with_a_dcp_sharded_model_is_read_by_the_driver_side_readers(tmp_path):
    """weight_shapes (the driver's pre-resume check) from DCP's .metadata, a model it does not fit named,
    and model_weights through DCP in one process, verified against the manifest."""
    from raytrainer.checkpoint import CheckpointReader, check_fits, model_weights, weight_shapes

    trained = DropoutNet()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1.5)
    path = _sharded_checkpoint(tmp_path, trained)
    reader = CheckpointReader(path)
    assert weight_shapes(reader) == {k: tuple(v.shape) for k, v in trained.state_dict().items()}
    loaded = model_weights(reader)
    assert loaded.keys() == trained.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in trained.state_dict().items())

    class Wider(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 3))

    with pytest.raises(CheckpointError, match=r"'net.0.weight' has shape \(32, 6\) in the checkpoint"):
        check_fits(Wider().state_dict(), weight_shapes(reader), reader.uri)
    shard = tmp_path / "checkpoint-7" / "pytorch_model_fsdp_0" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp does not match its manifest checksum"):
        model_weights(CheckpointReader(path))
