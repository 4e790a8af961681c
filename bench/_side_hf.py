"""Sides (e) and (f): transformers.Trainer in one process, or one of the ranks under torchrun (gloo)."""

import os
import sys

from _common import Recorder, build_dataset, build_model, collate, load_config, prepare, trainer_kwargs
from transformers import Trainer, TrainerCallback, TrainingArguments


class BenchCallback(Recorder, TrainerCallback):
    pass


def main() -> None:
    cfg = load_config(sys.argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    args = TrainingArguments(output_dir=cfg["output_dir"], report_to=[],
                             ddp_backend="gloo" if distributed else None, **trainer_kwargs(cfg))
    prepare(cfg)  # after the arguments: on a running cluster the workers start meanwhile
    recorder = BenchCallback()
    trainer = Trainer(model=build_model(cfg), args=args, train_dataset=build_dataset(cfg),
                      data_collator=collate, callbacks=[recorder])
    recorder.mark("train_called")
    trainer.train()


if __name__ == "__main__":
    main()
