"""Hyperparameter search with optuna, its study kept in sqlite: stop the script, run it again, and the study
goes on where it was (each run adds ``--n_trials`` trials to those the study holds, as in transformers).

    python examples/search_optuna.py                     # each trial on 2 Ray workers
    python examples/search_optuna.py --num_workers 0     # each trial in this process
    python examples/search_optuna.py --n_trials 4 --num_train_epochs 1      # a smoke run

Task: the digits MLP of train_digits.py, built by ``model_init`` for each trial with the trial's hidden size;
the search tries learning rates and hidden sizes, with optuna's median pruner stopping trials that fall
behind at an evaluation; its TPE sampler is seeded with ``--seed`` (and the trials already in the study), so
a run is repeatable. The study lives in ``OUTPUT_DIR/search.db``. The script prints the best trial and exits
with status 1 unless this run added ``--n_trials`` finished or pruned trials and the best test accuracy
reaches ``--min_accuracy``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from train_digits import DigitsMLP, accuracy, digits_splits

from raytrainer import ArgumentParser, Trainer, TrainingArguments


def hp_space(trial) -> dict:
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 3e-2, log=True),
            "hidden_size": trial.suggest_categorical("hidden_size", [32, 64, 128])}


def model_init(trial) -> DigitsMLP:
    return DigitsMLP(hidden=trial.params["hidden_size"] if trial is not None else 64)


@dataclass
class SearchArguments:
    n_trials: int = field(default=12, metadata={"help": "Trials this run adds to the study."})
    min_accuracy: float = field(default=0.9, metadata={"help": "Exit with status 1 below this accuracy."})


def main(argv: list[str] | None = None) -> dict:
    import optuna

    defaults = {"output_dir": "search_output", "num_workers": 2, "num_train_epochs": 4,
                "per_device_train_batch_size": 32, "eval_strategy": "epoch", "save_strategy": "no",
                "logging_strategy": "epoch", "metric_for_best_model": "accuracy",
                "ddp_find_unused_parameters": False}
    parser = ArgumentParser((SearchArguments, TrainingArguments))
    parser.set_defaults(**defaults)
    task, args = parser.parse_args_into_dataclasses(args=argv)
    train, test = digits_splits(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    storage = f"sqlite:///{os.path.abspath(os.path.join(args.output_dir, 'search.db'))}"

    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)

    def ended() -> int:
        try:
            return len(optuna.load_study(study_name="digits", storage=storage).get_trials(states=finished))
        except KeyError:  # no study yet
            return 0

    before = ended()
    trainer = Trainer(model_init=model_init, args=args, train_dataset=train, eval_dataset=test,
                      compute_metrics=accuracy)
    best = trainer.hyperparameter_search(
        hp_space=hp_space, backend="optuna", n_trials=task.n_trials, direction="maximize",
        compute_objective=lambda metrics: metrics["eval_accuracy"],
        storage=storage, study_name="digits", load_if_exists=True,
        sampler=optuna.samplers.TPESampler(seed=args.seed + before),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2))
    study = optuna.load_study(study_name="digits", storage=storage)
    pruned = sum(t.state == optuna.trial.TrialState.PRUNED for t in study.trials)
    total = ended()
    print(f"study 'digits' in {storage}: {total} trials ({pruned} pruned), {total - before} from this run; "
          f"best trial {best.run_id}: accuracy {best.objective:.2%} with {best.hyperparameters}")
    if total - before < task.n_trials or best.objective < task.min_accuracy:
        print(f"expected {task.n_trials} more trials and an accuracy of {task.min_accuracy} at least",
              file=sys.stderr)
        sys.exit(1)
    return {"best": best, "trials": total, "pruned": pruned, "storage": storage}


if __name__ == "__main__":
    main()
