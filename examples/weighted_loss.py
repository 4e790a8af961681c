"""The docs' weighted ``compute_loss``: a Trainer subclass whose loss weighs a rare class more.

    python examples/weighted_loss.py                     # 2 Ray workers: the override runs on each of them
    python examples/weighted_loss.py --num_workers 0     # in this process

Task: scikit-learn's digits as "is it a 9?" -- one example in ten is positive. With the same model, data and
seed, the script trains once with the plain loss and once with the positive class weighted ``--weight``
times, and prints the recall of 9s on the test set for both. It exits with status 1 unless the weighted
run finds at least ``--min_recall`` of the 9s.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from train_digits import DigitsMLP, digits_splits

from raytrainer import ArgumentParser, EvalPrediction, Trainer, TrainingArguments


class WeightedLossTrainer(Trainer):
    """As in transformers' docs: pop the labels, run the model, weigh the classes in the loss."""

    class_weights = (1.0, 1.0)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs["logits"][:, :2]  # the MLP has 10 outputs; this task uses two
        weight = torch.tensor(self.class_weights, device=logits.device)
        loss = torch.nn.functional.cross_entropy(logits, labels, weight=weight)
        return (loss, {"logits": logits}) if return_outputs else loss


def is_nine(examples: list[dict]) -> list[dict]:
    return [{**e, "labels": int(e["labels"] == 9)} for e in examples]


def recall(pred: EvalPrediction) -> dict[str, float]:
    predicted, actual = pred.predictions.argmax(-1), pred.label_ids
    found = ((predicted == 1) & (actual == 1)).sum()
    return {"recall": float(found / max((actual == 1).sum(), 1)),
            "accuracy": float((predicted == actual).mean())}


@dataclass
class WeightArguments:
    weight: float = field(default=9.0, metadata={"help": "The positive class's weight in the loss."})
    min_recall: float = field(default=0.85, metadata={"help": "Exit with status 1 below this recall."})


def main(argv: list[str] | None = None) -> dict:
    defaults = {"output_dir": "weighted_output", "num_workers": 2, "num_train_epochs": 2,
                "per_device_train_batch_size": 32, "learning_rate": 2e-3, "save_strategy": "no",
                "logging_steps": 10, "ddp_find_unused_parameters": False}
    parser = ArgumentParser((WeightArguments, TrainingArguments))
    parser.set_defaults(**defaults)
    task, args = parser.parse_args_into_dataclasses(args=argv)
    train, test = (is_nine(split) for split in digits_splits(args.seed))

    recalls = {}
    for name, weights in (("plain", (1.0, 1.0)), ("weighted", (1.0, task.weight))):
        torch.manual_seed(args.seed)
        trainer_class = type(f"{name.title()}LossTrainer", (WeightedLossTrainer,), {"class_weights": weights})
        trainer = trainer_class(model=DigitsMLP(), args=args, train_dataset=train, eval_dataset=test,
                                compute_metrics=recall)
        trainer.train()
        recalls[name] = trainer.evaluate()["eval_recall"]
    print(f"recall of 9s on the test set: {recalls['plain']:.1%} with the plain loss, "
          f"{recalls['weighted']:.1%} with 9s weighted {task.weight:g}x")
    if recalls["weighted"] < task.min_recall:
        print(f"recall {recalls['weighted']:.3f} is below --min_recall {task.min_recall}", file=sys.stderr)
        sys.exit(1)
    return recalls


if __name__ == "__main__":
    main()
