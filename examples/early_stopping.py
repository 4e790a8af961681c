"""The docs' early stopping: ``EarlyStoppingCallback`` ends training once the evaluation loss stops improving,
and ``load_best_model_at_end`` brings back the best checkpoint's weights.

    python examples/early_stopping.py                    # 2 Ray workers
    python examples/early_stopping.py --num_workers 0    # in this process

Task: scikit-learn's digits with only ``--train_examples`` training images and a wide MLP at a high
learning rate, so it overfits within a few epochs: the evaluation loss falls, then rises. The script prints
the epoch it stopped at and the best checkpoint, and exits with status 1 unless training stopped before
``num_train_epochs`` with the best evaluation loss restored.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from train_digits import DigitsMLP, accuracy, digits_splits

from raytrainer import ArgumentParser, EarlyStoppingCallback, Trainer, TrainingArguments


@dataclass
class StopArguments:
    train_examples: int = field(default=120, metadata={"help": "Training images (few: it overfits)."})
    patience: int = field(default=2, metadata={"help": "Evaluations without improvement before stopping."})


def main(argv: list[str] | None = None) -> dict:
    defaults = {"output_dir": "early_stopping_output", "num_workers": 2, "num_train_epochs": 60,
                "per_device_train_batch_size": 16, "learning_rate": 1e-2, "eval_strategy": "epoch",
                "save_strategy": "epoch", "save_total_limit": 2, "load_best_model_at_end": True,
                "metric_for_best_model": "eval_loss", "logging_strategy": "epoch",
                "ddp_find_unused_parameters": False}
    parser = ArgumentParser((StopArguments, TrainingArguments))
    parser.set_defaults(**defaults)
    task, args = parser.parse_args_into_dataclasses(args=argv)
    train, test = digits_splits(args.seed)

    trainer = Trainer(model=DigitsMLP(hidden=512), args=args, train_dataset=train[:task.train_examples],
                      eval_dataset=test, compute_metrics=accuracy,
                      callbacks=[EarlyStoppingCallback(early_stopping_patience=task.patience)])
    trainer.train()
    losses = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    final = trainer.evaluate()["eval_loss"]
    epochs = trainer.state.epoch
    print(f"stopped after epoch {epochs:g} of {args.num_train_epochs:g}; best evaluation loss "
          f"{min(losses):.4f} at {trainer.state.best_model_checkpoint}; the model now scores {final:.4f}")
    stopped_early = epochs < args.num_train_epochs
    if not stopped_early or abs(final - min(losses)) > 1e-4:
        print("expected an early stop with the best checkpoint's weights loaded", file=sys.stderr)
        sys.exit(1)
    return {"epochs": epochs, "eval_losses": losses, "final": final,
            "best_checkpoint": trainer.state.best_model_checkpoint}


if __name__ == "__main__":
    main()
