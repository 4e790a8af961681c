"""Seq2SeqTrainer in one process against transformers.Seq2SeqTrainer on one tiny T5 (built from a config):
the same generated ids, labels, loss and metrics from evaluate() and predict(), with and without generation
arguments; the arguments' fields, defaults and generation_config handling."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import transformers

from raytrainer import Seq2SeqTrainer, Seq2SeqTrainingArguments
from raytrainer.seq2seq import _settled_generation_config

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
from models import reversal_pairs, tiny_t5, token_accuracy


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Weights trained by raytrainer's Seq2SeqTrainer on the task (an untrained T5 generates only pad ids):
    both trainers below start from them, so their generations are compared on varied sequences."""
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path_factory.mktemp("train")), num_workers=0,
                                    max_steps=150, learning_rate=3e-3, per_device_train_batch_size=8,
                                    save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
    trainer = Seq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=reversal_pairs(96, seed=7))
    result = trainer.train()
    assert result.training_loss < 2.5  # it learned something of the task
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def both(tmp_path, state, **kw):
    common = {"per_device_eval_batch_size": 4, "report_to": "none", "disable_tqdm": True,
              "predict_with_generate": True, **kw}
    ours = Seq2SeqTrainer(model=tiny_t5(state), args=Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "ours"), num_workers=0, **common), compute_metrics=token_accuracy)
    theirs = transformers.Seq2SeqTrainer(model=tiny_t5(state), args=transformers.Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "theirs"), use_cpu=True, **common), compute_metrics=token_accuracy)
    # transformers fills the generation config's unset defaults after its first batch (that batch alone may
    # run to max_length 21); raytrainer's own loop fills them before the first, on every rank: compare with
    # transformers' every later batch by filling them the same way first (on transformers' loop, for both)
    for trainer in (theirs, ours) if issubclass(Seq2SeqTrainer, transformers.Trainer) else (theirs,):
        _settled_generation_config(trainer.model)
    return ours, theirs


@pytest.mark.parametrize("gen_kwargs", [{}, {"max_length": 5}, {"num_beams": 2, "max_new_tokens": 4}])
def test_predict_with_generate_matches_transformers(tmp_path, trained, gen_kwargs):
    ours, theirs = both(tmp_path, trained)
    data = reversal_pairs(12)
    mine, ref = ours.predict(data, **gen_kwargs), theirs.predict(data, **gen_kwargs)
    assert mine.predictions.shape == ref.predictions.shape
    assert len(np.unique(mine.predictions)) > 5  # varied ids, not a column of pads
    np.testing.assert_array_equal(mine.predictions, ref.predictions)
    np.testing.assert_array_equal(mine.label_ids, ref.label_ids)
    assert mine.metrics["test_loss"] == pytest.approx(ref.metrics["test_loss"], rel=1e-6)
    assert mine.metrics["test_token_accuracy"] == ref.metrics["test_token_accuracy"]
    if "max_length" in gen_kwargs:  # generation stopped at 5 tokens; the rest is the pad token
        assert (mine.predictions[:, 5:] == 0).all()


def test_generation_arguments_from_the_training_arguments(tmp_path, trained):
    ours, theirs = both(tmp_path, trained, generation_max_length=4, generation_num_beams=2)
    data = reversal_pairs(8)
    mine, ref = ours.evaluate(data), theirs.evaluate(data)
    assert mine["eval_token_accuracy"] == ref["eval_token_accuracy"]
    assert mine["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-6)
    pred = ours.predict(data)
    assert (pred.predictions[:, 4:] == 0).all() and (pred.predictions[:, 1:4] != 0).any()


def test_without_predict_with_generate_it_is_the_plain_trainer(tmp_path, trained):
    ours, theirs = both(tmp_path, trained, predict_with_generate=False)
    data = reversal_pairs(8)
    mine = ours.predict(data)
    ref = theirs.predict(data)
    assert mine.predictions[0].shape == ref.predictions[0].shape  # logits, not ids
    np.testing.assert_allclose(mine.predictions[0], ref.predictions[0], rtol=1e-5, atol=1e-6)


def test_arguments_match_transformers_and_generation_config_is_loaded(tmp_path):
    from transformers import GenerationConfig

    ours = Seq2SeqTrainingArguments(output_dir=str(tmp_path))
    theirs = transformers.Seq2SeqTrainingArguments(output_dir=str(tmp_path))
    for name in ("sortish_sampler", "predict_with_generate", "generation_max_length", "generation_num_beams",
                 "generation_config"):
        assert getattr(ours, name) == getattr(theirs, name), name
    GenerationConfig(max_length=7, num_beams=3, decoder_start_token_id=0).save_pretrained(tmp_path / "gen")
    trainer = Seq2SeqTrainer(model=tiny_t5(), args=Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "o"), generation_config=str(tmp_path / "gen"), report_to="none"))
    assert trainer.model.generation_config.max_length == 7 and trainer.model.generation_config.num_beams == 3
    as_object = Seq2SeqTrainingArguments(output_dir=str(tmp_path), generation_config=GenerationConfig(
        max_length=9))
    assert as_object.to_dict()["generation_config"]["max_length"] == 9
    with pytest.raises(ValueError, match=r"generation_num_beams=0: must be a positive integer"):
        Seq2SeqTrainingArguments(output_dir=str(tmp_path), generation_num_beams=0)
    converted = Seq2SeqTrainer(model=tiny_t5(), args=transformers.Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "c"), predict_with_generate=True, generation_max_length=11,
        report_to="none"))
    assert isinstance(converted.args, Seq2SeqTrainingArguments)
    assert converted.args.predict_with_generate and converted.args.generation_max_length == 11


def test_training_with_generated_metrics_keeps_the_best_and_saves_the_generation_config(tmp_path, trained):
    """Evaluations during training generate (predict_with_generate); load_best_model_at_end picks the best
    checkpoint by the generated metric; every checkpoint carries the generation config it generated with."""
    import json

    from transformers import GenerationConfig

    from raytrainer.checkpoint import CheckpointReader

    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), num_workers=0, max_steps=6, learning_rate=3e-3,
        per_device_train_batch_size=8, per_device_eval_batch_size=8, eval_strategy="steps", eval_steps=2,
        save_strategy="steps", save_steps=2, predict_with_generate=True,
        generation_config=GenerationConfig(max_length=9, decoder_start_token_id=0, pad_token_id=0,
                                           eos_token_id=1),
        load_best_model_at_end=True, metric_for_best_model="token_accuracy", report_to="none",
        disable_tqdm=True)
    trainer = Seq2SeqTrainer(model=tiny_t5(trained), args=args, train_dataset=reversal_pairs(48, seed=11),
                             eval_dataset=reversal_pairs(16, seed=12), compute_metrics=token_accuracy)
    trainer.train()
    scores = {h["step"]: h["eval_token_accuracy"] for h in trainer.state.log_history
              if "eval_token_accuracy" in h}
    assert sorted(scores) == [2, 4, 6]
    best_step = max(scores, key=lambda s: (scores[s], -s))  # the first of the best, as transformers keeps it
    assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best_step}")
    assert trainer.state.best_metric == scores[best_step]
    for step in (2, 4, 6):
        reader = CheckpointReader(str(tmp_path / f"checkpoint-{step}"))
        assert json.loads(reader.read("generation_config.json"))["max_length"] == 9  # hash-checked
    final = trainer.predict(reversal_pairs(16, seed=12))
    assert final.predictions.shape[1] == 9  # generated with the configured max_length


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_generation_matches_transformers(tmp_path, trained, precision):
    """bf16 / fp16: both trainers run the loss forward and the decoder steps (the model's forward) in CPU
    autocast, and the encoder (called directly by generate) outside it: the same ids as transformers'."""
    ours, theirs = both(tmp_path, trained, **{precision: True})
    data = reversal_pairs(12)
    mine, ref = ours.predict(data, num_beams=2), theirs.predict(data, num_beams=2)
    assert len(np.unique(mine.predictions)) > 5
    np.testing.assert_array_equal(mine.predictions, ref.predictions)
    np.testing.assert_array_equal(mine.label_ids, ref.label_ids)
    # the loss: equal in bf16; in fp16 within fp16's resolution, 2^-10 relative (fp16 rounding inside the
    # forward: 3e-5 measured with transformers 5.23 and accelerate 1.15, 1.3e-4 with transformers 5.24)
    assert mine.metrics["test_loss"] == pytest.approx(ref.metrics["test_loss"],
                                                      rel=1e-6 if precision == "bf16" else 2 ** -10)
    plain, _ = both(tmp_path / "fp32", trained)
    fp32_loss = plain.predict(data, num_beams=2).metrics["test_loss"]
    if precision == "fp16" and issubclass(Seq2SeqTrainer, transformers.Trainer):
        # transformers' loop runs no fp16 autocast on a CPU (accelerate's native_amp is off there)
        assert mine.metrics["test_loss"] == fp32_loss
        return
    # autocast did run: the loss differs from the fp32 one, by the half type's rounding only
    assert mine.metrics["test_loss"] != fp32_loss
    assert mine.metrics["test_loss"] == pytest.approx(fp32_loss, rel=2e-2)


def test_the_generation_config_is_pushed_with_the_model(tmp_path, trained):
    """push_to_hub: generation_config.json (the configured max_length and beams) goes to the repository with
    the weights, so the pushed model generates as it was evaluated."""
    import json

    from transformers import GenerationConfig

    repo = tmp_path / "hub" / "t5"
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "out"), num_workers=0, max_steps=2, per_device_train_batch_size=8,
        save_strategy="steps", save_steps=2, push_to_hub=True, hub_model_id=f"file://{repo}",
        hub_strategy="end", predict_with_generate=True,
        generation_config=GenerationConfig(max_length=7, num_beams=3, decoder_start_token_id=0,
                                           pad_token_id=0, eos_token_id=1),
        report_to="none", disable_tqdm=True)
    trainer = Seq2SeqTrainer(model=tiny_t5(trained), args=args, train_dataset=reversal_pairs(16, seed=11))
    trainer.train()
    trainer.push_to_hub()
    pushed = json.loads((repo / "main" / "generation_config.json").read_text())
    assert pushed["max_length"] == 7 and pushed["num_beams"] == 3
    assert (repo / "main" / "model.safetensors").exists()


@pytest.mark.parametrize("kw", [{"prediction_loss_only": True}, {"eval_accumulation_steps": 2},
                                {"include_for_metrics": ["inputs", "loss"]}],
                         ids=["prediction_loss_only", "eval_accumulation_steps", "include_for_metrics"])
def test_evaluation_options_match_transformers(tmp_path, trained, kw):
    """The evaluation options the example scripts use, with generation: the same outputs as transformers'."""
    seen = {}

    def metrics(p):
        seen.setdefault("inputs", []).append(None if p.inputs is None else np.asarray(p.inputs).shape)
        seen.setdefault("losses", []).append(None if p.losses is None else np.asarray(p.losses).shape)
        return token_accuracy(p)

    ours, theirs = both(tmp_path, trained, **kw)
    ours.compute_metrics = theirs.compute_metrics = metrics
    data = reversal_pairs(12)  # whole batches: transformers weighs a short last batch as a full one
    mine, ref = ours.predict(data, num_beams=2), theirs.predict(data, num_beams=2)
    assert (mine.predictions is None) == (ref.predictions is None) == ("prediction_loss_only" in kw)
    if mine.predictions is not None:
        np.testing.assert_array_equal(mine.predictions, ref.predictions)
        np.testing.assert_array_equal(mine.label_ids, ref.label_ids)
    assert mine.metrics["test_loss"] == pytest.approx(ref.metrics["test_loss"], rel=1e-6)
    assert {k: v for k, v in mine.metrics.items() if "token" in k} == {
        k: v for k, v in ref.metrics.items() if "token" in k}
    if "include_for_metrics" in kw:  # both trainers' compute_metrics got the inputs and the losses
        assert seen["inputs"][0] == seen["inputs"][1] == (12, 6)
        assert seen["losses"][0] is not None and seen["losses"][1] is not None


@pytest.mark.parametrize("generate", [True, False])
def test_eval_loss_with_a_short_last_batch_is_transformers(tmp_path, trained, generate):
    """transformers' Seq2SeqTrainer gathers without dropping rows, so each batch's loss counts
    eval_batch_size times, the short last one too: its eval_loss is the mean of the batches' losses.
    raytrainer's weighed each example once (10 examples in batches of 4: 0.3% apart here)."""
    ours, theirs = both(tmp_path, trained, predict_with_generate=generate)
    data = reversal_pairs(10)
    mine, ref = ours.evaluate(data), theirs.evaluate(data)
    assert mine["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-6)
    plain = transformers.Trainer(model=theirs.model, args=theirs.args).evaluate(data)["eval_loss"]
    assert ref["eval_loss"] != pytest.approx(plain, rel=1e-6)  # the case that tells the two rules apart
