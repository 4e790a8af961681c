"""Hyperparameter search with Ray Tune and the ASHA scheduler: trials run side by side, each a distributed
run of its own, and ASHA ends the trials that fall behind at an evaluation.

    python examples/search_asha.py                                     # 8 trials, 2 Ray workers each
    python examples/search_asha.py --n_trials 4 --num_train_epochs 2   # a smoke run
    RAY_ADDRESS=ray://head:10001 python examples/search_asha.py        # on a cluster

Task: the digits MLP of train_digits.py, built by ``model_init`` on each trial's workers from the trial's
config (Tune hands ``model_init`` a dict). The objective is the test accuracy at each epoch's evaluation;
ASHA compares trials at 1, 2, 4, ... evaluations and keeps the better half. Each trial writes to
``OUTPUT_DIR/run-<trial id>``, with its ``trial_summary.json``. The script prints every trial and exits with
status 1 unless the best test accuracy reaches ``--min_accuracy``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from train_digits import DigitsMLP, accuracy, digits_splits

from raytrainer import ArgumentParser, Trainer, TrainingArguments
from raytrainer.search.common import TrialSummary


def hp_space(trial) -> dict:
    from ray import tune

    return {"learning_rate": tune.loguniform(1e-4, 3e-2), "hidden_size": tune.choice([32, 64, 128])}


def model_init(trial) -> DigitsMLP:
    return DigitsMLP(hidden=trial["hidden_size"] if trial is not None else 64)


@dataclass
class SearchArguments:
    n_trials: int = field(default=8, metadata={"help": "Trials Tune samples from hp_space."})
    min_accuracy: float = field(default=0.9, metadata={"help": "Exit with status 1 below this accuracy."})


def main(argv: list[str] | None = None) -> dict:
    from ray.tune.schedulers import ASHAScheduler

    defaults = {"output_dir": "asha_output", "num_workers": 2, "num_train_epochs": 4,
                "per_device_train_batch_size": 32, "eval_strategy": "epoch", "save_strategy": "no",
                "logging_strategy": "epoch", "ddp_find_unused_parameters": False}
    parser = ArgumentParser((SearchArguments, TrainingArguments))
    parser.set_defaults(**defaults)
    task, args = parser.parse_args_into_dataclasses(args=argv)
    train, test = digits_splits(args.seed)

    trainer = Trainer(model_init=model_init, args=args, train_dataset=train, eval_dataset=test,
                      compute_metrics=accuracy)
    evaluations = int(args.num_train_epochs)
    best = trainer.hyperparameter_search(
        hp_space=hp_space, backend="ray", n_trials=task.n_trials, direction="maximize",
        compute_objective=lambda metrics: metrics["eval_accuracy"],
        scheduler=ASHAScheduler(time_attr="training_iteration", max_t=evaluations, grace_period=1,
                                reduction_factor=2))
    trials = [TrialSummary.load(os.path.join(args.output_dir, d)) for d in sorted(os.listdir(args.output_dir))
              if d.startswith("run-")]
    trials = [t for t in trials if t is not None]
    for t in trials:
        print(f"trial {t.trial_id}: {len(t.evaluations)} evaluation(s), step {t.global_step}, accuracy "
              f"{t.objective:.2%}{' (stopped by ASHA)' if t.pruned else ''} with {t.hyperparameters}")
    print(f"best trial {best.run_id}: accuracy {best.objective:.2%} with {best.hyperparameters}")
    if best.objective < task.min_accuracy:
        print(f"accuracy {best.objective:.3f} is below --min_accuracy {task.min_accuracy}", file=sys.stderr)
        sys.exit(1)
    return {"best": best, "trials": trials}


if __name__ == "__main__":
    main()
