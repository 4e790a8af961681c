"""transformers.Trainer and raytrainer's Trainer side by side, in one process, on a tiny GPT-2: for each
setting of TrainingArguments, both train the same model on the same data, evaluate and predict, and the
script prints OK or what differs (the log history's keys and values, the trained weights, the train and eval
metrics, the prediction shapes). Timings and memory figures are not compared. A finding becomes a test in
tests/unit/test_lm_script_parity.py.

    .venv/bin/python bench/side_by_side.py              # every setting (about 2 minutes here)
    .venv/bin/python bench/side_by_side.py ga2 neftune  # some of them
    .venv/bin/python bench/side_by_side.py --workers 2 [settings]

With ``--workers 2``: transformers.Trainer under torchrun (2 processes, gloo; started fresh for each
setting, as users run it) against raytrainer's Trainer with ``num_workers=2`` (one Ray group, kept warm
between settings), each rank with ``per_device_train_batch_size`` 4: the same comparison, rank 0's view of
transformers' run against the driver's of raytrainer's. The evaluation set is then 16 rows, two full batches
of 8: on 12, transformers' loop on 2 ranks averages the loss of rank 1's batch over 4 real rows and the 4
repeated ones accelerate pads it with (eval_loss 3.1736 here), where raytrainer's gives one process's
(3.1641): a difference on purpose (docs/architecture.md), tested against one process in
tests/unit/test_evaluation_on_ranks.py.

Exits 1 when a setting differs (or one side raises where the other does not).
"""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
import tempfile
import types
import warnings

import numpy as np
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import raytrainer

# Not compared: how long things took, and the memory figures (each process's own).
UNCOMPARED = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "eval_runtime",
              "eval_samples_per_second", "eval_steps_per_second", "train_tokens_per_second", "total_flos",
              "test_runtime", "test_samples_per_second", "test_steps_per_second"}

SETTINGS = {
    "plain": {},
    "ga2": {"gradient_accumulation_steps": 2},
    "ga3_odd": {"gradient_accumulation_steps": 3, "max_steps": -1, "num_train_epochs": 1},
    "clip": {"max_grad_norm": 0.01},
    "no_clip": {"max_grad_norm": 0},
    "lr_big_clip": {"learning_rate": 1e-2, "max_grad_norm": 0.5},
    "wd_cosine_warmup": {"weight_decay": 0.1, "lr_scheduler_type": "cosine", "warmup_steps": 2},
    "warmup_ratio": {"warmup_steps": 0.5},
    "sched_kwargs": {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr": 1e-6}},
    "poly": {"lr_scheduler_type": "polynomial", "lr_scheduler_kwargs": {"power": 2.0}},
    "wsd": {"lr_scheduler_type": "warmup_stable_decay", "lr_scheduler_kwargs": {"num_decay_steps": 2},
            "warmup_steps": 1},
    "plateau": {"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "steps", "eval_steps": 2},
    "optim_sgd": {"optim": "sgd", "learning_rate": 0.1},
    "adafactor": {"optim": "adafactor"},
    "label_smoothing": {"label_smoothing_factor": 0.1},
    "avg_tokens_off": {"average_tokens_across_devices": False, "gradient_accumulation_steps": 2},
    "neftune": {"neftune_noise_alpha": 5.0},
    "bf16": {"bf16": True},
    "grad_ckpt": {"gradient_checkpointing": True},
    "use_cache": {"use_cache": True},
    "tokens_seen": {"include_num_input_tokens_seen": "non_padding"},
    "skip_memory": {"skip_memory_metrics": False},
    "logging_first_step": {"logging_steps": 4, "logging_first_step": True},
    "logging_epoch": {"logging_strategy": "epoch", "max_steps": -1, "num_train_epochs": 2},
    "epochs": {"max_steps": -1, "num_train_epochs": 2},
    "epochs_frac": {"max_steps": -1, "num_train_epochs": 1.5},
    "sequential": {"train_sampling_strategy": "sequential"},
    "group_by_length": {"train_sampling_strategy": "group_by_length"},  # differs on purpose (architecture.md)
    "data_seed": {"data_seed": 7},
    "drop_last": {"dataloader_drop_last": True, "per_device_train_batch_size": 5},
    "dl_workers": {"dataloader_num_workers": 1},
    "label_names": {"label_names": ["labels"]},
    "eval_steps": {"eval_strategy": "steps", "eval_steps": 2},
    "eval_epoch": {"eval_strategy": "epoch", "max_steps": -1, "num_train_epochs": 2},
    "eval_on_start": {"eval_on_start": True, "eval_strategy": "steps", "eval_steps": 3},
    "eval_delay": {"eval_strategy": "steps", "eval_steps": 1, "eval_delay": 3},
    "eval_accumulation": {"eval_accumulation_steps": 1},
    "eval_batch_odd": {"per_device_eval_batch_size": 5},
    "eval_no_concat": {"eval_do_concat_batches": False, "per_device_eval_batch_size": 5},
    "eval_batch_metrics": {"batch_eval_metrics": True, "per_device_eval_batch_size": 5},
    "eval_include_for_metrics": {"include_for_metrics": ["inputs", "loss"]},
    "prediction_loss_only": {"prediction_loss_only": True},
    "eval_loss_only_steps": {"prediction_loss_only": True, "eval_strategy": "steps", "eval_steps": 3},
    "best_model": {"eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps", "save_steps": 2,
                   "load_best_model_at_end": True, "metric_for_best_model": "loss"},
    "best_greater": {"eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps", "save_steps": 2,
                     "load_best_model_at_end": True, "metric_for_best_model": "mean_pred",
                     "greater_is_better": True},
    "save_best": {"eval_strategy": "steps", "eval_steps": 2, "save_strategy": "best",
                  "metric_for_best_model": "loss"},
    "save_total": {"save_strategy": "steps", "save_steps": 2, "save_total_limit": 1},
}


def tiny_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=2, n_positions=16, eos_token_id=0,
                        bos_token_id=0, pad_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return GPT2LMHeadModel(config)


def blocks(n: int, seed: int = 0) -> list[dict]:
    """Rows of 8 tokens whose last 0-2 positions are padding (attention_mask 0, label -100)."""
    ids = torch.randint(1, 40, (n, 8), generator=torch.Generator().manual_seed(seed))
    rows = []
    for i, row in enumerate(ids):
        mask = torch.ones(8, dtype=torch.long)
        mask[8 - i % 3:] = 0
        labels = row.clone()
        labels[mask == 0] = -100
        rows.append({"input_ids": row, "attention_mask": mask, "labels": labels})
    return rows


def mean_prediction(p, compute_result=None) -> dict:
    """A compute_metrics for every form transformers passes: arrays, tuples, lists of batches, tensors."""
    def as_array(x):
        x = x[0] if isinstance(x, tuple) else x
        return x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)

    preds = p.predictions
    if isinstance(preds, list):
        return {"mean_pred": float(np.mean([as_array(x).mean() for x in preds]))}
    return {"mean_pred": float(as_array(preds).mean())}


def run(trainer_cls, args_cls, setting: dict, output_dir: str, with_metrics: bool, workers: int = 0):
    """One side's record: the log history, the trained weights, the train and eval metrics, the prediction."""
    kwargs = dict(output_dir=output_dir, max_steps=6, per_device_train_batch_size=4, logging_steps=1,
                  report_to="none", disable_tqdm=True, use_cpu=True, save_strategy="no", seed=1)
    kwargs.update(setting)
    if args_cls is raytrainer.TrainingArguments:
        kwargs["num_workers"] = workers
    elif workers:
        kwargs["ddp_backend"] = "gloo"
    trainer = trainer_cls(model=tiny_gpt2(), args=args_cls(**kwargs), train_dataset=blocks(32),
                          eval_dataset=blocks(16 if workers else 12, seed=1),
                          compute_metrics=mean_prediction if with_metrics else None)
    train = trainer.train()
    evaluation, prediction = trainer.evaluate(), trainer.predict(blocks(6, seed=2))
    return types.SimpleNamespace(
        log_history=list(trainer.state.log_history), train=train.metrics, eval=evaluation,
        weights={k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        predictions=_shape(prediction.predictions))


def under_torchrun(name: str, workers: int) -> types.SimpleNamespace:
    """transformers' side of a setting, run by torchrun on ``workers`` processes; rank 0's record."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "record.pkl")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={workers}",
                               "--standalone",
                               os.path.abspath(__file__), "--rank-of", name, out],
                              env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"torchrun exited {done.returncode}: {done.stderr[-300:]}")
        with open(out, "rb") as f:
            return pickle.load(f)


def rank_of(name: str, out: str) -> None:
    """A torchrun process: transformers' side of setting ``name``; rank 0 writes the record to ``out``.
    Every rank's ``output_dir`` is one folder beside ``out``, as under torchrun on one machine: with a
    folder of its own, rank 1 found no best checkpoint to load at the end (rank 0 saves them) and evaluated
    the last weights where rank 0 evaluated the best."""
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    record = run(transformers.Trainer, transformers.TrainingArguments, SETTINGS[name],
                 os.path.join(os.path.dirname(out), "output"), _with_metrics(name),
                 workers=int(os.environ["WORLD_SIZE"]))
    if os.environ["RANK"] == "0":
        with open(out, "wb") as f:
            pickle.dump(record, f)


def _with_metrics(name: str) -> bool:
    return any(word in name for word in ("eval", "best", "label"))


def _close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, (float, int)):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-7)
    return a == b


def _shape(x):
    return tuple(_shape(v) for v in x) if isinstance(x, tuple) else getattr(x, "shape", None)


def differences(theirs, ours) -> list[str]:
    found = []
    strip = [[{k: v for k, v in e.items() if k not in UNCOMPARED} for e in side.log_history]
             for side in (theirs, ours)]
    values = [[{k: v for k, v in e.items() if "_mem_" not in k} for e in side] for side in strip]
    if [sorted(e) for e in strip[0]] != [sorted(e) for e in strip[1]]:
        found.append(f"log keys: transformers {[sorted(e) for e in strip[0]]}, "
                     f"raytrainer {[sorted(e) for e in strip[1]]}")
    else:
        found += [f"step {a.get('step')} {k}: transformers {a[k]!r}, raytrainer {b[k]!r}"
                  for a, b in zip(*values) for k in a if not _close(a[k], b[k])]
    for (name, a), b in zip(theirs.weights.items(), ours.weights.values()):
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-6):
            found.append(f"weight {name}: max difference {float((a - b).abs().max()):.3g}")
            break
    for what in ("train", "eval"):
        a, b = ({k: v for k, v in getattr(side, what).items() if k not in UNCOMPARED}
                for side in (theirs, ours))
        if sorted(a) != sorted(b):
            found.append(f"{what} metrics keys: transformers {sorted(a)}, raytrainer {sorted(b)}")
        elif "mem" not in " ".join(a):
            found += [f"{what} metrics {k}: transformers {a[k]}, raytrainer {b[k]}"
                      for k in a if not _close(a[k], b[k])]
    if theirs.predictions != ours.predictions:
        found.append(f"prediction shapes: transformers {theirs.predictions}, raytrainer {ours.predictions}")
    return found


def main(argv: list[str]) -> int:
    if argv[:1] == ["--rank-of"]:
        rank_of(*argv[1:3])
        return 0
    workers = 0
    if argv[:1] == ["--workers"]:
        workers, argv = int(argv[1]), argv[2:]
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    failed = 0
    for name, setting in SETTINGS.items():
        if argv and name not in argv:
            continue
        sides = []
        for trainer_cls, args_cls in ((transformers.Trainer, transformers.TrainingArguments),
                                      (raytrainer.Trainer, raytrainer.TrainingArguments)):
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    if workers and trainer_cls is transformers.Trainer:
                        sides.append(under_torchrun(name, workers))
                    else:
                        sides.append(run(trainer_cls, args_cls, setting, tmp, _with_metrics(name), workers))
                except Exception as exc:  # a side that raises is a finding too
                    sides.append(exc)
        if any(isinstance(side, Exception) for side in sides):
            same = all(isinstance(s, Exception) for s in sides) and str(sides[0]) == str(sides[1])
            found = [] if same else [f"transformers: {sides[0]!r:.300}", f"raytrainer: {sides[1]!r:.300}"]
        else:
            found = differences(*sides)
        verdict = "differs" if found else "OK"
        failed += verdict == "differs"
        print(f"[{name}] {verdict}", *(f"    {line}" for line in found[:10]), sep="\n", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
