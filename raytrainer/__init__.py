"""raytrainer: the Hugging Face Trainer experience on Ray.

Change ``from transformers import Trainer, TrainingArguments`` to ``from raytrainer import ...``, set
``num_workers``, and the same script trains with DDP on Ray Train worker actors.

Names load on first use (PEP 562), so importing a light submodule -- as the event-channel actor does --
does not import torch, and importing the package imports neither Ray nor any distributed backend.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ArgumentParser": "raytrainer.hf_argparser",
    "HfArgumentParser": "raytrainer.hf_argparser",
    "RayArgumentsMixin": "raytrainer.args",
    "TrainingArguments": "raytrainer.args",
    "DefaultFlowCallback": "raytrainer.callbacks",
    "EarlyStoppingCallback": "raytrainer.callbacks",
    "ExportableState": "raytrainer.callbacks",
    "PrinterCallback": "raytrainer.callbacks",
    "ProgressCallback": "raytrainer.callbacks",
    "TrainerCallback": "raytrainer.callbacks",
    "TrainerControl": "raytrainer.callbacks",
    "TrainerState": "raytrainer.callbacks",
    "default_data_collator": "raytrainer.data",
    "Seq2SeqTrainer": "raytrainer.one_loop",
    "Seq2SeqTrainingArguments": "raytrainer.seq2seq",
    "Trainer": "raytrainer.one_loop",
    "config_on_ray": "raytrainer.hosted",
    "on_ray": "raytrainer.hosted",
    "EvalPrediction": "raytrainer.trainer_utils",
    "PredictionOutput": "raytrainer.trainer_utils",
    "TrainOutput": "raytrainer.trainer_utils",
    "set_seed": "raytrainer.trainer_utils",
    "shutdown": "raytrainer.driver.group",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raytrainer' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    value = getattr(module, "ArgumentParser" if name == "HfArgumentParser" else name)
    globals()[name] = value
    return value


def start_workers_early(args) -> None:
    """Called by the arguments (``RayArgumentsMixin.__post_init__``) when they commit the script to Ray
    workers: on a running cluster the workers start now, while the script prepares
    (driver/ray_train.start_early). Wired here, in the package, so that the arguments never import the
    driver that runs them (tests/unit/test_layers.py)."""
    importlib.import_module("raytrainer.driver.ray_train").start_early(args)


def __dir__():
    return sorted(list(globals()) + __all__)


importlib.import_module("raytrainer.logging_utils")  # installs the library logger (stdlib only)
