"""Sides (b), (c), (d), (d_warm): raytrainer with num_workers 0, 1, 2 (and 2 on a running Ray instance)."""

import sys

from _common import Recorder, build_dataset, build_model, collate, load_config, prepare, trainer_kwargs

from raytrainer import Trainer, TrainerCallback, TrainingArguments


class BenchCallback(Recorder, TrainerCallback):
    pass


def main() -> None:
    cfg = load_config(sys.argv)
    args = TrainingArguments(output_dir=cfg["output_dir"], report_to="none", num_workers=cfg["num_workers"],
                             ray_address=cfg.get("ray_address"),
                             keep_workers_s=cfg.get("keep_workers_s", 300.0), **trainer_kwargs(cfg))
    prepare(cfg)  # after the arguments: on a running cluster the workers start meanwhile
    recorder = BenchCallback()
    trainer = Trainer(model=build_model(cfg), args=args, train_dataset=build_dataset(cfg),
                      data_collator=collate, callbacks=[recorder])
    recorder.mark("train_called")
    trainer.train()  # like a user's script: Ray (when it started one) stops at interpreter exit


if __name__ == "__main__":
    main()
