"""The model card (``README.md``) pushed with the model: hyperparameters, final metrics, training log.

Follows the card ``transformers.Trainer.create_model_card`` writes: YAML metadata, the evaluation results,
the training hyperparameters, a "Training results" table with one row per evaluation (the latest training
loss, epoch, step, validation loss and metrics) and the framework versions.
"""

from __future__ import annotations

import importlib.metadata
import json

_SKIP_EVAL = {"runtime", "samples_per_second", "steps_per_second", "epoch", "step"}


def _title(key: str) -> str:
    return " ".join(part.capitalize() for part in key.split("_"))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def parse_log_history(log_history: list[dict]) -> tuple[list[dict], dict | None]:
    """(rows of the results table, the last evaluation's metrics) -- HF's ``parse_log_history``."""
    rows, training_loss, last_eval = [], "No log", None
    for entry in log_history:
        if "loss" in entry:
            training_loss = entry["loss"]
        if "eval_loss" in entry:
            row = {"Training Loss": training_loss, "Epoch": entry.get("epoch"), "Step": entry.get("step")}
            for key, value in entry.items():
                if key.startswith("eval_") and key[5:] not in _SKIP_EVAL:
                    row["Validation Loss" if key == "eval_loss" else _title(key[5:])] = value
            rows.append(row)
            last_eval = {_title(k[5:]): v for k, v in entry.items()
                         if k.startswith("eval_") and k[5:] not in _SKIP_EVAL}
    return rows, last_eval


def markdown_table(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(":---:" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def hyperparameters(args) -> dict:
    world = max(1, args.num_workers)
    out = {
        "learning_rate": args.learning_rate,
        "train_batch_size": args.per_device_train_batch_size,
        "eval_batch_size": args.per_device_eval_batch_size,
        "seed": args.seed,
    }
    if world > 1:
        out["distributed_type"] = "ray-train"
        out["num_workers"] = world
    if args.gradient_accumulation_steps > 1:
        out["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    total = args.per_device_train_batch_size * world * args.gradient_accumulation_steps
    if total != args.per_device_train_batch_size:
        out["total_train_batch_size"] = total
    optim = getattr(args.optim, "value", args.optim)
    out["optimizer"] = (f"{optim} with betas=({args.adam_beta1},{args.adam_beta2}), "
                        f"epsilon={args.adam_epsilon} and weight_decay={args.weight_decay}")
    out["lr_scheduler_type"] = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    if args.warmup_steps:  # a count, or a ratio of the steps when below 1 (transformers 5)
        out["lr_scheduler_warmup"] = args.warmup_steps
    if args.max_steps > 0:
        out["training_steps"] = args.max_steps
    else:
        out["num_epochs"] = args.num_train_epochs
    if args.bf16 or args.fp16:
        out["mixed_precision_training"] = "bf16" if args.bf16 else "fp16"
    return out


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def model_card(trainer, model_name: str, language=None, license=None, tags=None, finetuned_from=None,
               tasks=None, dataset=None, **_ignored) -> str:
    args, state = trainer.args, trainer.state
    rows, last_eval = parse_log_history(state.log_history)
    tags = [tags] if isinstance(tags, str) else list(tags or [])
    meta = {"library_name": "raytrainer", "license": license, "language": language,
            "base_model": finetuned_from, "datasets": dataset, "pipeline_tag": tasks,
            "tags": ["generated_from_trainer", "raytrainer", *tags],
            "model-index": [{"name": model_name, "results": []}]}
    front = "\n".join(f"{k}: {json.dumps(v)}" for k, v in meta.items() if v is not None)
    parts = [f"---\n{front}\n---\n", f"# {model_name}\n"]
    about = (f"This model is a fine-tuned version of {finetuned_from}" if finetuned_from
             else "This model was trained")
    parts.append(about + (f" on the {dataset} dataset." if dataset else " on an unknown dataset."))
    if last_eval:
        parts.append("It achieves the following results on the evaluation set:\n"
                     + "\n".join(f"- {k}: {_fmt(v)}" for k, v in last_eval.items()))
    parts.append("## Training procedure\n\n### Training hyperparameters\n\n"
                 "The following hyperparameters were used during training:\n"
                 + "\n".join(f"- {k}: {v}" for k, v in hyperparameters(args).items()))
    if rows:
        parts.append("### Training results\n\n" + markdown_table(rows))
    else:
        train_logs = [e for e in state.log_history if "loss" in e]
        if train_logs:
            table = [{"Training Loss": e["loss"], "Epoch": e.get("epoch"), "Step": e.get("step")}
                     for e in train_logs]
            parts.append("### Training results\n\n" + markdown_table(table))
    packages = (("raytrainer", "raytrainer"), ("Ray", "ray"), ("Pytorch", "torch"),
                ("Transformers", "transformers"))
    versions = [(name, _version(pkg)) for name, pkg in packages]
    parts.append("### Framework versions\n\n" + "\n".join(f"- {n} {v}" for n, v in versions if v))
    return "\n\n".join(parts) + "\n"
