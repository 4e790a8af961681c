"""examples/translate.py in its smoke setting, in one process, against the same script's pieces run by
transformers.Seq2SeqTrainer with the same data, model and seed: the losses and the BLEU agree."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import translate

SMOKE = ["--num_workers", "0", "--max_steps", "150", "--train_examples", "1200", "--eval_examples", "64",
         "--eval_strategy", "no", "--disable_tqdm", "1", "--logging_steps", "50"]


def _transformers_run(out: str) -> dict:
    import torch
    import transformers

    vocab = translate.WordVocab()
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=out, use_cpu=True, max_steps=150, per_device_train_batch_size=32,
        per_device_eval_batch_size=64, learning_rate=3e-3, eval_strategy="no", logging_steps=50,
        save_strategy="no", predict_with_generate=True, generation_max_length=10, report_to="none",
        disable_tqdm=True, seed=42)
    torch.manual_seed(args.seed)
    trainer = transformers.Seq2SeqTrainer(
        model=translate.tiny_t5(len(vocab), 64), args=args,
        train_dataset=translate.parallel_corpus(vocab, 1200, seed=args.seed),
        eval_dataset=translate.parallel_corpus(vocab, 64, seed=args.seed + 1),
        compute_metrics=translate.bleu_metric(vocab))
    trainer.train()
    return {**trainer.evaluate(), "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}


def test_the_translation_example_learns_as_transformers_does(tmp_path, capsys):
    ours = translate.main([*SMOKE, "--output_dir", str(tmp_path / "ours")])
    printed = capsys.readouterr().out
    assert "trained 150 steps on 1 worker(s)" in printed and f"BLEU {ours['eval_bleu']:.1f}" in printed
    theirs = _transformers_run(str(tmp_path / "theirs"))
    assert ours["eval_bleu"] > 3.0  # untrained it is 0: the lexicon is being learned
    assert ours["eval_bleu"] == pytest.approx(theirs["eval_bleu"], abs=3.0)
    assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=0.05)
