"""Seq2SeqTrainer on 2 Ray workers: predict_with_generate returns, in dataset order, the ids one process
generates with the same weights (DDP, FSDP, ZeRO-3); the translation example runs on 2 workers."""

from __future__ import annotations

import numpy as np
import pytest
from models import reversal_pairs, tiny_t5, token_accuracy

from raytrainer import Seq2SeqTrainer, Seq2SeqTrainingArguments


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Weights that generate varied ids (an untrained T5 generates only pad), trained in one process."""
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path_factory.mktemp("train")), num_workers=0,
                                    max_steps=150, learning_rate=3e-3, per_device_train_batch_size=8,
                                    save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
    trainer = Seq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=reversal_pairs(96, seed=7))
    trainer.train()
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def _trainer(tmp_path, state, num_workers: int, **kw):
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / f"w{num_workers}"), num_workers=num_workers,
                                    per_device_eval_batch_size=3, predict_with_generate=True,
                                    report_to="none", disable_tqdm=True, **kw)
    return Seq2SeqTrainer(model=tiny_t5(state), args=args, compute_metrics=token_accuracy)


_ZERO3 = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
          "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 3}}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", [{}, {"fsdp": "full_shard auto_wrap"}, {"deepspeed": _ZERO3}],
                         ids=["ddp", "fsdp", "zero3"])
def test_generation_on_two_workers_equals_one_process(tmp_path, trained, strategy):
    """Under FSDP each rank holds half of every T5 block and of the root unit (the shared embedding, the tied
    LM head): generate() gathers the root's for the call and each block's in its own forward; under ZeRO-3
    every forward gathers its layers' partitions. Both generate with synced_gpus (the ranks' sequences end
    at different steps), and the ids equal one process's exactly."""
    data = reversal_pairs(13)  # not a multiple of 2 ranks x 3: the last batches are padded and cut
    # eval_accumulation_steps=2: each rank sends its sequences to rank 0 every 2 batches (of 3 rows, the last
    # one cut), and rank 0 puts the variable-length parts back in dataset order
    single = _trainer(tmp_path, trained, 0)
    workers = _trainer(tmp_path, trained, 2, eval_accumulation_steps=2, **strategy)
    greedy_one, greedy_two = single.predict(data), workers.predict(data)  # greedy, the config's max_length
    np.testing.assert_array_equal(greedy_two.predictions, greedy_one.predictions)
    assert len(np.unique(greedy_one.predictions)) > 5
    # evaluate() honours its generation arguments on the workers: the same metrics as one process
    scored_one = single.evaluate(data, max_length=4, num_beams=2)
    scored_two = workers.evaluate(data, max_length=4, num_beams=2)
    assert scored_two["eval_token_accuracy"] == scored_one["eval_token_accuracy"]
    assert scored_one["eval_token_accuracy"] != single.evaluate(data)["eval_token_accuracy"]  # max_length bit
    one = single.predict(data, num_beams=2, max_length=6)
    two = workers.predict(data, num_beams=2, max_length=6)
    assert len(np.unique(one.predictions)) > 5  # varied ids, not a column of pads
    assert two.predictions.shape == one.predictions.shape == (13, 20)  # padded to the config's max_length
    np.testing.assert_array_equal(two.predictions, one.predictions)
    np.testing.assert_array_equal(two.label_ids, one.label_ids)
    assert (two.predictions[:, 6:] == 0).all()  # max_length=6 was honoured on the workers
    assert two.metrics["test_token_accuracy"] == one.metrics["test_token_accuracy"]
    assert two.metrics["test_loss"] == pytest.approx(one.metrics["test_loss"], rel=1e-5)


def test_the_translation_example_on_two_workers(tmp_path, capsys):
    """examples/translate.py as written, in its smoke setting, with --num_workers 2: it trains, generates on
    the workers and scores the generations with BLEU."""
    import translate

    metrics = translate.main(["--num_workers", "2", "--max_steps", "60", "--train_examples", "600",
                              "--eval_examples", "48", "--eval_strategy", "no", "--disable_tqdm", "1",
                              "--output_dir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "trained 60 steps on 2 worker(s)" in printed and f"BLEU {metrics['eval_bleu']:.1f}" in printed
    assert 0.0 <= metrics["eval_bleu"] <= 100.0 and metrics["eval_loss"] < 3.0  # ln(50) = 3.9 untrained
