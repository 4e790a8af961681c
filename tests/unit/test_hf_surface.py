"""What a transformers.Trainer script or tool reads off the Trainer besides the training itself: the loaders'
``total_batch_size``, ``dataloader_drop_last`` in evaluation, ``training_args.bin``, transformers' warnings on
transformers' loggers (a second callback of one class, arguments that differ from a resumed checkpoint's),
and the ``_evaluate`` hook a subclass may override."""

from __future__ import annotations

import logging

import pytest
import torch

from raytrainer import Trainer, TrainerCallback


@pytest.fixture
def hf_records():
    """Messages logged on transformers' loggers (its library root does not propagate: a handler of its
    own), with the levels they were logged at."""
    import transformers.utils.logging as hf_logging

    root = hf_logging.get_logger("transformers")
    seen: list[tuple[int, str]] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append((record.levelno, record.getMessage()))
    root.addHandler(handler)
    yield seen
    root.removeHandler(handler)


def test_loaders_report_the_total_batch_size(make_args, make_classifier, make_examples):
    data, _, _ = make_examples(10)
    trainer = Trainer(model=make_classifier(), train_dataset=data, eval_dataset=data,
                      args=make_args(per_device_train_batch_size=3, per_device_eval_batch_size=5))
    assert trainer.get_train_dataloader().total_batch_size == 3
    assert trainer.get_eval_dataloader().total_batch_size == 5


def test_dataloader_drop_last_also_drops_evaluation_s_incomplete_batch(make_args, make_classifier,
                                                                        make_examples):
    data, _, y = make_examples(10)
    args = make_args(per_device_eval_batch_size=4, dataloader_drop_last=True)
    out = Trainer(model=make_classifier(), args=args).predict(data)
    assert len(Trainer(model=make_classifier(), args=args).get_eval_dataloader(data)) == 2
    assert out.predictions.shape == (8, 3)
    assert out.label_ids.tolist() == y[:8].tolist()  # the first 8, in order
    kept = Trainer(model=make_classifier(), args=make_args(per_device_eval_batch_size=4)).predict(data[:8])
    assert out.metrics["test_loss"] == pytest.approx(kept.metrics["test_loss"])


def test_checkpoints_hold_transformers_training_args_bin_without_secrets(make_args, make_classifier,
                                                                         make_examples, tmp_path):
    data, _, _ = make_examples(8)
    args = make_args(max_steps=2, save_steps=2, save_strategy="steps", learning_rate=0.25,
                     hub_token="hf_secret_token_123")
    Trainer(model=make_classifier(), args=args, train_dataset=data).train()
    path = tmp_path / "checkpoint-2" / "training_args.bin"
    assert b"hf_secret_token_123" not in path.read_bytes()
    loaded = torch.load(path, weights_only=False)  # what transformers' tools do
    assert loaded.learning_rate == 0.25 and loaded.max_steps == 2 and loaded.hub_token is None
    assert args.hub_token == "hf_secret_token_123"  # the run's own arguments are untouched


def test_arguments_of_a_class_pickle_cannot_name_are_saved_as_their_base_class(tmp_path, make_examples,
                                                                                make_classifier):
    """An arguments subclass made inside a function (pickle cannot find it by name) does not fail every
    checkpoint: training_args.bin holds the values as the nearest class pickle can name."""
    import dataclasses

    from raytrainer import TrainingArguments

    @dataclasses.dataclass
    class LocalArguments(TrainingArguments):
        note: str = "mine"

    data, _, _ = make_examples(8)
    args = LocalArguments(output_dir=str(tmp_path), num_workers=0, max_steps=2, save_steps=2,
                          learning_rate=0.25, report_to="none", disable_tqdm=True)
    Trainer(model=make_classifier(), args=args, train_dataset=data).train()
    loaded = torch.load(tmp_path / "checkpoint-2" / "training_args.bin", weights_only=False)
    assert type(loaded) is TrainingArguments and loaded.learning_rate == 0.25 and loaded.note == "mine"
    assert type(args) is LocalArguments


class _Noop(TrainerCallback):
    pass


def test_a_second_callback_of_one_class_warns_on_transformers_logger(make_args, make_classifier, hf_records):
    Trainer(model=make_classifier(), args=make_args(), callbacks=[_Noop, _Noop()])
    warnings = [m for level, m in hf_records if level == logging.WARNING]
    assert len(warnings) == 1 and "_Noop" in warnings[0] and "there is already one" in warnings[0]


def test_resuming_with_other_steps_or_batch_size_warns_as_transformers(make_args, make_classifier,
                                                                       make_examples, tmp_path, hf_records):
    data, _, _ = make_examples(16)
    first = make_args(max_steps=4, save_steps=2, save_strategy="steps", per_device_train_batch_size=4)
    Trainer(model=make_classifier(), args=first, train_dataset=data).train()
    again = make_args(max_steps=6, save_steps=3, save_strategy="steps", per_device_train_batch_size=2)
    resumed = Trainer(model=make_classifier(), args=again, train_dataset=data)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    (warning,) = [m for level, m in hf_records if level == logging.WARNING and "do not match" in m]
    assert "save_steps: 3 (from args) != 2 (from trainer_state.json)" in warning
    assert "per_device_train_batch_size: 2 (from args) != 4 (from trainer_state.json)" in warning
    assert "logging_steps" not in warning  # the same in both runs
    assert resumed.state.global_step == 6


class _ScriptedEvaluation(Trainer):
    """A subclass deciding the metrics of each evaluation during training (transformers' ``_evaluate``)."""

    scripted = [{"eval_loss": 0.3}, {"eval_loss": 0.1}, {"eval_loss": 0.2}]

    def _evaluate(self, trial, ignore_keys_for_eval, skip_scheduler=False):
        return dict(self.scripted[self.state.global_step // 2 - 1])


def test_the_evaluate_hook_drives_best_model_saves(make_args, make_classifier, make_examples, tmp_path):
    data, _, _ = make_examples(12)
    args = make_args(max_steps=6, per_device_train_batch_size=2, eval_strategy="steps", eval_steps=2,
                     save_strategy="best", metric_for_best_model="loss")
    trainer = _ScriptedEvaluation(model=make_classifier(), args=args, train_dataset=data, eval_dataset=data)
    trainer.train()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4"]  # 0.3, then 0.1
    assert trainer.state.best_metric == 0.1 and trainer.state.best_global_step == 4


def test_memory_running_out_while_training_retries_with_a_smaller_batch(make_args, make_classifier,
                                                                       make_examples, tmp_path):
    """auto_find_batch_size in one process: memory running out in a training step restarts training with
    0.9x the batch (16 -> 14), as transformers; the arguments keep the size asked, _train_batch_size and
    the state hold the one trained with, and a resume takes the checkpoint's size."""

    class OutOfMemoryAtSixteen(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.train_batch_size >= 16:
                raise RuntimeError("CUDA out of memory.")

    data, _, _ = make_examples(128)
    args = make_args(output_dir=str(tmp_path), per_device_train_batch_size=16, auto_find_batch_size=True,
                     max_steps=2, save_strategy="steps", save_steps=1)
    first = Trainer(model=make_classifier(), args=args, train_dataset=data,
                    callbacks=[OutOfMemoryAtSixteen()])
    first.train()
    assert first._train_batch_size == first.state.train_batch_size == 14 and first.state.global_step == 2
    assert args.per_device_train_batch_size == 16
    again = Trainer(model=make_classifier(), args=args, train_dataset=data)
    assert again._train_batch_size == 16
    again.train(resume_from_checkpoint=True)
    assert again._train_batch_size == 14


def test_results_are_transformers_own_types(make_args, make_classifier, make_examples):
    """compute_metrics gets a transformers.EvalPrediction and train/predict return transformers' named tuples:
    code that checks types against transformers (a metrics helper, a library's callback) takes them."""
    import transformers
    from transformers.trainer_utils import PredictionOutput, TrainOutput

    train, _, _ = make_examples(8)
    received = []

    def compute_metrics(prediction):
        received.append(prediction)
        return {"n": len(prediction.predictions)}

    trainer = Trainer(model=make_classifier(), args=make_args(max_steps=2, per_device_train_batch_size=4),
                      train_dataset=train, eval_dataset=train, compute_metrics=compute_metrics)
    assert isinstance(trainer.train(), TrainOutput)
    assert trainer.evaluate()["eval_n"] == 8
    assert isinstance(received[0], transformers.EvalPrediction)
    output = trainer.predict(train)
    assert isinstance(output, PredictionOutput) and output.metrics["test_n"] == 8
