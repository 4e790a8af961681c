"""Unit tests for the Trainer facade and the per-rank loop, run in this process (num_workers=0, no Ray).

Each test asserts on values: weights, losses, step counts, predictions, event sequences, files.
"""

from __future__ import annotations

import copy
import logging
import math

import numpy as np
import pytest
import torch
import transformers
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from raytrainer import Trainer, TrainerCallback, TrainerControl, TrainingArguments

ALL_EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_substep_end",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
    "on_evaluate",
    "on_predict",
    "on_save",
    "on_log",
    "on_prediction_step",
    "on_push_begin",
)


class EventRecorder(TrainerCallback):
    """Records ``(event, state.global_step)`` for every event, and the logs of each on_log."""

    def __init__(self):
        self.events: list[tuple[str, int]] = []
        self.logs: list[dict] = []

    def names(self, event: str) -> list[tuple[str, int]]:
        return [e for e in self.events if e[0] == event]


def _recording_hook(name):
    def hook(self, args, state, control, **kwargs):
        self.events.append((name, state.global_step))
        if name == "on_log":
            self.logs.append(dict(kwargs["logs"]))

    return hook


for _event in ALL_EVENTS:
    setattr(EventRecorder, _event, _recording_hook(_event))


class RecordingTrainer(Trainer):
    """Records the first feature of every training batch (= the example indices, see conftest), the loss."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[list[int]] = []
        self.step_losses: list[float] = []
        self.columns: set[str] = set()  # the batches' keys

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen.append([int(v) for v in inputs["x"][:, 0].tolist()])
        self.columns.update(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.step_losses.append(float(loss))
        return loss


# -- 1. compute_loss overrides -------------------------------------------------------------------------------
class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return x * self.w


class QuadraticTrainer(Trainer):
    """The model's output is ignored (times 0): the loss (w - 3)^2 alone drives w."""

    calls = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.calls += 1
        outputs = model(**inputs)
        loss = 0 * outputs.sum() + ((model.w - 3.0) ** 2).sum()
        return (loss, outputs) if return_outputs else loss


def test_compute_loss_override_is_what_trains(make_args):
    dataset = [{"x": torch.randn(2)} for _ in range(16)]
    model = Scale()
    args = make_args(
        per_device_train_batch_size=4,
        num_train_epochs=5,
        optim="sgd",
        learning_rate=0.1,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
    )
    trainer = QuadraticTrainer(model=model, args=args, train_dataset=dataset)
    out = trainer.train()
    steps = 5 * (16 // 4)
    assert out.global_step == steps
    assert trainer.calls == steps
    # SGD on (w-3)^2 with lr 0.1: w <- w + 0.2 (3 - w), from 0: w_n = 3 (1 - 0.8^n)
    assert model.w.item() == pytest.approx(3 * (1 - 0.8**steps), abs=1e-5)
    assert out.training_loss == pytest.approx(np.mean([9 * 0.8 ** (2 * k) for k in range(steps)]), rel=1e-5)


class _CountsTrain(nn.Linear):
    """A module with a train() of its own: the training step calls it every step, as transformers'."""

    calls = 0

    def train(self, mode=True):
        type(self).calls += 1
        return super().train(mode)


class _Head(nn.Module):
    def __init__(self, body: type = nn.Linear):
        super().__init__()
        self.body, self.dropout, self.out = body(4, 8), nn.Dropout(0.0), nn.Linear(8, 3)

    def forward(self, x, labels=None):
        logits = self.out(self.dropout(self.body(x)))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


@pytest.mark.parametrize("body", [nn.Linear, _CountsTrain])
def test_every_training_step_trains_the_model_in_training_mode(make_args, make_examples, body):
    """A module a callback put in eval mode is back in training mode in the step's forward, and a module
    with its own train() has it called every step (the step calls model.train() whenever that may change
    anything)."""
    seen = []

    class EvalDropout(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step % 2:
                model.dropout.eval()

    model = _Head(body)
    model.dropout.register_forward_pre_hook(  # the training forwards
        lambda module, args: seen.append(module.training) if torch.is_grad_enabled() else None)
    trainer = Trainer(model=model, args=make_args(per_device_train_batch_size=4, max_steps=6),
                      train_dataset=make_examples(24)[0], callbacks=[EvalDropout()])
    _CountsTrain.calls = 0
    trainer.train()
    assert seen == [True] * 6
    assert _CountsTrain.calls >= (6 if body is _CountsTrain else 0)


def test_a_parameter_replaced_between_two_train_calls_is_clipped_and_zeroed(make_args, make_examples):
    """The strategy lists a model's parameters once per training run (zero_grad and clipping walk no module
    tree each step): a layer replaced between two ``train()`` calls is clipped and zeroed in the second. With
    SGD at rate 0.5 and gradients clipped to norm 1e-3, 3 updates move all the weights together by at most
    3 x 0.5 x 1e-3; an unclipped new layer would move by its whole gradient."""
    torch.manual_seed(0)
    model = _Head()
    args = make_args(per_device_train_batch_size=4, max_steps=3, max_grad_norm=1e-3, optim="sgd",
                     learning_rate=0.5, lr_scheduler_type="constant", gradient_accumulation_steps=2,
                     save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=make_examples(24)[0])
    trainer.train()
    model.out = nn.Linear(8, 3)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert all(p.grad is None for p in model.parameters())
    assert 0 < (after - before).norm() <= 3 * 0.5 * 1e-3 * (1 + 1e-5)


def test_compute_loss_func_is_used_for_the_loss(make_args, make_classifier, make_examples):
    calls = []

    def zero_weight_loss(outputs, labels, num_items_in_batch=None):
        if torch.is_grad_enabled():  # without: raytrainer asking whether the loss is a mean (worker/loss.py)
            calls.append(labels.shape[0])
        return 0.0 * outputs["logits"].sum()  # no gradient signal at all: the weights must not move

    model = make_classifier()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dataset, _, _ = make_examples(12)
    args = make_args(per_device_train_batch_size=4, num_train_epochs=1, optim="sgd", learning_rate=1.0)
    Trainer(model=model, args=args, train_dataset=dataset, compute_loss_func=zero_weight_loss).train()
    assert calls == [4, 4, 4]  # once per batch
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


class LabelSpy(nn.Module):
    """Records whether forward was given labels; computes its own loss when it is (as HF models do)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.got_labels: list[bool] = []

    def forward(self, x, labels=None):
        self.got_labels.append(labels is not None)
        logits = self.linear(x)
        if labels is None:
            return {"logits": logits}
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def _cross_entropy_loss_func(outputs, labels, num_items_in_batch=None):
    return nn.functional.cross_entropy(outputs["logits"], labels)


def test_compute_loss_func_takes_the_labels_away_from_the_model(make_args, make_examples):
    dataset, _, _ = make_examples(8)
    model = LabelSpy()
    Trainer(
        model=model,
        args=make_args(per_device_train_batch_size=4, num_train_epochs=1),
        train_dataset=dataset,
        compute_loss_func=_cross_entropy_loss_func,
    ).train()
    assert model.got_labels == [False, False]


def test_compute_loss_func_takes_precedence_over_label_smoothing(make_args, make_classifier, make_examples):
    _, x, y = make_examples(8)
    model = make_classifier()
    calls = []

    def loss_func(outputs, labels, num_items_in_batch=None):
        calls.append(1)
        return nn.functional.cross_entropy(outputs["logits"], labels)

    trainer = Trainer(model=model, args=make_args(label_smoothing_factor=0.2), compute_loss_func=loss_func)
    loss = trainer.compute_loss(model, {"x": x, "labels": y})
    with torch.no_grad():
        expected = nn.functional.cross_entropy(model.linear(x), y)
    assert calls == [1]
    assert torch.allclose(loss, expected, atol=1e-6)


def test_compute_loss_func_receives_num_items_in_batch(make_args, make_classifier, make_examples):
    dataset, _, _ = make_examples(8)
    for example in dataset[:2]:
        example["labels"] = torch.tensor(-100)
    received = []

    def loss_func(outputs, labels, num_items_in_batch=None):
        if torch.is_grad_enabled():  # without: raytrainer asking whether the loss is a mean (worker/loss.py)
            received.append(None if num_items_in_batch is None else int(num_items_in_batch))
        count = num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum().clamp(min=1)
        return nn.functional.cross_entropy(outputs["logits"], labels, reduction="sum") / count

    args = make_args(
        per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=1, data_seed=0
    )
    Trainer(model=make_classifier(), args=args, train_dataset=dataset, compute_loss_func=loss_func).train()
    # two windows of 2 x 2 examples; 6 of the 8 labels count, so the windows hold 6 between them
    assert len(received) == 4
    assert received[0] == received[1] and received[2] == received[3]
    assert received[0] + received[2] == 6


def test_causal_lm_loss_counts_shifted_labels_as_transformers(make_args):
    """A causal LM's loss predicts token i+1 at position i: transformers counts ``labels[..., 1:]`` for
    ``num_items_in_batch``. The logged loss of a one-batch step is then the model's own mean loss on that
    batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                         max_position_embeddings=16))
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    ids[0, 10:] = -100  # padding in the labels: not counted either
    with torch.no_grad():
        expected = model(input_ids=ids.clamp(min=0), labels=ids).loss.item()
    dataset = [{"input_ids": row.clamp(min=0), "labels": row} for row in ids]
    args = make_args(per_device_train_batch_size=4, max_steps=1, logging_steps=1, learning_rate=1e-3)
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged == [pytest.approx(expected, abs=1e-6)]  # unrounded; counting every position gave 54/58


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_eval_loss_of_a_causal_lm_counts_labels_as_transformers(make_args, tmp_path, arch):
    """transformers 5.23 passes ``num_items_in_batch`` to ``compute_loss`` in evaluation too, counted by the
    same rule as in training: a GPT-2 (no ``loss_type`` until its first forward) counts every label
    position, so its eval_loss is 15/16 of the model's mean here; a LLaMA counts ``labels[..., 1:]``.
    raytrainer's eval_loss equals transformers' for both (it was the model's mean: 16/15 of transformers')."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    def build():
        torch.manual_seed(0)
        if arch == "gpt2":
            return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16))
        return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                            max_position_embeddings=16))

    ids = torch.randint(0, 64, (6, 16), generator=torch.Generator().manual_seed(1))
    ids[0, 10:] = -100
    data = [{"input_ids": row.clamp(min=0), "labels": row} for row in ids]
    ours = Trainer(model=build(), args=make_args(per_device_eval_batch_size=3), eval_dataset=data).evaluate()
    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True,
                                             per_device_eval_batch_size=3, report_to="none")
    theirs = transformers.Trainer(model=build(), eval_dataset=data, args=hf_args).evaluate()
    assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-6)
    with torch.no_grad():
        model = build()
        means = [model(input_ids=ids[i:i + 3].clamp(min=0), labels=ids[i:i + 3]).loss.item() for i in (0, 3)]
    if arch == "gpt2":
        assert ours["eval_loss"] != pytest.approx(sum(means) / 2, rel=1e-3)  # not the model's own mean
    else:
        assert ours["eval_loss"] == pytest.approx(sum(means) / 2, rel=1e-6)


# -- 2. gradient accumulation --------------------------------------------------------------------------------
class DigitsClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(64, 16)
        self.out = nn.Linear(16, 10)

    def forward(self, x, labels=None):
        logits = self.out(torch.tanh(self.hidden(x)))
        if labels is None:
            return {"logits": logits}
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def _digits_model(seed: int = 0) -> DigitsClassifier:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return DigitsClassifier()


def _digits_examples(digits, n: int) -> list[dict]:
    x, y = digits
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


@pytest.mark.parametrize("optim,lr", [("sgd", 0.5), ("adamw_torch", 0.01)])
def test_gradient_accumulation_2x8_equals_1x16(make_args, digits, optim, lr):
    n, epochs = 64, 2
    dataset = _digits_examples(digits, n)
    init = _digits_model()
    results = {}
    for batch_size, accumulation in ((16, 1), (8, 2)):
        model = copy.deepcopy(init)
        args = make_args(
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            num_train_epochs=epochs,
            optim=optim,
            learning_rate=lr,
            max_grad_norm=1e9,
            seed=7,
        )
        out = Trainer(model=model, args=args, train_dataset=dataset).train()
        assert out.global_step == epochs * math.ceil(n / 16)
        results[accumulation] = (model.state_dict(), out.training_loss)
    (one, loss_one), (two, loss_two) = results[1], results[2]
    for k in one:
        assert not torch.allclose(one[k], init.state_dict()[k], atol=1e-3), f"{k} did not train"
        assert torch.allclose(one[k], two[k], atol=1e-6, rtol=0), f"{k}: {(one[k] - two[k]).abs().max()}"
    assert loss_one == pytest.approx(loss_two, abs=1e-6)


@pytest.mark.parametrize("n", [16, 17, 40, 48])
def test_gradient_accumulation_step_count_per_epoch(make_args, make_classifier, make_examples, n):
    dataset, _, _ = make_examples(n)
    recorder = EventRecorder()
    args = make_args(per_device_train_batch_size=8, gradient_accumulation_steps=2, num_train_epochs=2)
    out = Trainer(model=make_classifier(), args=args, train_dataset=dataset, callbacks=[recorder]).train()
    per_epoch = math.ceil(n / 16)
    assert out.global_step == 2 * per_epoch
    assert len(recorder.names("on_optimizer_step")) == 2 * per_epoch
    # one on_substep_end per micro-batch that is not the last of its window
    micro_per_epoch = math.ceil(n / 8)
    assert len(recorder.names("on_substep_end")) == 2 * (micro_per_epoch - per_epoch)


# -- 3. max_steps and fractional epochs ----------------------------------------------------------------------
def test_max_steps_overrides_num_train_epochs(make_args, make_classifier, make_examples):
    dataset, _, _ = make_examples(32)
    recorder = EventRecorder()
    args = make_args(per_device_train_batch_size=8, num_train_epochs=1, max_steps=10)  # 4 updates / epoch
    trainer = RecordingTrainer(
        model=make_classifier(), args=args, train_dataset=dataset, callbacks=[recorder]
    )
    out = trainer.train()
    assert out.global_step == 10
    assert len(recorder.names("on_optimizer_step")) == 10
    assert len(trainer.seen) == 10
    assert trainer.state.max_steps == 10
    assert trainer.state.epoch == pytest.approx(2.5)
    assert len(recorder.names("on_epoch_begin")) == 3


def test_max_steps_shorter_than_an_epoch(make_args, make_classifier, make_examples):
    dataset, _, _ = make_examples(32)
    args = make_args(per_device_train_batch_size=8, num_train_epochs=3, max_steps=2)
    trainer = RecordingTrainer(model=make_classifier(), args=args, train_dataset=dataset)
    assert trainer.train().global_step == 2
    assert len(trainer.seen) == 2
    assert trainer.state.epoch == pytest.approx(0.5)


def test_fractional_num_train_epochs(make_args, make_classifier, make_examples):
    dataset, _, _ = make_examples(40)  # 5 updates per epoch
    args = make_args(per_device_train_batch_size=8, num_train_epochs=1.5)
    trainer = RecordingTrainer(model=make_classifier(), args=args, train_dataset=dataset)
    out = trainer.train()
    assert out.global_step == math.ceil(1.5 * 5) == 8
    assert len(trainer.seen) == 8
    assert trainer.state.epoch == pytest.approx(1 + 3 / 5)
    # the first epoch saw every example exactly once
    assert sorted(i for batch in trainer.seen[:5] for i in batch) == list(range(40))


# -- 4. callbacks that stop training -------------------------------------------------------------------------
class StopAtThreeWithDict(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            return {"should_training_stop": True}
        return None


class StopAtThreeWithControl(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            return TrainerControl(should_training_stop=True)
        return None


@pytest.mark.parametrize("stopper", [StopAtThreeWithDict, StopAtThreeWithControl])
def test_callback_return_value_stops_training_at_step_three(
    make_args, make_classifier, make_examples, stopper
):
    dataset, _, _ = make_examples(32)
    recorder = EventRecorder()
    args = make_args(per_device_train_batch_size=4, num_train_epochs=3)  # would be 24 steps
    trainer = RecordingTrainer(
        model=make_classifier(), args=args, train_dataset=dataset, callbacks=[stopper(), recorder]
    )
    out = trainer.train()
    assert out.global_step == 3
    assert trainer.state.global_step == 3
    assert len(trainer.seen) == 3
    assert recorder.names("on_step_end") == [("on_step_end", 1), ("on_step_end", 2), ("on_step_end", 3)]
    assert [e for e, _ in recorder.events[-3:]] == ["on_epoch_end", "on_log", "on_train_end"]


def test_callback_returning_an_unknown_flag_is_an_error(make_args, make_classifier, make_examples):
    class Typo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            return {"should_trainig_stop": True}

    dataset, _, _ = make_examples(8)
    trainer = Trainer(
        model=make_classifier(),
        args=make_args(per_device_train_batch_size=4),
        train_dataset=dataset,
        callbacks=[Typo()],
    )
    with pytest.raises(ValueError, match="should_trainig_stop"):
        trainer.train()


# -- 5. event order ------------------------------------------------------------------------------------------
def test_callback_event_order_one_epoch_two_updates_accumulation_two(
    make_args, make_classifier, make_examples
):
    train, _, _ = make_examples(8)
    evaluation, _, _ = make_examples(4, seed=1)
    recorder = EventRecorder()
    args = make_args(
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        eval_strategy="epoch",
    )
    Trainer(
        model=make_classifier(), args=args, train_dataset=train, eval_dataset=evaluation, callbacks=[recorder]
    ).train()
    update = ["on_step_begin", "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step"]
    expected = [
        ("on_init_end", 0),
        ("on_train_begin", 0),
        ("on_epoch_begin", 0),
        *[(e, 0) for e in update],
        ("on_step_end", 1),
        *[(e, 1) for e in update],
        ("on_step_end", 2),
        ("on_epoch_end", 2),
        ("on_prediction_step", 2),
        ("on_prediction_step", 2),
        ("on_log", 2),
        ("on_evaluate", 2),
        ("on_log", 2),
        ("on_train_end", 2),
    ]
    assert recorder.events == expected
    eval_logs, train_logs = recorder.logs
    assert "eval_loss" in eval_logs and "train_loss" not in eval_logs
    assert "train_loss" in train_logs and "train_runtime" in train_logs


class OptimizerStepWatcher(TrainerCallback):
    """What the model looks like at each optimizer event (the TrainerCallback docstring's promises)."""

    def __init__(self):
        self.seen: list[tuple[str, bool, bool]] = []  # (event, weights moved since step begin, grads present)
        self._start = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._start = model.linear.weight.detach().clone()

    def _look(self, event, model):
        moved = not torch.equal(model.linear.weight.detach(), self._start)
        self.seen.append((event, moved, model.linear.weight.grad is not None))

    def on_substep_end(self, args, state, control, model=None, **kwargs):
        self._look("on_substep_end", model)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self._look("on_pre_optimizer_step", model)

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        self._look("on_optimizer_step", model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._look("on_step_end", model)


def test_optimizer_events_see_gradients_before_and_after_the_update(
    make_args, make_classifier, make_examples
):
    train, _, _ = make_examples(8)
    watcher = OptimizerStepWatcher()
    args = make_args(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        optim="sgd",
        learning_rate=0.5,
    )
    Trainer(model=make_classifier(), args=args, train_dataset=train, callbacks=[watcher]).train()
    one_update = [
        ("on_substep_end", False, True),  # first micro-batch's gradients, nothing applied
        ("on_pre_optimizer_step", False, True),  # final gradients, not applied yet
        ("on_optimizer_step", True, True),  # applied, gradients not zeroed yet
        ("on_step_end", True, False),  # gradients zeroed
    ]
    assert watcher.seen == one_update * 2


# -- 6. evaluate ---------------------------------------------------------------------------------------------
def test_evaluate_prefix_predictions_and_labels(make_args, make_classifier, make_examples):
    dataset, x, y = make_examples(10)
    model = make_classifier()
    received = []

    def compute_metrics(eval_pred):
        received.append(eval_pred)
        return {"accuracy": float((eval_pred.predictions.argmax(-1) == eval_pred.label_ids).mean())}

    trainer = Trainer(
        model=model,
        args=make_args(per_device_eval_batch_size=4),
        eval_dataset=dataset,
        compute_metrics=compute_metrics,
    )
    metrics = trainer.evaluate(metric_key_prefix="dev")
    # transformers adds model_preparation_time where the evaluation is the first to prepare the model
    prefixed = {k for k in metrics if k not in ("epoch", "dev_model_preparation_time")}
    assert prefixed == {
        "dev_accuracy",
        "dev_loss",
        "dev_runtime",
        "dev_samples_per_second",
        "dev_steps_per_second",
    }
    (eval_pred,) = received
    with torch.no_grad():
        logits = model.linear(x).numpy()
    assert eval_pred.predictions.shape == (10, 3)
    assert np.allclose(eval_pred.predictions, logits, atol=1e-6)
    np.testing.assert_array_equal(eval_pred.label_ids, y.numpy())
    assert metrics["dev_accuracy"] == pytest.approx(float((logits.argmax(-1) == y.numpy()).mean()))
    assert trainer.state.log_history[-1]["dev_loss"] == metrics["dev_loss"]


def test_evaluate_before_training_returns_only_prefixed_keys(make_args, make_classifier, make_examples):
    dataset, _, _ = make_examples(6)
    metrics = Trainer(model=make_classifier(), args=make_args(), eval_dataset=dataset).evaluate()
    assert metrics.pop("epoch") == 0  # transformers' TrainerState starts at epoch 0 and logs it
    assert all(k.startswith("eval_") for k in metrics)


def test_evaluate_after_training_reports_the_epoch(make_args, make_classifier, make_examples):
    dataset, _, _ = make_examples(8)
    trainer = Trainer(
        model=make_classifier(),
        args=make_args(per_device_train_batch_size=4, num_train_epochs=2),
        train_dataset=dataset,
        eval_dataset=dataset,
    )
    trainer.train()
    metrics = trainer.evaluate(metric_key_prefix="val")
    assert metrics["epoch"] == 2.0
    assert all(k.startswith("val_") for k in metrics if k != "epoch")


def _per_example_losses(model, x, y) -> np.ndarray:
    with torch.no_grad():
        return nn.functional.cross_entropy(model.linear(x), y, reduction="none").numpy()


def test_eval_loss_is_the_example_mean_when_batches_divide_the_dataset(
    make_args, make_classifier, make_examples
):
    dataset, x, y = make_examples(12)
    model = make_classifier()
    metrics = Trainer(
        model=model, args=make_args(per_device_eval_batch_size=4), eval_dataset=dataset
    ).evaluate()
    assert metrics["eval_loss"] == pytest.approx(float(_per_example_losses(model, x, y).mean()), abs=1e-6)


def test_eval_loss_with_a_partial_last_batch_follows_hf(make_args, make_classifier, make_examples):
    """Regression: the last batch used to be completed with examples 0 and 1 even in one process."""
    dataset, x, y = make_examples(10)  # batches of 4, 4, 2
    model = make_classifier()
    per_example = _per_example_losses(model, x, y)
    # HF: each batch's mean loss repeated batch-size times, then the mean over the examples
    batch_means = (
        [per_example[0:4].mean()] * 4 + [per_example[4:8].mean()] * 4 + [per_example[8:10].mean()] * 2
    )
    expected = float(np.mean(batch_means))
    assert expected == pytest.approx(float(per_example.mean()), abs=1e-6)
    mean_of_batch_means = float(
        np.mean([per_example[0:4].mean(), per_example[4:8].mean(), per_example[8:10].mean()])
    )
    assert abs(expected - mean_of_batch_means) > 1e-3  # the data tells the two rules apart
    metrics = Trainer(
        model=model, args=make_args(per_device_eval_batch_size=4), eval_dataset=dataset
    ).evaluate()
    assert metrics["eval_loss"] == pytest.approx(expected, abs=1e-6)


# -- 7. predict ----------------------------------------------------------------------------------------------
class EchoIndex(nn.Module):
    """Returns twice the example index it is given: predictions tell where each example went."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(()))

    def forward(self, idx):
        return {"logits": 2.0 * idx.float().unsqueeze(-1)}


@pytest.mark.parametrize("n,batch_size", [(11, 4), (12, 4), (1, 3), (7, 1)])
def test_predict_keeps_length_and_order(make_args, n, batch_size):
    dataset = [{"idx": i} for i in range(n)]
    trainer = Trainer(model=EchoIndex(), args=make_args(per_device_eval_batch_size=batch_size))
    out = trainer.predict(dataset)
    assert len(out.predictions) == n
    np.testing.assert_array_equal(out.predictions[:, 0], 2.0 * np.arange(n))
    assert out.label_ids is None
    assert set(out.metrics) >= {"test_runtime", "test_samples_per_second", "test_steps_per_second"}


def test_predict_returns_labels_in_order_and_prefixed_metrics(make_args, make_classifier, make_examples):
    dataset, x, y = make_examples(11)
    model = make_classifier()

    def compute_metrics(eval_pred):
        predictions, label_ids = eval_pred  # unpacks like HF's EvalPrediction
        return {"accuracy": float((predictions.argmax(-1) == label_ids).mean())}

    recorder = EventRecorder()
    trainer = Trainer(
        model=model,
        args=make_args(per_device_eval_batch_size=4),
        compute_metrics=compute_metrics,
        callbacks=[recorder],
    )
    out = trainer.predict(dataset, metric_key_prefix="test")
    with torch.no_grad():
        logits = model.linear(x).numpy()
    np.testing.assert_array_equal(out.label_ids, y.numpy())
    assert np.allclose(out.predictions, logits, atol=1e-6)
    assert out.metrics["test_accuracy"] == pytest.approx(float((logits.argmax(-1) == y.numpy()).mean()))
    assert out.metrics["test_loss"] == pytest.approx(float(_per_example_losses(model, x, y).mean()), abs=1e-6)
    assert [e for e, _ in recorder.events] == ["on_init_end", *["on_prediction_step"] * 3, "on_predict"]


def test_predict_on_an_iterable_dataset_keeps_order(make_args):
    out = Trainer(model=EchoIndex(), args=make_args(per_device_eval_batch_size=4)).predict(
        Stream([{"idx": i} for i in range(10)])
    )
    np.testing.assert_array_equal(out.predictions[:, 0], 2.0 * np.arange(10))


def test_predict_on_an_iterable_dataset_with_loader_workers(make_args):
    args = make_args(per_device_eval_batch_size=4, dataloader_num_workers=1)
    out = Trainer(model=EchoIndex(), args=args).predict(Stream([{"idx": i} for i in range(10)]))
    assert out.predictions is not None
    np.testing.assert_array_equal(out.predictions[:, 0], 2.0 * np.arange(10))


class TokenScorer(nn.Module):
    """A per-token output whose length is the batch's sequence length: input id + 0.5 (pad 0 -> 0.5)."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids):
        return {"logits": input_ids.float() + 0.5}


def pad_to_longest(features):
    longest = max(len(f["input_ids"]) for f in features)
    ids = [f["input_ids"] + [0] * (longest - len(f["input_ids"])) for f in features]
    return {"input_ids": torch.tensor(ids)}


def _expected_token_predictions(sequences, batch_size):
    longest = max(len(s) for s in sequences)
    rows = []
    for start in range(0, len(sequences), batch_size):
        batch = sequences[start : start + batch_size]
        batch_longest = max(len(s) for s in batch)
        for s in batch:
            values = [v + 0.5 for v in s] + [0.5] * (batch_longest - len(s))
            rows.append(values + [-100.0] * (longest - batch_longest))
    return np.array(rows)


def _token_sequences(lengths):
    return [[(i + j) % 9 + 1 for j in range(length)] for i, length in enumerate(lengths)]


def test_predict_pads_variable_length_outputs_with_minus_100(make_args):
    sequences = _token_sequences([2, 3, 5, 1, 4, 2])  # batches of 2: longest 3, 5, 4
    trainer = Trainer(
        model=TokenScorer(), args=make_args(per_device_eval_batch_size=2), data_collator=pad_to_longest
    )
    out = trainer.predict([{"input_ids": s} for s in sequences])
    expected = _expected_token_predictions(sequences, 2)
    assert out.predictions.shape == (6, 5)
    np.testing.assert_array_equal(out.predictions, expected)
    assert (out.predictions[0, 3:] == -100).all() and (out.predictions[1, 3:] == -100).all()


def test_predict_variable_length_with_a_partial_last_batch(make_args):
    """Regression: completing the last batch with example 0 padded it to example 0's length."""
    sequences = _token_sequences([5, 2, 3, 1, 2])  # batches [0, 1], [2, 3], [4]; example 0 is the longest
    trainer = Trainer(
        model=TokenScorer(), args=make_args(per_device_eval_batch_size=2), data_collator=pad_to_longest
    )
    out = trainer.predict([{"input_ids": s} for s in sequences])
    np.testing.assert_array_equal(out.predictions, _expected_token_predictions(sequences, 2))


# -- 8. dataset kinds ----------------------------------------------------------------------------------------
class MapDataset(Dataset):
    def __init__(self, examples):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


class Stream(IterableDataset):
    def __init__(self, examples):
        self.examples = examples

    def __iter__(self):
        return iter(self.examples)


def _train_on(make_args, make_classifier, dataset, **overrides):
    model = make_classifier()
    kwargs = {"per_device_train_batch_size": 4, "num_train_epochs": 2, "optim": "sgd", "learning_rate": 0.5}
    kwargs.update(overrides)
    trainer = RecordingTrainer(model=model, args=make_args(**kwargs), train_dataset=dataset)
    trainer.train()
    return model.state_dict(), trainer


def test_list_map_style_and_hugging_face_datasets_train_identically(
    make_args, make_classifier, make_examples, weights
):
    examples, x, y = make_examples(12)
    reference, trainer = _train_on(make_args, make_classifier, examples)
    assert len(trainer.seen) == 6
    assert not torch.allclose(reference["linear.weight"], make_classifier().state_dict()["linear.weight"])

    from_map, _ = _train_on(make_args, make_classifier, MapDataset(examples))
    weights.assert_same(reference, from_map)

    import datasets

    columns = {"x": x.tolist(), "text": [f"example {i}" for i in range(12)], "labels": [int(v) for v in y],
               "idx": list(range(12))}
    from_hf, trainer = _train_on(make_args, make_classifier, datasets.Dataset.from_dict(columns))
    assert trainer.columns == {"x", "labels"}  # the columns the model's forward() does not take are removed
    weights.assert_same(reference, from_hf)


def test_iterable_dataset_trains_for_max_steps_cycling_the_stream(make_args, make_classifier, make_examples):
    examples, _, _ = make_examples(10)
    _, trainer = _train_on(make_args, make_classifier, Stream(examples), max_steps=5)
    assert trainer.state.global_step == 5
    # one pass is 3 batches, the last one short in transformers' loop, then the stream starts again
    assert trainer.seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3], [4, 5, 6, 7]]


def test_iterable_dataset_without_max_steps_fails_before_training(
    make_args, make_classifier, make_examples, weights
):
    examples, _, _ = make_examples(10)
    model = make_classifier()
    before = weights.copy(model)
    recorder = EventRecorder()
    # at construction, as transformers' Trainer refuses it, or at train() before the loop starts
    with pytest.raises(ValueError, match=r"(no length|does not implement __len__).*max_steps"):
        Trainer(model=model, args=make_args(per_device_train_batch_size=4), train_dataset=Stream(examples),
                callbacks=[recorder]).train()
    assert recorder.names("on_train_begin") == []
    weights.assert_same(before, weights.copy(model))


def test_remove_unused_columns_drops_extra_string_and_tensor_columns(
    make_args, make_classifier, make_examples, weights
):
    examples, _, _ = make_examples(12)
    reference, _ = _train_on(make_args, make_classifier, examples)
    extra = [
        {**e, "text": f"example {i}", "meta": torch.full((3,), float(i))} for i, e in enumerate(examples)
    ]
    trained, _ = _train_on(make_args, make_classifier, extra)
    weights.assert_same(reference, trained)

    model = make_classifier()
    before = weights.copy(model)
    trainer = Trainer(
        model=model,
        args=make_args(per_device_train_batch_size=4, remove_unused_columns=False),
        train_dataset=extra,
    )
    with pytest.raises(ValueError, match="meta"):
        trainer.train()
    weights.assert_same(before, weights.copy(model))


# -- 9. bad input fails before training ----------------------------------------------------------------------
class LogitsOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, labels=None):
        return self.linear(x)


def test_model_that_returns_no_loss_fails_before_training(make_args, make_examples, weights):
    examples, _, _ = make_examples(8)
    model = LogitsOnly()
    before = weights.copy(model)
    recorder = EventRecorder()
    trainer = Trainer(
        model=model,
        args=make_args(per_device_train_batch_size=4),
        train_dataset=examples,
        callbacks=[recorder],
    )
    with pytest.raises(ValueError, match=r"LogitsOnly returned no loss \(it returned Tensor\)"):
        trainer.train()
    assert recorder.names("on_train_begin") == []
    weights.assert_same(before, weights.copy(model))


def test_dataset_without_the_label_column_fails_before_training(
    make_args, make_classifier, make_examples, weights
):
    _, x, _ = make_examples(8)
    model = make_classifier()
    before = weights.copy(model)
    trainer = Trainer(
        model=model, args=make_args(per_device_train_batch_size=4), train_dataset=[{"x": row} for row in x]
    )
    with pytest.raises(ValueError, match=r"train_dataset\[0\] has no 'labels' column \(its keys: \['x'\]\)"):
        trainer.train()
    weights.assert_same(before, weights.copy(model))


def test_eval_strategy_without_eval_dataset_fails_at_construction(make_args, make_classifier, make_examples):
    examples, _, _ = make_examples(8)
    args = make_args(eval_strategy="epoch")
    with pytest.raises(ValueError, match=r"eval_strategy.* (needs|didn't pass) an `?eval_dataset"):
        Trainer(model=make_classifier(), args=args, train_dataset=examples)


def test_zero_batch_size_fails_in_training_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"per_device_train_batch_size=0: must be a positive integer"):
        TrainingArguments(output_dir=str(tmp_path), num_workers=0, per_device_train_batch_size=0)


def test_load_best_model_at_end_needs_matching_strategies(tmp_path):
    with pytest.raises(ValueError, match=r"eval_strategy='epoch' and save_strategy='steps'"):
        TrainingArguments(
            output_dir=str(tmp_path),
            num_workers=0,
            load_best_model_at_end=True,
            eval_strategy="epoch",
            save_strategy="steps",
        )


# -- 10. log routing in this process -------------------------------------------------------------------------
class LoggingTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        user_logger = logging.getLogger("unit_tests.user_code")
        user_logger.info("INFO-FROM-COMPUTE-LOSS step=%d", self.state.global_step)
        user_logger.warning("WARNING-FROM-COMPUTE-LOSS step=%d", self.state.global_step)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def test_log_level_applies_in_process_and_is_restored(
    make_args, make_classifier, make_examples, tmp_path, caplog
):
    """num_workers=0: the run's log_level holds the application's INFO back, its records reach the
    application's own handlers (no rank file in output_dir, as transformers), and the levels and handlers
    are as they were afterwards. (Rank files on Ray workers: tests/integration/test_ddp.py.)"""
    examples, _, _ = make_examples(8)
    root, library = logging.getLogger(), logging.getLogger("raytrainer")
    old_root_level = root.level
    root.setLevel(logging.DEBUG)  # so that only the run's log_level can hold INFO back
    try:
        before = [(lg.level, list(lg.handlers)) for lg in (root, library)]
        args = make_args(per_device_train_batch_size=4, num_train_epochs=1, log_level="warning")
        LoggingTrainer(model=make_classifier(), args=args, train_dataset=examples).train()
        after = [(lg.level, list(lg.handlers)) for lg in (root, library)]
    finally:
        root.setLevel(old_root_level)
    assert after == before
    assert not (tmp_path / "logs").exists()
    user = [r.getMessage() for r in caplog.records if r.name == "unit_tests.user_code"]
    assert user == ["WARNING-FROM-COMPUTE-LOSS step=0", "WARNING-FROM-COMPUTE-LOSS step=1"]


def test_log_level_info_lets_info_through_with_transformers_lines(make_args, make_classifier, make_examples,
                                                                  caplog):
    """log_level="info" lets the application's INFO through and transformers.Trainer's own lines, on
    transformers' logger (which does not propagate: captured by a handler of its own)."""
    import transformers.utils.logging as hf_logging

    examples, _, _ = make_examples(4)
    hf_root = hf_logging.get_logger("transformers")
    before = hf_root.level
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    hf_root.addHandler(handler)
    try:
        args = make_args(per_device_train_batch_size=4, num_train_epochs=1, log_level="info",
                         save_strategy="epoch")
        LoggingTrainer(model=make_classifier(), args=args, train_dataset=examples).train()
        args = make_args(per_device_train_batch_size=4, num_train_epochs=1, log_level="error")
        LoggingTrainer(model=make_classifier(), args=args, train_dataset=examples).train()
    finally:
        hf_root.removeHandler(handler)
    assert hf_root.level == before
    user = [r.getMessage() for r in caplog.records if r.name == "unit_tests.user_code"]
    assert "INFO-FROM-COMPUTE-LOSS step=0" in user
    assert seen.count("***** Running training *****") == 1  # the "error" run printed none
    assert "  Num examples = 4" in seen and "  Total optimization steps = 1" in seen
    assert any(m.startswith("Saving model checkpoint to ") for m in seen)


# -- 11. speed, flos and memory metrics ----------------------------------------------------------------------
def test_train_metrics_speed_flos_and_loss(make_args, make_classifier, make_examples):
    examples, _, _ = make_examples(20)
    model = make_classifier()
    # transformers counts 6 x the main input's elements x the parameters a model says it has (4*3 + 3 = 15);
    # a module without num_parameters counts 0. (raytrainer's own loop asks floating_point_ops.)
    model.main_input_name, model.num_parameters = "x", lambda exclude_embeddings=True: 15
    model.floating_point_ops = lambda inputs: 6 * inputs["x"].numel() * 15
    args = make_args(per_device_train_batch_size=8, num_train_epochs=2)  # batches 8, 8, 4 per epoch
    trainer = RecordingTrainer(model=model, args=args, train_dataset=examples)
    out = trainer.train()
    m = out.metrics
    # and total_flos, which transformers' PrinterCallback (disable_tqdm=True) pops from the same dict
    assert {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss"} <= set(m)
    assert not any("_mem_" in k for k in m)  # skip_memory_metrics defaults to True
    assert out.global_step == 6
    assert trainer.state.total_flos == 6 * 40 * 4 * 15 and isinstance(trainer.state.total_flos, float)
    assert m["train_loss"] == pytest.approx(np.mean(trainer.step_losses), abs=1e-6)
    assert out.training_loss == m["train_loss"]
    runtime = m["train_runtime"]
    assert runtime > 0
    assert m["train_steps_per_second"] == pytest.approx(6 / runtime, rel=0.05, abs=0.01)
    assert m["train_samples_per_second"] == pytest.approx(40 / runtime, rel=0.05, abs=0.01)
    assert trainer.state.log_history[-1]["train_loss"] == m["train_loss"]


def test_train_memory_metrics(make_args, make_classifier, make_examples):
    examples, _, _ = make_examples(8)
    args = make_args(per_device_train_batch_size=4, num_train_epochs=1, skip_memory_metrics=False)
    m = Trainer(model=make_classifier(), args=args, train_dataset=examples).train().metrics
    for key in ("train_mem_cpu_alloc_delta", "train_mem_cpu_peaked_delta"):
        assert key in m
        assert isinstance(m[key], int) and not isinstance(m[key], bool)
    assert m["train_mem_cpu_peaked_delta"] >= 0


# -- 12. label smoothing -------------------------------------------------------------------------------------
def test_label_smoothing_matches_torch_cross_entropy(make_args, make_classifier, make_examples):
    _, x, _ = make_examples(16)
    model = make_classifier()
    with torch.no_grad():
        logits = model.linear(x)
    y = logits.argmax(-1)  # the model is right everywhere: smoothing must raise the loss
    batch = {"x": x, "labels": y}
    eps = 0.2
    plain = Trainer(model=model, args=make_args()).compute_loss(model, dict(batch))
    smooth = Trainer(model=model, args=make_args(label_smoothing_factor=eps)).compute_loss(model, dict(batch))
    expected_plain = nn.functional.cross_entropy(logits, y)
    expected_smooth = nn.functional.cross_entropy(logits, y, label_smoothing=eps)
    assert torch.allclose(plain, expected_plain, atol=1e-6)
    assert torch.allclose(smooth, expected_smooth, atol=1e-6)
    assert smooth.item() > plain.item() + 1e-3


def test_label_smoothing_ignores_minus_100_labels(make_args, make_classifier, make_examples):
    _, x, y = make_examples(8)
    model = make_classifier()
    y = y.clone()
    y[[1, 5]] = -100
    smooth = Trainer(model=model, args=make_args(label_smoothing_factor=0.1)).compute_loss(
        model, {"x": x, "labels": y}
    )
    with torch.no_grad():
        expected = nn.functional.cross_entropy(model.linear(x), y, label_smoothing=0.1, ignore_index=-100)
    assert torch.allclose(smooth, expected, atol=1e-6)


def test_label_smoothing_is_used_in_training_and_evaluation(make_args, make_classifier, make_examples):
    examples, x, y = make_examples(8)
    model = make_classifier()
    args = make_args(per_device_eval_batch_size=8, label_smoothing_factor=0.3)
    metrics = Trainer(model=model, args=args, eval_dataset=examples).evaluate()
    with torch.no_grad():
        expected = nn.functional.cross_entropy(model.linear(x), y, label_smoothing=0.3)
    assert metrics["eval_loss"] == pytest.approx(expected.item(), abs=1e-6)


def test_what_the_ranks_build_a_model_init_trainer_from_holds_no_weights(make_args, make_examples):
    """With model_init the ranks build the model (hosted_recipe.py): the recipe the driver puts into Ray's
    object store holds model_init, not weights."""

    def big():  # 1M parameters: 4 MB of float32 weights
        return nn.Sequential(nn.Linear(4, 1000), nn.Linear(1000, 996), nn.Linear(996, 3))

    data, _, _ = make_examples(16)
    trainer = Trainer(model_init=big, args=make_args(num_workers=2), train_dataset=data)
    assert len(trainer._recipe.payload) < 200_000


def test_trainable_parameters_and_learning_rates(make_args, make_examples):
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    trainer = Trainer(model=model, args=make_args(), train_dataset=make_examples(8)[0])
    assert trainer.get_num_trainable_parameters() == (4 * 8 + 8) + (8 * 3 + 3)
    for p in model[-1].parameters():
        p.requires_grad = False
    assert trainer.get_num_trainable_parameters() == 4 * 8 + 8
    with pytest.raises(ValueError, match="optimizer is None"):
        trainer.get_learning_rates()
    trainer.create_optimizer()
    assert trainer.get_learning_rates() == [trainer.args.learning_rate] * len(trainer.optimizer.param_groups)


def test_dataloaders_outside_a_run_see_the_whole_dataset(make_args, make_classifier, make_examples):
    """A user's own get_train_dataloader() / get_eval_dataloader() before train(): the view of a one-process
    run (every example once per epoch), as transformers.Trainer gives in a single process."""
    dataset, _, _ = make_examples(10)
    # with workers a Ray group answers: tests/integration/test_one_loop_on_workers.py
    args = make_args(per_device_train_batch_size=4, num_workers=0, per_device_eval_batch_size=3)
    trainer = Trainer(model=make_classifier(), args=args,
                      train_dataset=dataset, eval_dataset=dataset)
    train = list(trainer.get_train_dataloader())
    assert [len(b["labels"]) for b in train] == [4, 4, 2]
    assert sorted(torch.cat([b["x"] for b in train]).sum(dim=1).tolist()) == \
        sorted(torch.stack([e["x"] for e in dataset]).sum(dim=1).tolist())
    evaluation = list(trainer.get_eval_dataloader())
    assert torch.equal(torch.cat([b["x"] for b in evaluation]), torch.stack([e["x"] for e in dataset]))
    assert trainer._train_batch_size == 4


class AcceleratorStepTrainer(Trainer):
    """A training_step written against transformers.Trainer's accelerator, as many subclasses are."""

    seen: list = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.accelerator.autocast():
            loss = self.compute_loss(model, inputs)
        self.accelerator.backward(loss)
        gathered = self.accelerator.gather_for_metrics(loss.detach())
        self.seen.append((self.accelerator.is_main_process, self.accelerator.num_processes,
                          self.accelerator.unwrap_model(model) is self.model, float(gathered)))
        return loss.detach()


def test_a_subclass_using_trainer_accelerator_trains_as_the_base_trainer(make_args, make_classifier,
                                                                         make_examples):
    dataset, _, _ = make_examples(16)
    base = Trainer(model=make_classifier(), args=make_args(max_steps=4, per_device_train_batch_size=4,
                                                           data_seed=0), train_dataset=dataset)
    base.train()
    AcceleratorStepTrainer.seen = []
    sub = AcceleratorStepTrainer(model=make_classifier(), args=make_args(max_steps=4, data_seed=0,
                                                                        per_device_train_batch_size=4),
                                 train_dataset=dataset)
    sub.train()
    for name, tensor in base.model.state_dict().items():
        assert torch.equal(sub.model.state_dict()[name], tensor), name
    assert [s[:3] for s in AcceleratorStepTrainer.seen] == [(True, 1, True)] * 4
    assert sub.accelerator.prepare(sub.model) is sub.model and sub.accelerator.mixed_precision == "no"
    assert sub.accelerator.unwrap_model(nn.DataParallel(sub.model)) is sub.model


class BatchedAccuracy:
    """transformers' batch_eval_metrics protocol: called per batch, the result on compute_result=True."""

    def __init__(self):
        self.calls, self.correct, self.seen = [], 0, 0

    def __call__(self, eval_pred, compute_result):
        preds, labels = eval_pred.predictions, eval_pred.label_ids
        assert isinstance(preds, torch.Tensor)  # tensors, as transformers passes them per batch
        self.calls.append((len(labels), compute_result))
        self.correct += int((preds.argmax(-1) == labels).sum())
        self.seen += len(labels)
        if compute_result:
            out = {"accuracy": self.correct / self.seen}
            self.correct = self.seen = 0
            return out
        return None


def test_batch_eval_metrics_streams_per_batch_and_matches_whole_set(make_args, make_classifier,
                                                                    make_examples):
    dataset, _, _ = make_examples(10)

    def accuracy(eval_pred):
        return {"accuracy": float((eval_pred.predictions.argmax(-1) == eval_pred.label_ids).mean())}

    whole = Trainer(model=make_classifier(), args=make_args(per_device_eval_batch_size=3),
                    eval_dataset=dataset, compute_metrics=accuracy).evaluate()
    batched = BatchedAccuracy()
    args = make_args(per_device_eval_batch_size=3, batch_eval_metrics=True)
    trainer = Trainer(model=make_classifier(), args=args, eval_dataset=dataset, compute_metrics=batched)
    metrics = trainer.evaluate()
    assert batched.calls == [(3, False), (3, False), (3, False), (1, True)]
    assert metrics["eval_accuracy"] == pytest.approx(whole["eval_accuracy"])
    assert metrics["eval_loss"] == pytest.approx(whole["eval_loss"])
    out = trainer.predict(dataset)  # prediction keeps its predictions
    assert out.predictions.shape == (10, 3) and out.metrics["test_accuracy"] == pytest.approx(
        whole["eval_accuracy"])


def test_memory_metrics_for_init_train_eval_and_predict_as_transformers(make_args, make_classifier,
                                                                       make_examples):
    dataset, _, _ = make_examples(8)
    trainer = Trainer(model=make_classifier(), args=make_args(skip_memory_metrics=False, max_steps=2),
                      train_dataset=dataset, eval_dataset=dataset)
    first = trainer.train().metrics
    assert isinstance(first["init_mem_cpu_alloc_delta"], int) and first["init_mem_cpu_peaked_delta"] >= 0
    assert isinstance(first["train_mem_cpu_alloc_delta"], int)
    assert "init_mem_cpu_alloc_delta" not in trainer.train().metrics  # reported once
    assert isinstance(trainer.evaluate()["eval_mem_cpu_alloc_delta"], int)
    assert isinstance(trainer.predict(dataset).metrics["test_mem_cpu_alloc_delta"], int)
    quiet = Trainer(model=make_classifier(), args=make_args(max_steps=2), train_dataset=dataset,
                    eval_dataset=dataset)
    assert not [k for k in [*quiet.train().metrics, *quiet.evaluate()] if "_mem_" in k]


def test_label_smoother_attribute_and_multi_label_warning(make_args, make_classifier):
    import warnings

    trainer = Trainer(model=make_classifier(), args=make_args(label_smoothing_factor=0.1))
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 0.3]])
    labels = torch.tensor([0, 2])
    log_probs = torch.log_softmax(logits, dim=-1)
    expected = 0.9 * torch.nn.functional.nll_loss(log_probs, labels) + 0.1 * (-log_probs.mean())
    smoothed = trainer.label_smoother({"logits": logits}, labels)
    assert smoothed.item() == pytest.approx(expected.item(), rel=1e-6)
    assert Trainer(model=make_classifier(), args=make_args()).label_smoother is None

    model = make_classifier()
    model.config = type("Config", (), {"problem_type": "multi_label_classification"})()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        multi = Trainer(model=model, args=make_args(label_smoothing_factor=0.1))
    assert [str(w.message) for w in caught if "Label smoothing" in str(w.message)] == [
        "Label smoothing is not compatible with multi-label classification. Disabling label smoothing for "
        "this training run."]
    assert multi.label_smoother is None


class OwnLoaderTrainer(Trainer):
    """get_eval_dataloader returning a plain iterable of batches (no sampler, no dataset attribute)."""

    def get_eval_dataloader(self, eval_dataset=None):
        batches = torch.utils.data.DataLoader(self.eval_dataset, batch_size=4)
        return type("Batches", (), {"__iter__": lambda s: iter(batches), "__len__": lambda s: len(batches)})()


def test_evaluate_over_a_user_loader_without_sampler(tmp_path, make_args, make_classifier, make_examples):
    dataset, _, _ = make_examples(10)
    metrics = OwnLoaderTrainer(model=make_classifier(), args=make_args(), eval_dataset=dataset).evaluate()
    # as transformers' Trainer does (each batch's loss counted eval_batch_size times)
    theirs = type("Theirs", (transformers.Trainer,),
                  {"get_eval_dataloader": OwnLoaderTrainer.get_eval_dataloader})
    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none")
    reference = theirs(model=make_classifier(), args=hf_args, eval_dataset=dataset).evaluate()
    assert metrics["eval_loss"] == pytest.approx(reference["eval_loss"])


def test_eval_dataloader_by_name_and_reused_with_persistent_workers(make_args, make_classifier,
                                                                    make_examples):
    first, _, _ = make_examples(6)
    second, _, _ = make_examples(4, seed=3)
    evals = {"first": first, "second": second}
    trainer = Trainer(model=make_classifier(), args=make_args(), eval_dataset=evals)
    assert trainer.get_eval_dataloader("first").dataset is first
    assert trainer.get_eval_dataloader("first") is not trainer.get_eval_dataloader("first")
    metrics = trainer.evaluate()
    assert {"eval_first_loss", "eval_second_loss"} <= set(metrics)
    persistent = Trainer(model=make_classifier(), eval_dataset=evals, args=make_args(
        dataloader_persistent_workers=True, dataloader_num_workers=1))
    loader = persistent.get_eval_dataloader("second")
    assert loader is persistent.get_eval_dataloader("second") and loader.dataset is second
    assert persistent.get_eval_dataloader("first") is not loader
    assert persistent.evaluate()["eval_second_loss"] == pytest.approx(metrics["eval_second_loss"])


class BatchOfOne(nn.Module):
    """A model that takes exactly one example per batch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 3)

    def forward(self, x, labels=None):
        assert x.shape[0] == 1, f"batch of {x.shape[0]}"
        logits = self.linear(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_the_driver_check_runs_no_bigger_batch_than_training(make_args, make_examples):
    dataset, _, _ = make_examples(4)
    out = Trainer(model=BatchOfOne(), args=make_args(per_device_train_batch_size=1, max_steps=2),
                  train_dataset=dataset).train()
    assert out.global_step == 2
