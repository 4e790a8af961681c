"""Hyperparameter-search benchmark: transformers.Trainer's optuna search against raytrainer's searches.

The digits MLP (bench/_common.py), 8 trials x 2 epochs, the same 8 learning rates on every side (drawn
once from log-uniform(1e-5, 1e-1) with optuna's RandomSampler(seed=42); trial n gets the n-th), seed
42, a global batch of 32 (32 in one process; 16 per worker on 2 workers), AdamW (torch, not fused), no
pruning on the Optuna sides (NopPruner: every trial runs to the end), objective = eval accuracy on a
held-out 20% (360 examples).

Sides, each in its own fresh process:
  hf        transformers.Trainer.hyperparameter_search(backend="optuna"), one process, trials in turn
  rt        raytrainer, backend="optuna", 2 Ray workers (DDP) per trial, n_jobs=2 (2 trials at a time,
            on 2 pooled worker groups)
  rt1       raytrainer, backend="optuna", 2 Ray workers per trial, n_jobs=1: every trial on one warm group
  rt1_warm  rt1 on a running Ray head (``ray start --head``, started before the side): the first run there
  rt1_second  rt1's script run twice on a running head, the second measured: its trials take the group the
            first run left (``keep_workers_s``, driver/keeper.py), as a script's second run does
  rt_asha   raytrainer, backend="ray", 2 workers per trial, 2 trials at a time, ASHA on 8 evaluations
            per trial (every quarter epoch; grace 1, reduction factor 3 by default); trials on warm groups
  rt_asha_fresh  the same with reuse_actors=False: every trial's actor starts a worker group of its own
  SIDE@NAME a raytrainer side with raytrainer imported from the checkout given as ``--tree NAME=PATH`` (a
            ``git archive`` of another commit): a before/after in one run

Prints a Markdown table and writes the raw numbers as JSON. Not a test: nothing asserts.

    python bench/bench_hpo.py --out /tmp/bench-hpo.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
N_TRIALS, EPOCHS, BATCH, SEED = 8, 2, 32, 42


def learning_rates() -> list[float]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=SEED))
    return [study.ask().suggest_float("learning_rate", 1e-5, 1e-1, log=True) for _ in range(N_TRIALS)]


# -- what runs inside a side's process ---------------------------------------------------------------------
def _data(cfg):
    import numpy as np
    import torch
    from _common import DictDataset

    d = np.load(cfg["digits_path"])
    perm = np.random.default_rng(SEED).permutation(len(d["y"]))
    x, y = torch.from_numpy(d["x"][perm]), torch.from_numpy(d["y"][perm])
    cut = int(0.8 * len(y))
    return DictDataset(x=x[:cut], labels=y[:cut]), DictDataset(x=x[cut:], labels=y[cut:])


def model_init(trial=None):
    import torch
    from _common import MLPClassifier

    torch.manual_seed(SEED)
    return MLPClassifier()


def accuracy(pred):
    import numpy as np

    return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}


def objective(metrics):
    return metrics["eval_accuracy"]


class ListSampler:
    """Trial n gets the n-th of the benchmark's learning rates (the same 8 on every side, in order)."""

    def __new__(cls, rates):
        import optuna

        class _ListSampler(optuna.samplers.BaseSampler):
            def infer_relative_search_space(self, study, trial):
                return {}

            def sample_relative(self, study, trial, search_space):
                return {}

            def sample_independent(self, study, trial, name, distribution):
                return rates[trial.number % len(rates)]

        return _ListSampler()


def _study(cfg, name):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return {"storage": f"sqlite:///{cfg['workdir']}/{name}.db", "study_name": name,
            "sampler": ListSampler(cfg["learning_rates"]), "pruner": optuna.pruners.NopPruner()}


def _study_record(kw, steps_per_trial: int) -> dict:
    """Per-trial objectives and training steps (a trial that stopped early: its last reported step)."""
    import optuna

    study = optuna.load_study(study_name=kw["study_name"], storage=kw["storage"])
    steps = [steps_per_trial if t.state.name == "COMPLETE" else max(t.intermediate_values, default=0)
             for t in study.trials]
    return {"trial_objectives": [t.value for t in study.trials], "total_steps": sum(steps),
            "trial_seconds": [round((t.datetime_complete - t.datetime_start).total_seconds(), 1)
                              for t in study.trials if t.datetime_complete]}


def _common_args(cfg, out, workers: int = 1):
    return dict(output_dir=out, per_device_train_batch_size=BATCH // workers, per_device_eval_batch_size=128,
                num_train_epochs=EPOCHS, optim="adamw_torch", lr_scheduler_type="linear", weight_decay=0.0,
                save_strategy="no", logging_steps=50, disable_tqdm=True, report_to="none", seed=SEED,
                remove_unused_columns=False)


def _steps_per_epoch(train) -> int:
    return -(-len(train) // BATCH)


def space_optuna(trial):
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-5, 1e-1, log=True)}


def side_hf(cfg) -> dict:
    from _common import collate
    from transformers import Trainer, TrainingArguments

    train, test = _data(cfg)
    args = TrainingArguments(eval_strategy="epoch", use_cpu=True, **_common_args(cfg, cfg["workdir"] + "/hf"))
    trainer = Trainer(model_init=model_init, args=args, train_dataset=train, eval_dataset=test,
                      data_collator=collate, compute_metrics=accuracy)
    kw = _study(cfg, "hf")
    start = time.perf_counter()
    best = trainer.hyperparameter_search(hp_space=space_optuna, compute_objective=objective,
                                         n_trials=N_TRIALS, direction="maximize", backend="optuna", **kw)
    return {"best_objective": best.objective, "best_lr": best.hyperparameters["learning_rate"],
            "search_s": round(time.perf_counter() - start, 1),
            **_study_record(kw, EPOCHS * _steps_per_epoch(train))}


def side_rt1(cfg) -> dict:
    return side_rt(cfg, n_jobs=1)


def side_rt(cfg, n_jobs: int = 2) -> dict:
    from _common import collate

    from raytrainer import Trainer, TrainingArguments

    train, test = _data(cfg)
    args = TrainingArguments(eval_strategy="epoch", num_workers=2, ray_address=cfg.get("ray_address"),
                             **_common_args(cfg, cfg["workdir"] + f"/rt{n_jobs}", workers=2))
    trainer = Trainer(model_init=model_init, args=args, train_dataset=train, eval_dataset=test,
                      data_collator=collate, compute_metrics=accuracy)
    kw = _study(cfg, cfg.get("study", f"rt{n_jobs}"))
    start = time.perf_counter()
    best = trainer.hyperparameter_search(hp_space=space_optuna, compute_objective=objective,
                                         n_trials=N_TRIALS, direction="maximize", backend="optuna",
                                         n_jobs=n_jobs, **kw)
    return {"best_objective": best.objective, "best_lr": best.hyperparameters["learning_rate"],
            "search_s": round(time.perf_counter() - start, 1),
            **_study_record(kw, EPOCHS * _steps_per_epoch(train))}


def side_rt_asha_fresh(cfg) -> dict:
    return side_rt_asha(cfg, "rt_asha_fresh", reuse_actors=False)


def side_rt_asha(cfg, name: str = "rt_asha", **search_kwargs) -> dict:
    from _common import collate
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from raytrainer import Trainer, TrainingArguments

    train, test = _data(cfg)
    per_epoch = _steps_per_epoch(train)
    args = TrainingArguments(eval_strategy="steps", eval_steps=max(per_epoch // 4, 1), num_workers=2,
                             **_common_args(cfg, f"{cfg['workdir']}/{name}", workers=2))
    trainer = Trainer(model_init=model_init, args=args, train_dataset=train, eval_dataset=test,
                      data_collator=collate, compute_metrics=accuracy)
    best = trainer.hyperparameter_search(
        hp_space=lambda _: {"learning_rate": tune.grid_search(cfg["learning_rates"])}, n_trials=1,
        compute_objective=objective, direction="maximize", backend="ray",
        max_concurrent_trials=cfg["asha_concurrency"],
        scheduler=ASHAScheduler(time_attr="training_iteration", max_t=8, grace_period=1,
                                reduction_factor=cfg["reduction_factor"]), **search_kwargs)
    analysis = tune.ExperimentAnalysis(f"{cfg['workdir']}/{name}/tune")
    steps = {str(df["run_id"].iloc[-1]): int(df["global_step"].iloc[-1])
             for df in analysis.trial_dataframes.values() if len(df)}
    return {"best_objective": best.objective, "best_lr": best.hyperparameters["learning_rate"],
            "steps_per_trial": steps, "total_steps": sum(steps.values()),
            "full_steps": N_TRIALS * EPOCHS * per_epoch}


# -- the driver ---------------------------------------------------------------------------------------
def run_side(side: str, cfg: dict, timeout: float, trees: dict[str, str]) -> dict:
    name, _, tree = side.partition("@")  # "rt1@before": side rt1, raytrainer from --tree before=PATH
    path = os.pathsep.join([HERE] + ([trees[tree]] if tree else []))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled", "PYTHONPATH": path}
    if tree:  # its own output folders and study
        cfg = {**cfg, "workdir": os.path.join(cfg["workdir"], tree)}
        os.makedirs(cfg["workdir"], exist_ok=True)
    out = os.path.join(cfg["workdir"], f"{name}.json")
    head = None
    if name in ("rt1_warm", "rt1_second"):  # a running head, started (and settled) before the side
        from bench_core import RayHead

        os.makedirs(os.path.join(cfg["workdir"], "logs"), exist_ok=True)
        head = RayHead(cfg["workdir"], 5.0, trees.get(tree))
        head.start()
        cfg = {**cfg, "ray_address": head.address, "study": name}  # a study of its own
    command = [sys.executable, os.path.abspath(__file__), "--side", "rt1" if head else name, "--cfg",
               json.dumps(cfg), "--side-out", out]
    try:
        if name == "rt1_second":  # the first run, not measured: it leaves its group for the second
            first_cfg = {**cfg, "study": "rt1_first"}  # a study of its own
            first_command = [*command[:4], "--cfg", json.dumps(first_cfg), *command[6:]]
            first = subprocess.run(first_command, env=env, timeout=timeout, capture_output=True, text=True,
                                   cwd=cfg["workdir"])
            if first.returncode != 0:
                sys.stderr.write(first.stdout[-3000:] + first.stderr[-5000:])
                return {"side": side, "error": first.returncode, "first_run": True}
        start = time.time()
        # run in the work dir: Ray's workers start in the driver's working directory and import from it
        # first, so a checkout's own folder there would shadow a --tree side's raytrainer
        proc = subprocess.run(command, env=env, timeout=timeout, capture_output=True, text=True,
                              cwd=cfg["workdir"])
        wall = time.time() - start
    finally:
        if head is not None:
            head.stop()
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        return {"side": side, "error": proc.returncode, "wall_s": wall}
    with open(out) as f:
        return {"side": side, "wall_s": round(wall, 1), **json.load(f)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--side")
    p.add_argument("--cfg")
    p.add_argument("--side-out")
    p.add_argument("--sides", default="hf,rt1,rt,rt_asha")
    p.add_argument("--out", default=None)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--workdir", default=None)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                   help="a raytrainer checkout for the sides SIDE@NAME (rt1@before)")
    p.add_argument("--reduction-factor", type=float, default=3, help="ASHA's (side rt_asha)")
    p.add_argument("--asha-concurrency", type=int, default=2, help="max_concurrent_trials of side rt_asha")
    a = p.parse_args()
    if a.side:
        sys.path.insert(0, HERE)
        result = globals()[f"side_{a.side}"](json.loads(a.cfg))
        with open(a.side_out, "w") as f:
            json.dump(result, f)
        return

    sys.path.insert(0, HERE)
    from _common import write_digits
    from _machine import machine_info, parse_trees

    workdir = a.workdir or tempfile.mkdtemp(prefix="bench-hpo-")
    digits = os.path.join(workdir, "digits.npz")
    write_digits(digits)
    cfg = {"workdir": workdir, "digits_path": digits, "learning_rates": learning_rates(),
           "reduction_factor": a.reduction_factor, "asha_concurrency": a.asha_concurrency}
    machine = machine_info(os.path.dirname(HERE))
    load_start = os.getloadavg()
    trees = parse_trees(a.tree, p.error)
    results = [run_side(side, cfg, a.timeout, trees) for side in a.sides.split(",")]
    record = {"machine": machine, "load_start": load_start, "load_end": os.getloadavg(), "config": cfg,
              "results": results}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=2)
    print(f"machine: {machine.get('cpu')}, {machine.get('nproc')} cores; load {load_start} -> "
          f"{record['load_end']}")
    print("| side | wall (s) | inside hyperparameter_search (s) | total training steps | best eval accuracy "
          "| best learning rate |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['side']} | failed ({r['error']}) after {r['wall_s']:.0f} s | | | | |")
            continue
        print(f"| {r['side']} | {r['wall_s']:.1f} | {r.get('search_s', '-')} | {r['total_steps']} | "
              f"{r['best_objective']:.4f} | "
              f"{r['best_lr']:.2e} |")


if __name__ == "__main__":
    main()
