"""Train a small T5 to translate with raytrainer's Seq2SeqTrainer, scored with BLEU on generated text.

    python examples/translate.py                        # 2 Ray workers (DDP over gloo on CPU)
    python examples/translate.py --num_workers 0        # in this process, no Ray
    python examples/translate.py --max_steps 20         # a smoke run

Offline and deterministic: the "language pair" is generated. A source sentence is 3-6 words of a 24-word
vocabulary; its translation maps each word through a fixed dictionary and reverses the word order, so a model
must learn both the lexicon and the reordering. Words are tokens (a word-level vocabulary built here, no
tokenizer download); the model is a 2-layer T5 built from a config. ``compute_metrics`` decodes the generated
ids and the labels (the -100s replaced by the pad id, as transformers' translation example does) and scores
them with sacrebleu. Exits with status 1 if the final BLEU is below 60.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

from raytrainer import ArgumentParser, Seq2SeqTrainer, Seq2SeqTrainingArguments

SOURCE_WORDS = ["the", "a", "red", "blue", "green", "cat", "dog", "bird", "sees", "likes", "eats", "fast",
                "slow", "big", "small", "tree", "house", "river", "near", "under", "old", "young", "fish",
                "runs"]
PAD, EOS, FIRST = 0, 1, 2
MIN_BLEU = 60.0


class WordVocab:
    """Words <-> ids: 0 pad, 1 </s>, then the source words, then the target words."""

    def __init__(self):
        self.target_of = {w: f"{w[::-1]}o" for w in SOURCE_WORDS}  # the 'foreign' lexicon
        words = SOURCE_WORDS + [self.target_of[w] for w in SOURCE_WORDS]
        self.id_of = {w: FIRST + i for i, w in enumerate(words)}
        self.word_of = {i: w for w, i in self.id_of.items()}
        self.pad_token_id, self.eos_token_id = PAD, EOS

    def __len__(self) -> int:
        return FIRST + len(self.id_of)

    def encode(self, sentence: str) -> list[int]:
        return [self.id_of[w] for w in sentence.split()] + [EOS]

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            if int(i) == EOS:
                break
            if int(i) != PAD:
                out.append(self.word_of.get(int(i), "<unk>"))
        return " ".join(out)

    def batch_decode(self, rows) -> list[str]:
        return [self.decode(row) for row in rows]

    def translate(self, sentence: str) -> str:
        return " ".join(self.target_of[w] for w in reversed(sentence.split()))


def parallel_corpus(vocab: WordVocab, n: int, seed: int, src_len: int = 8, tgt_len: int = 8) -> list[dict]:
    """``n`` (source, translation) pairs as padded ids; labels padded with -100 (DataCollatorForSeq2Seq's)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        sentence = " ".join(rng.choice(SOURCE_WORDS) for _ in range(rng.randint(3, 6)))
        src, tgt = vocab.encode(sentence), vocab.encode(vocab.translate(sentence))
        ids = torch.full((src_len,), PAD, dtype=torch.long)
        ids[: len(src)] = torch.tensor(src)
        labels = torch.full((tgt_len,), -100, dtype=torch.long)
        labels[: len(tgt)] = torch.tensor(tgt)
        out.append({"input_ids": ids, "attention_mask": (ids != PAD).long(), "labels": labels})
    return out


def tiny_t5(vocab_size: int, d_model: int):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=d_model // 4, d_ff=4 * d_model,
                      num_layers=2, num_decoder_layers=2, num_heads=4, decoder_start_token_id=PAD,
                      pad_token_id=PAD, eos_token_id=EOS, dropout_rate=0.0)
    return T5ForConditionalGeneration(config)


def bleu_metric(vocab: WordVocab):
    import sacrebleu

    def compute_metrics(pred) -> dict[str, float]:
        preds = np.where(pred.predictions != -100, pred.predictions, PAD)
        labels = np.where(pred.label_ids != -100, pred.label_ids, PAD)
        hypotheses, references = vocab.batch_decode(preds), vocab.batch_decode(labels)
        exact = float(np.mean([h == r for h, r in zip(hypotheses, references)]))
        return {"bleu": sacrebleu.corpus_bleu(hypotheses, [references]).score, "exact_match": exact}

    return compute_metrics


@dataclass
class ExampleArguments:
    d_model: int = field(default=64, metadata={"help": "Width of the T5 model."})
    train_examples: int = field(default=2000, metadata={"help": "Generated training pairs."})
    eval_examples: int = field(default=200, metadata={"help": "Generated evaluation pairs."})


def main(argv: list[str] | None = None) -> dict[str, float]:
    defaults = {
        "output_dir": "translate_output", "num_workers": 2, "num_train_epochs": 10,
        "per_device_train_batch_size": 32, "per_device_eval_batch_size": 64, "learning_rate": 3e-3,
        "eval_strategy": "epoch", "logging_steps": 20, "save_strategy": "no", "predict_with_generate": True,
        "generation_max_length": 10, "report_to": "none",
    }
    parser = ArgumentParser((ExampleArguments, Seq2SeqTrainingArguments))
    parser.set_defaults(**defaults)
    example, args = parser.parse_args_into_dataclasses(args=argv)

    vocab = WordVocab()
    torch.manual_seed(args.seed)
    trainer = Seq2SeqTrainer(
        model=tiny_t5(len(vocab), example.d_model), args=args,
        train_dataset=parallel_corpus(vocab, example.train_examples, seed=args.seed),
        eval_dataset=parallel_corpus(vocab, example.eval_examples, seed=args.seed + 1),
        compute_metrics=bleu_metric(vocab),
    )
    result = trainer.train()
    metrics = trainer.evaluate()
    sample = parallel_corpus(vocab, 3, seed=args.seed + 2)
    generated = trainer.predict(sample).predictions
    print(f"trained {result.global_step} steps on {max(args.num_workers, 1)} worker(s); "
          f"train_loss {result.training_loss:.4f}")
    for example_ids, ids in zip(sample, generated):
        print(f"  {vocab.decode(example_ids['input_ids'])!r} -> {vocab.decode(ids)!r}")
    print(f"BLEU {metrics['eval_bleu']:.1f}, exact match {metrics['eval_exact_match']:.1%}")
    return metrics


if __name__ == "__main__":
    sys.exit(0 if main()["eval_bleu"] >= MIN_BLEU else 1)
