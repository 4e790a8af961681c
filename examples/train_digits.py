"""Train a digits classifier with raytrainer: the HF Trainer API, run on Ray Train workers.

    python examples/train_digits.py                       # 2 Ray workers (DDP over gloo on CPU)
    python examples/train_digits.py --num_workers 0       # in this process, no Ray
    python examples/train_digits.py --log_level warning --log_level_replica error --log_on_each_node 0

Data: the 8x8 handwritten digits of the UCI ML repository (1,797 images, CC BY 4.0), as scikit-learn
bundles them, shipped beside this script in data_digits.npz (no download, no scikit-learn needed). The
script evaluates after every epoch, prints the test accuracy, and exits with status 1 if it ends at or
below 90%.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

from raytrainer import ArgumentParser, EvalPrediction, Trainer, TrainingArguments, set_seed


class DigitsMLP(torch.nn.Module):
    """64 pixels -> hidden -> 10 classes; returns the loss first when labels are given, as HF models do."""

    def __init__(self, hidden: int = 128):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)
        )

    def forward(self, pixel_values, labels=None):
        logits = self.net(pixel_values)
        if labels is None:
            return {"logits": logits}
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def digits_splits(seed: int = 0):
    """Train/test lists of {"pixel_values", "labels"} examples, pixels scaled to [0, 1]."""
    with np.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data_digits.npz")) as f:
        x, y = (f["images"] / 16.0).astype(np.float32), f["labels"].astype(np.int64)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), dtype=bool)  # a stratified 20% test split: a fifth of each class
    for label in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == label))
        test[members[: round(0.2 * len(members))]] = True
    x_tr, x_te, y_tr, y_te = x[~test], x[test], y[~test], y[test]
    as_examples = lambda xs, ys: [{"pixel_values": a, "labels": int(b)} for a, b in zip(xs, ys)]  # noqa: E731
    return as_examples(x_tr, y_tr), as_examples(x_te, y_te)


def accuracy(pred: EvalPrediction) -> dict[str, float]:
    return {"accuracy": float((pred.predictions.argmax(-1) == pred.label_ids).mean())}


@dataclass
class DemoArguments:
    hidden_size: int = field(default=128, metadata={"help": "Width of the MLP's hidden layer."})


def main(argv: list[str] | None = None) -> float:
    defaults = {
        "output_dir": "demo_output", "num_workers": 2, "num_train_epochs": 8,
        "per_device_train_batch_size": 32, "per_device_eval_batch_size": 64, "learning_rate": 5e-3,
        "eval_strategy": "epoch", "logging_steps": 10, "save_strategy": "no",
        # the MLP uses every parameter: no per-step search for unused ones (transformers' default searches)
        "ddp_find_unused_parameters": False,
    }
    parser = ArgumentParser((DemoArguments, TrainingArguments))
    parser.set_defaults(**defaults)
    demo_args, args = parser.parse_args_into_dataclasses(args=argv)

    train, test = digits_splits(args.seed)
    set_seed(args.seed)  # before the model is built, as transformers' example scripts do: the same weights
    trainer = Trainer(
        model=DigitsMLP(demo_args.hidden_size), args=args, train_dataset=train, eval_dataset=test,
        compute_metrics=accuracy,
    )
    # --resume_from_checkpoint takes a checkpoint's path or URI, or "latest": the newest committed checkpoint
    # in --storage_path (a bucket on a cluster), found by the Trainer
    resume = args.resume_from_checkpoint
    result = trainer.train(resume_from_checkpoint=True if resume == "latest" else resume)
    per_epoch = [round(h["eval_accuracy"], 4) for h in trainer.state.log_history if "eval_accuracy" in h]
    final = per_epoch[-1]
    print(f"trained {result.global_step} steps on {max(args.num_workers, 1)} worker(s) "
          f"in {result.metrics['train_runtime']:.1f}s; train_loss {result.training_loss:.4f}")
    print(f"test accuracy per epoch: {per_epoch}")
    print(f"final test accuracy: {final:.2%}")
    return final


if __name__ == "__main__":
    sys.exit(0 if main() > 0.90 else 1)
