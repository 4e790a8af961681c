"""raytrainer: the Hugging Face Trainer experience on Ray.

Change ``from transformers import Trainer, TrainingArguments`` to ``from raytrainer import ...``, set
``num_workers``, and the same script trains with DDP on Ray Train worker actors. Importing this package
imports neither Ray nor any distributed backend; they load when a run starts.
"""

from raytrainer import logging_utils as _logging_utils  # noqa: F401  (installs the library logger)
from raytrainer.args import TrainingArguments
from raytrainer.callbacks import (
    EarlyStoppingCallback,
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from raytrainer.data import default_data_collator
from raytrainer.hf_argparser import ArgumentParser
from raytrainer.trainer import Trainer
from raytrainer.trainer_utils import EvalPrediction, PredictionOutput, TrainOutput, set_seed

HfArgumentParser = ArgumentParser

__version__ = "0.1.0"

__all__ = [
    "ArgumentParser",
    "EarlyStoppingCallback",
    "EvalPrediction",
    "HfArgumentParser",
    "PredictionOutput",
    "PrinterCallback",
    "ProgressCallback",
    "TrainOutput",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingArguments",
    "default_data_collator",
    "set_seed",
]
