"""raytrainer.one_loop: raytrainer's Trainer as a transformers.Trainer, on transformers' own loop (issue 56).

In one process (``num_workers=0``) the object is transformers' trainer with raytrainer's additions around the
loop: it trains bitwise as transformers.Trainer does, and adds the driver's checks, callbacks' flag mappings,
``nonfinite_loss``, the run's log level during calls, ``training_args.bin`` without the hub token, and label
smoothing for a module without a ``config``. (On Ray workers the rank's layer adds the same as for any hosted
trainer: tests/integration/test_hosted.py.)
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from torch import nn

from raytrainer import TrainingArguments
from raytrainer.one_loop import Seq2SeqTrainer, Trainer
from raytrainer.worker.nonfinite import NonFiniteLossError


def _args(tmp_path, cls=TrainingArguments, **overrides):
    values = dict(output_dir=str(tmp_path), save_strategy="no", report_to="none", disable_tqdm=True,
                  per_device_train_batch_size=4, num_train_epochs=2, learning_rate=0.1, logging_steps=1,
                  seed=0)
    values.update(overrides)
    return cls(**values)


def test_it_is_transformers_trainer_and_trains_bitwise_as_transformers_does(tmp_path, make_classifier,
                                                                           make_examples):
    """Same model, data and arguments: the same weights, bit for bit, and the same logged losses as
    transformers.Trainer's in this process; the model given is the one trained."""
    data, _, _ = make_examples(20)
    ours_model, theirs_model = make_classifier(), make_classifier()
    ours = Trainer(model=ours_model, args=_args(tmp_path / "a"), train_dataset=data)
    theirs = transformers.Trainer(model=theirs_model, train_dataset=data,
                                  args=_args(tmp_path / "b", cls=transformers.TrainingArguments))
    assert isinstance(ours, transformers.Trainer)
    assert type(ours).train.__qualname__ == "_Additions.train"  # the checks, then transformers' train()
    out_ours, out_theirs = ours.train(), theirs.train()
    assert out_ours.global_step == out_theirs.global_step == 10
    for (name, a), (_, b) in zip(ours_model.state_dict().items(), theirs_model.state_dict().items()):
        assert torch.equal(a, b), name
    losses = [[e["loss"] for e in t.state.log_history if "loss" in e] for t in (ours, theirs)]
    assert len(losses[0]) == 10 and losses[0] == losses[1]
    assert ours.model is ours_model


def test_the_trainers_arguments_are_the_ones_given_and_transformers_own_become_raytrainers(
        tmp_path, make_classifier):
    """``trainer.args`` is the arguments object given (transformers' loop reads raytrainer's process view
    from it, as ``TrainingArguments`` made in a script expect); ``args=None`` and transformers' own
    arguments become raytrainer's, every value given carried over."""
    given = _args(tmp_path, learning_rate=0.25)
    assert Trainer(model=make_classifier(), args=given).args is given
    ours = Trainer(model=make_classifier(), args=_args(tmp_path, cls=transformers.TrainingArguments,
                                                       learning_rate=0.25))
    assert type(ours.args) is TrainingArguments and ours.args.learning_rate == 0.25
    default = Trainer(model=make_classifier())
    assert default.args.output_dir == "trainer_output" and default.args.num_workers == 0


def test_with_workers_the_object_is_the_drivers_side_and_starts_nothing(tmp_path, make_classifier):
    trainer = Trainer(model=make_classifier(), args=_args(tmp_path, num_workers=2))
    assert isinstance(trainer, transformers.Trainer) and isinstance(trainer, Trainer)
    assert type(trainer).hosted_class is Trainer  # each rank builds this class, its additions included
    assert "_group" not in vars(trainer)


class _StopAtTwo(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        return {"should_training_stop": True} if state.global_step == 2 else None


class _ReturnsAString(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        return "stop"


def test_a_callback_returning_a_mapping_of_flags_stops_and_other_returns_are_refused(
        tmp_path, make_classifier, make_examples):
    data, _, _ = make_examples(20)
    trainer = Trainer(model=make_classifier(), args=_args(tmp_path), train_dataset=data,
                      callbacks=[_StopAtTwo()])
    assert trainer.train().global_step == 2
    trainer = Trainer(model=make_classifier(), args=_args(tmp_path), train_dataset=data,
                      callbacks=[_ReturnsAString()])
    with pytest.raises(TypeError, match="_ReturnsAString"):
        trainer.train()


class _InfLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        return {"loss": nn.functional.cross_entropy(logits, labels) * float("inf"), "logits": logits}


def test_a_nonfinite_loss_stops_before_the_update_by_default(tmp_path, make_examples):
    data, _, _ = make_examples(8)
    model = _InfLoss()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteLossError, match="training loss of inf in the update to step 1"):
        Trainer(model=model, args=_args(tmp_path), train_dataset=data).train()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    ignored = Trainer(model=_InfLoss(), args=_args(tmp_path, nonfinite_loss="ignore", max_steps=2),
                      train_dataset=data)
    assert ignored.train().global_step == 2  # transformers' behaviour: trains on


class _NoLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, labels=None):
        return {"logits": self.linear(x)}


def test_the_drivers_checks_refuse_a_call_before_the_loop_starts(tmp_path, make_classifier, make_examples):
    data, x, _ = make_examples(8)
    began = []

    class Began(transformers.TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            began.append(1)

    unlabelled = [{"x": row} for row in x]
    with pytest.raises(ValueError, match="has no 'labels' column"):
        Trainer(model=make_classifier(), args=_args(tmp_path), train_dataset=unlabelled,
                callbacks=[Began()]).train()
    with pytest.raises(ValueError, match="_NoLoss returned no loss"):
        Trainer(model=_NoLoss(), args=_args(tmp_path), train_dataset=data, callbacks=[Began()]).train()
    with pytest.raises(ValueError, match="evaluate\\(\\) needs an eval_dataset"):
        Trainer(model=make_classifier(), args=_args(tmp_path)).evaluate()
    assert began == []


class _Remembers(nn.Module):
    """A model whose forward leaves traces: the rows it saw (a buffer replaced), its calls (a buffer changed
    in place, an attribute), and a random draw that joins its output."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 3)
        self.register_buffer("seen", torch.empty(0))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.forwards = 0
        self.draws: list[float] = []

    def forward(self, x, labels=None):
        self.seen = torch.cat([self.seen, x[:, 0]])
        self.calls.add_(1)
        self.forwards += 1
        noise = torch.rand(())
        self.draws.append(float(noise))
        logits = self.linear(x) + noise
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_the_drivers_forward_check_leaves_no_trace_on_the_model_or_the_random_stream(tmp_path,
                                                                                     make_examples):
    """The driver runs the model's forward once before training to check it returns a loss; transformers'
    loop never does. What that forward changed (buffers replaced and changed in place, attributes, the
    random stream) is put back: after training, the model holds what transformers.Trainer's does, bit for
    bit, and counted only the training forwards."""
    data, _, _ = make_examples(16)
    ours_model, theirs_model = _Remembers(), _Remembers()
    Trainer(model=ours_model, args=_args(tmp_path / "a"), train_dataset=data).train()
    transformers.Trainer(model=theirs_model, train_dataset=data,
                         args=_args(tmp_path / "b", cls=transformers.TrainingArguments)).train()
    assert theirs_model.forwards == 8 and int(theirs_model.calls) == 8
    assert ours_model.forwards == 8 and int(ours_model.calls) == 8
    assert ours_model.draws == theirs_model.draws
    assert ours_model.training and theirs_model.training
    for (name, a), (_, b) in zip(ours_model.state_dict().items(), theirs_model.state_dict().items()):
        assert a.shape == b.shape == ((32,) if name == "seen" else a.shape) and torch.equal(a, b), name


def test_the_runs_log_level_holds_during_calls_only(tmp_path, make_classifier, make_examples):
    data, _, _ = make_examples(8)
    hf_logger = logging.getLogger("transformers")
    before = hf_logger.level
    seen = []

    class Level(transformers.TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            seen.append(hf_logger.level)

    trainer = Trainer(model=make_classifier(), args=_args(tmp_path, log_level="error", max_steps=1),
                      train_dataset=data, callbacks=[Level()])
    assert hf_logger.level == before
    trainer.train()
    assert seen == [logging.ERROR] and hf_logger.level == before


def test_label_smoothing_on_a_module_without_a_config(tmp_path, make_classifier, make_examples):
    """transformers reads ``model.config`` to decide on label smoothing; a plain module trains with it, its
    loss the smoothed cross entropy."""
    data, x, y = make_examples(8)
    model = make_classifier()
    trainer = Trainer(model=model, args=_args(tmp_path, label_smoothing_factor=0.2), train_dataset=data)
    assert trainer.args.label_smoothing_factor == 0.2
    loss = trainer.compute_loss(model, {"x": x, "labels": y})
    with torch.no_grad():
        expected = nn.functional.cross_entropy(model.linear(x), y, label_smoothing=0.2)
    assert torch.allclose(loss, expected, atol=1e-6)


def test_training_args_bin_holds_no_hub_token(tmp_path, make_classifier, make_examples):
    data, _, _ = make_examples(8)
    trainer = Trainer(model=make_classifier(), train_dataset=data,
                      args=_args(tmp_path, hub_token="hf_secret_token_123", save_strategy="steps",
                                 save_steps=1, max_steps=1))
    trainer.train()
    saved = torch.load(tmp_path / "checkpoint-1" / "training_args.bin", weights_only=False)
    assert saved.hub_token is None and saved.max_steps == 1
    assert trainer.args.hub_token == "hf_secret_token_123"


def test_seq2seq_trainer_generates_as_transformers_seq2seq_trainer(tmp_path):
    import numpy as np

    from raytrainer import Seq2SeqTrainingArguments

    config = transformers.T5Config(vocab_size=32, d_model=16, d_ff=32, num_layers=1, num_heads=2,
                                   d_kv=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    rows = [{"input_ids": torch.tensor([3, 4, 5, 1]), "labels": torch.tensor([6, 7, 1])}] * 4
    outputs = []
    for cls, args_cls in ((Seq2SeqTrainer, Seq2SeqTrainingArguments),
                          (transformers.Seq2SeqTrainer, transformers.Seq2SeqTrainingArguments)):
        torch.manual_seed(0)
        trainer = cls(model=transformers.T5ForConditionalGeneration(config),
                      args=_args(tmp_path, cls=args_cls, predict_with_generate=True, generation_max_length=5,
                                 per_device_eval_batch_size=2))
        assert isinstance(trainer, transformers.Seq2SeqTrainer)
        outputs.append(trainer.predict(rows))
    ours, theirs = outputs
    generated = (ours.predictions != 0).sum(axis=1)
    assert generated.max() == 4  # generation_max_length=5: the start token and 4 generated ones
    assert np.array_equal(ours.predictions, theirs.predictions)
    assert ours.metrics["test_loss"] == theirs.metrics["test_loss"]


class _DropoutNet(nn.Module):
    """Dropout: a resume that restored no random state would train differently."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Linear(16, 3))

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_checkpoints_are_committed_and_a_resume_is_verified_and_bitwise(tmp_path, make_examples):
    import json

    from raytrainer.checkpoint import CheckpointError

    data, _, _ = make_examples(24)

    def run(out, **extra):
        trainer = Trainer(model=_DropoutNet(), train_dataset=data,
                          args=_args(out, save_strategy="steps", save_steps=4, max_steps=12, **extra))
        return trainer

    full = run(tmp_path / "full")
    full.train()
    folder = tmp_path / "full" / "checkpoint-4"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["global_step"] == 4
    assert set(manifest["files"]) == {p.name for p in folder.iterdir()} - {"manifest.json"}
    resumed = run(tmp_path / "resumed")
    assert resumed.train(resume_from_checkpoint=str(folder)).global_step == 12
    for (name, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
    weights = folder / "model.safetensors"
    damaged = bytearray(weights.read_bytes())
    damaged[-1] ^= 0xFF
    weights.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        run(tmp_path / "again").train(resume_from_checkpoint=str(folder))


class _WorsensAfterFirstEval(Trainer):
    """The first evaluation's loss is the best."""

    def evaluate(self, *args, **kwargs):
        metrics = super().evaluate(*args, **kwargs)
        self.evaluations = getattr(self, "evaluations", 0) + 1
        return {**metrics, "eval_loss": float(self.evaluations)}


def test_checkpoints_committed_to_other_storage_leave_only_the_best_on_local_disk(tmp_path, make_examples):
    """With ``storage_path`` elsewhere, each node's local copy of a committed checkpoint is removed (a run's
    checkpoints would otherwise fill the disk beside the storage meant for them); the best stays while it
    is the best, for ``load_best_model_at_end``, which loads its weights."""
    from safetensors.torch import load_file

    data, _, _ = make_examples(24)
    remote = tmp_path / "remote"
    trainer = _WorsensAfterFirstEval(
        model=_DropoutNet(), train_dataset=data, eval_dataset=data,
        args=_args(tmp_path / "out", save_strategy="steps", save_steps=4, eval_strategy="steps", eval_steps=4,
                   max_steps=12, storage_path=f"file://{remote}", load_best_model_at_end=True,
                   metric_for_best_model="loss"))
    trainer.train()
    assert sorted(p.name for p in remote.iterdir()) == ["checkpoint-12", "checkpoint-4", "checkpoint-8"]
    assert all((remote / name / "manifest.json").exists() for name in ("checkpoint-4", "checkpoint-12"))
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-4"]
    best = load_file(str(remote / "checkpoint-4" / "model.safetensors"))
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in best.items())
    final = load_file(str(remote / "checkpoint-12" / "model.safetensors"))
    assert not all(torch.equal(final[k], v) for k, v in best.items())


def test_a_second_run_saving_into_the_same_checkpoint_folder_commits_it_again(tmp_path, make_examples):
    """transformers saves into an existing ``checkpoint-N`` (a second run into the same ``output_dir``): the
    commit lists the new files, never the earlier commit's manifest, and the checkpoint resumes."""
    data, _, _ = make_examples(24)

    def run(max_steps=4):
        return Trainer(model=_DropoutNet(), train_dataset=data,
                       args=_args(tmp_path, save_strategy="steps", save_steps=4, max_steps=max_steps))

    run().train()
    run().train()
    assert run(8).train(resume_from_checkpoint=str(tmp_path / "checkpoint-4")).global_step == 8


def test_with_workers_a_checkpoint_of_another_shape_is_refused_before_any_worker(tmp_path, make_examples,
                                                                                  monkeypatch):
    from raytrainer.checkpoint import CheckpointError
    from raytrainer.driver import launch

    launched = []  # a spy: the launch on Ray workers must never be reached
    monkeypatch.setattr(launch, "launch", lambda *a, **k: launched.append(a))
    data, _, _ = make_examples(24)
    Trainer(model=_DropoutNet(), train_dataset=data,
            args=_args(tmp_path / "a", save_strategy="steps", save_steps=4, max_steps=4)).train()
    wider = _DropoutNet()
    wider.net[0] = nn.Linear(4, 24)
    wider.net[2] = nn.Linear(24, 3)
    trainer = Trainer(model=wider, train_dataset=data, args=_args(tmp_path / "b", num_workers=2, max_steps=8))
    with pytest.raises(CheckpointError, match=r"tensor 'net.0.weight' has shape \(16, 4\) in the checkpoint "
                                              r"but \(24, 4\) in the model"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    assert launched == []


@pytest.mark.parametrize("stop_at", [3, 6])  # mid-epoch, and the end of the first epoch (6 steps each)
def test_a_resume_with_persistent_loader_workers_is_bitwise(tmp_path, make_examples, stop_at):
    """torch's loader draws its workers' seed from the global stream at each new iterator: once in the
    uninterrupted run, again in the resumed one (worker/hosted_resume.LoaderSeedOffTheStream forks it)."""
    data, _, _ = make_examples(24)
    workers = dict(dataloader_num_workers=1, dataloader_persistent_workers=True, num_train_epochs=2,
                   max_steps=-1)

    def run(out, **extra):
        return Trainer(model=_DropoutNet(), train_dataset=data, args=_args(out, **workers, **extra))

    full = run(tmp_path / "full", save_strategy="steps", save_steps=stop_at)
    full.train()
    resumed = run(tmp_path / "resumed")
    checkpoint = str(tmp_path / "full" / f"checkpoint-{stop_at}")
    assert resumed.train(resume_from_checkpoint=checkpoint).global_step == 12
    for (name, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
