"""Background checkpoint writes for transformers' loop (raytrainer/worker/hosted_saves.py), in one process.

Pinned against transformers itself: a checkpoint written in the background holds the files transformers'
own save writes, tensor for tensor, and transformers' own resume reads it. When transformers changes what
``_save_checkpoint`` writes or how, these tests fail.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

pytestmark = pytest.mark.timeout(300)


def _trainer(output_dir: str, callbacks=(), max_steps: int = 4, **overrides):
    """transformers' Trainer over a tiny GPT-2 (tied embeddings), a checkpoint every 2 steps (``overrides``
    replace any argument; it evaluates on its training rows)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    gen = torch.Generator().manual_seed(1)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (16, 8), generator=gen)]
    args = transformers.TrainingArguments(
        output_dir, per_device_train_batch_size=2, max_steps=max_steps, save_steps=2, logging_steps=1,
        report_to=[], use_cpu=True, disable_tqdm=True, learning_rate=1e-2, **overrides)
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=rows,
                                eval_dataset=rows, callbacks=list(callbacks))


def _load(folder: str) -> dict:
    from safetensors.torch import load_file

    return {"model": load_file(os.path.join(folder, "model.safetensors")),
            "optimizer": torch.load(os.path.join(folder, "optimizer.pt"), weights_only=False),
            "scheduler": torch.load(os.path.join(folder, "scheduler.pt"), weights_only=False)}


def _assert_same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def test_a_checkpoint_save_returns_before_its_files_are_written_and_they_are_transformers_own(tmp_path):
    """The writer is held while step 2's checkpoint is saved: step 3 trains before checkpoint-2's weights
    and optimizer state exist (the save did not wait). Once written, they hold the state at step 2 (not
    step 3's: the copy was taken at the save), and checkpoint-2 holds the same files as transformers' own
    save of the same run, tensor for tensor; transformers resumes from it to the uninterrupted run's
    weights."""
    from transformers import TrainerCallback

    from raytrainer.worker.hosted_saves import write_in_background

    gate, seen = threading.Event(), {}

    class HoldTheWriter(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            folder = os.path.join(args.output_dir, "checkpoint-2")
            if state.global_step == 2:  # the writer thread is held: the save's writes queue behind this
                saves._writer.submit(gate.wait)
                seen["at-save"] = {k: v.clone() for k, v in model.state_dict().items()}
            if state.global_step == 3:
                names = ("model.safetensors", "optimizer.pt", "scheduler.pt")
                seen["written-at-step-3"] = [os.path.exists(os.path.join(folder, name)) for name in names]
                seen["trainer-state-at-step-3"] = os.path.exists(os.path.join(folder, "trainer_state.json"))
                gate.set()

    background = _trainer(str(tmp_path / "background"), [HoldTheWriter()])
    saves = write_in_background(background)
    background.train()
    for write in saves.take():
        write.result()
    assert seen["written-at-step-3"] == [False, False, False]  # held: step 3 ran without them
    assert seen["trainer-state-at-step-3"]  # small files are written at once, as transformers does

    plain = _trainer(str(tmp_path / "plain"))
    plain.train()
    for step in (2, 4):
        mine, theirs = (str(tmp_path / run / f"checkpoint-{step}") for run in ("background", "plain"))
        assert sorted(os.listdir(mine)) == sorted(os.listdir(theirs))
        _assert_same(_load(mine), _load(theirs), f"checkpoint-{step}")
    written = _load(str(tmp_path / "background" / "checkpoint-2"))["model"]
    for name, tensor in written.items():
        assert torch.equal(tensor, seen["at-save"][name]), name

    resumed = _trainer(str(tmp_path / "resumed"))
    checkpoint = str(tmp_path / "background" / "checkpoint-2")
    assert resumed.train(resume_from_checkpoint=checkpoint).global_step == 4
    for name, tensor in plain.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name


def test_a_snapshot_copies_what_a_step_may_change_and_keeps_frozen_and_tied_tensors_as_they_are(tmp_path):
    """A LoRA-like run (most parameters frozen) copies its trainable tensors only; tied weights share one
    copy, as they share the live tensor; the next save copies into the same host buffers."""
    from raytrainer.worker.hosted_saves import BackgroundSaves, _snapshot

    trainer = _trainer(str(tmp_path))
    model, saves = trainer.model, BackgroundSaves(trainer)
    for name, param in model.named_parameters():
        param.requires_grad = name.endswith("ln_f.weight")
    live = model.state_dict()
    saves.begin()
    snap = _snapshot(saves, model, None)
    saves.end()
    assert snap.keys() == live.keys()
    copied = sorted(k for k in live if snap[k].data_ptr() != live[k].data_ptr())
    assert copied == ["transformer.ln_f.weight"]
    assert torch.equal(snap["transformer.ln_f.weight"], live["transformer.ln_f.weight"])
    for param in model.parameters():
        param.requires_grad = True
    with torch.no_grad():
        model.transformer.ln_f.weight.add_(1.0)
    saves.begin()
    again = _snapshot(saves, model, None)
    saves.end()
    assert all(again[k].data_ptr() != live[k].data_ptr() for k in live)
    assert again["lm_head.weight"].data_ptr() == again["transformer.wte.weight"].data_ptr()  # tied: one copy
    buffer = again["transformer.ln_f.weight"]
    assert buffer.data_ptr() == snap["transformer.ln_f.weight"].data_ptr()  # the last save's buffer, reused
    assert torch.equal(buffer, model.transformer.ln_f.weight.detach())  # ... holding this save's values


def test_a_save_on_a_new_best_metric_waits_for_the_last_commit_and_the_driver_rotates(tmp_path, monkeypatch):
    """``save_strategy="best"`` decides to save after the step's callbacks ran (transformers'
    ``_maybe_log_save_evaluate``), and with ``save_total_limit=1`` the last checkpoint is to go: the save
    first waits for that checkpoint's commit, still hashing its files on the commit thread (made slow here),
    and transformers' own rotation deletes nothing (the folders are committed in ``output_dir`` itself): the
    driver's registry deletes each once the next is committed. Every checkpoint saved is committed, the run
    ends without an error, and only the last is left."""
    import time
    import types

    from transformers import TrainerCallback

    from raytrainer.driver.registry import CheckpointRegistry
    from raytrainer.rank_context import RankContext
    from raytrainer.worker import hosted_commit
    from raytrainer.worker.hosted_saves import write_in_background

    digest = hosted_commit.digest_files

    def slow_digest(folder, names):
        time.sleep(0.5)  # a large checkpoint's hashing, still going when the next save begins
        return digest(folder, names)

    monkeypatch.setattr(hosted_commit, "digest_files", slow_digest)
    run = types.SimpleNamespace(output_dir=str(tmp_path), storage_path=None, storage_filesystem=None,
                                save_total_limit=1)
    registry = CheckpointRegistry(run)

    class Driver:
        sent: list = []
        left: list = []  # the checkpoint folders after each commit

        def send(self, kind, part, urgent=False):
            self.sent.append(part.name)
            registry.add_part(part)
            self.left.append(sorted(p.name for p in tmp_path.glob("checkpoint-*")))

    class Saved(TrainerCallback):
        names: list = []

        def on_save(self, args, state, control, **kwargs):
            self.names.append(f"checkpoint-{state.global_step}")

    trainer = _trainer(str(tmp_path), [Saved()], max_steps=5, eval_strategy="steps", eval_steps=1,
                       save_strategy="best", metric_for_best_model="loss", save_total_limit=1)
    commit = hosted_commit.CommitCallback(RankContext(), Driver(), run, write_in_background(trainer))
    trainer.add_callback(commit)
    trainer.train()
    commit.wait()
    assert len(Saved.names) >= 2, Saved.names  # a new best at least twice: the first save was rotated away
    assert Driver.sent == Saved.names
    assert Driver.left[0] == [Saved.names[0]]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [Saved.names[-1]]


def test_with_a_limit_of_one_the_end_of_training_leaves_the_best_checkpoint_once_all_are_committed(tmp_path):
    """``save_total_limit=1`` with a best checkpoint: transformers' ``_finalize_training`` deletes every
    checkpoint folder but the best. On a rank it deleted them while the driver was still committing them
    (the driver's commits come over the channel, later; here a thread 0.3 s behind): the driver then wrote
    a manifest into a folder being deleted, and a folder of one file stayed. Now the rank deletes nothing,
    every checkpoint is committed whole, and the driver's registry deletes all but the best once they are
    (``end_of_training``, after ``train()``'s commits)."""
    import json
    import time
    import types

    from raytrainer.checkpoint import committed_checkpoints
    from raytrainer.driver.registry import CheckpointRegistry
    from raytrainer.rank_context import RankContext
    from raytrainer.worker import hosted_commit
    from raytrainer.worker.hosted_saves import write_in_background

    run = types.SimpleNamespace(output_dir=str(tmp_path), storage_path=None, storage_filesystem=None,
                                save_total_limit=1)
    registry = CheckpointRegistry(run)
    committing: list[threading.Thread] = []

    class Driver:
        def send(self, kind, part, urgent=False):
            def later():
                time.sleep(0.3)
                registry.add_part(part)

            committing.append(threading.Thread(target=later))
            committing[-1].start()

    # the loss falls, so with greater_is_better the first evaluation's checkpoint stays the best
    trainer = _trainer(str(tmp_path), max_steps=6, eval_strategy="steps", eval_steps=2,
                       metric_for_best_model="loss", greater_is_better=True, load_best_model_at_end=True,
                       save_total_limit=1)
    commit = hosted_commit.CommitCallback(RankContext(), Driver(), run, write_in_background(trainer))
    trainer.add_callback(commit)
    trainer.train()
    commit.wait()
    assert os.path.basename(trainer.state.best_model_checkpoint) == "checkpoint-2"
    for thread in committing:
        thread.join()
    # rotation as each was committed kept the latest and the best; every folder left is whole
    assert [os.path.basename(p) for _, p in committed_checkpoints(registry.storage)] == [
        "checkpoint-2", "checkpoint-6"] == sorted(p.name for p in tmp_path.glob("checkpoint-*"))
    assert registry.end_of_training() == ["checkpoint-6"]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]
    manifest = json.loads((tmp_path / "checkpoint-2" / "manifest.json").read_text())
    assert all((tmp_path / "checkpoint-2" / name).exists() for name in manifest["files"])


def test_transformers_rotates_checkpoints_at_the_end_of_save_checkpoint_through_its_module_function():
    """What ``hosted_saves._driver_rotates`` relies on: ``Trainer._save_checkpoint`` deletes old checkpoints
    by calling ``transformers.trainer.rotate_checkpoints``, and ``Trainer._finalize_training`` the folders
    ``transformers.trainer.sort_checkpoints`` lists (module functions, looked up when called)."""
    import inspect

    import transformers.trainer as hf_trainer

    source = inspect.getsource(hf_trainer.Trainer._save_checkpoint)
    assert "rotate_checkpoints(" in source and "self._rotate_checkpoints(" not in source
    assert callable(hf_trainer.rotate_checkpoints)
    # and ``_finalize_training`` (save_total_limit=1) deletes the folders ``sort_checkpoints`` lists
    source = inspect.getsource(hf_trainer.Trainer._finalize_training)
    assert "checkpoints_sorted = sort_checkpoints(" in source and "shutil.rmtree(checkpoint" in source
    assert callable(hf_trainer.sort_checkpoints)


def test_transformers_looks_for_the_best_checkpoints_folder_before_the_sharded_files_are_written():
    """What ``write_in_background`` makes the folder first for: ``_save_checkpoint`` sets
    ``best_model_checkpoint`` only where the best step's folder exists, checked after ``save_model`` (which
    writes nothing under FSDP's ``SHARDED_STATE_DICT``) and before ``_save_optimizer_and_scheduler`` (which
    writes the shards)."""
    import inspect

    import transformers.trainer as hf_trainer

    source = inspect.getsource(hf_trainer.Trainer._save_checkpoint)
    looks = source.index("if os.path.exists(best_checkpoint_dir):")
    assert source.index("self.save_model(") < looks < source.index("self._save_optimizer_and_scheduler(")


def test_a_checkpoint_folder_exists_once_save_model_returns_even_when_it_wrote_nothing(tmp_path):
    """With the background writes installed, ``checkpoint-<step>`` exists when transformers looks for the
    best checkpoint (after ``save_model``), even where ``save_model`` writes nothing (as under FSDP's
    ``SHARDED_STATE_DICT``: the shards come from ``_save_optimizer_and_scheduler``, after the look)."""
    from raytrainer.worker.hosted_saves import write_in_background

    trainer = _trainer(str(tmp_path), max_steps=2)
    trainer.save_model = lambda output_dir=None, _internal_call=False: None  # writes nothing
    saves = write_in_background(trainer)
    seen = []
    save_rest = trainer._save_optimizer_and_scheduler

    def spy(output_dir):
        seen.append(os.path.isdir(output_dir))
        return save_rest(output_dir)

    trainer._save_optimizer_and_scheduler = spy
    trainer.train()
    for write in saves.take():
        write.result()
    assert seen == [True]
