"""Small public types and helpers shared by the driver and the workers (HF-compatible names)."""

from __future__ import annotations

import os
import random
import time
from typing import Any, NamedTuple

import numpy as np

PREFIX_CHECKPOINT_DIR = "checkpoint"


class BestRun(NamedTuple):
    """HF's ``BestRun``: the best trial's id, objective, hyperparameters, and a summary of its run."""

    run_id: str
    objective: float | list[float]
    hyperparameters: dict[str, Any]
    run_summary: Any = None


class EvalPrediction:
    """What ``compute_metrics`` receives: predictions, label_ids and, when asked for, inputs and losses.

    Behaves like HF's: it can be unpacked as ``predictions, label_ids = eval_pred``.
    """

    def __init__(self, predictions, label_ids, inputs=None, losses=None):
        self.predictions = predictions
        self.label_ids = label_ids
        self.inputs = inputs
        self.losses = losses
        self.elements = (predictions, label_ids)
        if inputs is not None:
            self.elements += (inputs,)
        if losses is not None:
            self.elements += (losses,)

    def __iter__(self):
        return iter(self.elements)

    def __getitem__(self, idx):
        return self.elements[idx]

    def __len__(self):
        return len(self.elements)


class EvalLoopOutput(NamedTuple):
    predictions: Any
    label_ids: Any
    metrics: dict[str, float] | None
    num_samples: int | None


class PredictionOutput(NamedTuple):
    predictions: Any
    label_ids: Any
    metrics: dict[str, float] | None


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict[str, float]


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device), as HF's ``set_seed``."""
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def seed_worker(worker_id: int) -> None:
    """DataLoader worker init: give each loader process its own deterministic seed."""
    import torch

    set_seed(torch.initial_seed() % 2**32)


def speed_metrics(split: str, start_time: float, num_samples: int | None = None,
                  num_steps: int | None = None) -> dict[str, float]:
    """``<split>_runtime``, ``<split>_samples_per_second`` and ``<split>_steps_per_second`` as in HF."""
    runtime = time.time() - start_time
    result = {f"{split}_runtime": round(runtime, 4)}
    if runtime == 0:
        return result
    if num_samples is not None:
        result[f"{split}_samples_per_second"] = round(num_samples / runtime, 3)
    if num_steps is not None:
        result[f"{split}_steps_per_second"] = round(num_steps / runtime, 3)
    return result


def denumpify_detensorize(metrics):
    """Turn numpy scalars / 0-d tensors in a (nested) metrics structure into python numbers."""
    if isinstance(metrics, (list, tuple)):
        return type(metrics)(denumpify_detensorize(m) for m in metrics)
    if isinstance(metrics, dict):
        return type(metrics)({k: denumpify_detensorize(v) for k, v in metrics.items()})
    if isinstance(metrics, np.generic):
        return metrics.item()
    if hasattr(metrics, "numel") and hasattr(metrics, "item") and metrics.numel() == 1:
        return metrics.item()
    return metrics


def has_length(dataset) -> bool:
    try:
        return len(dataset) is not None
    except (TypeError, AttributeError, NotImplementedError):  # ray.data.Dataset raises AttributeError
        return False


class MemoryTracker:
    """Host (and CUDA when present) memory deltas for the ``skip_memory_metrics=False`` metrics.

    Gives HF's ``<stage>_mem_cpu_alloc_delta``, ``<stage>_mem_cpu_peaked_delta`` (and the ``gpu`` pair on
    CUDA). CPU figures come from the process RSS: the peak is sampled by a background thread.
    """

    def __init__(self, skip: bool):
        self.skip = skip
        self._stage = None
        self._start = {}
        self._peak = 0
        self._thread = None
        self._running = False
        self.metrics: dict[str, int] = {}

    @staticmethod
    def _rss() -> int:
        import psutil

        return psutil.Process().memory_info().rss

    def _sample(self):
        while self._running:
            self._peak = max(self._peak, self._rss())
            time.sleep(0.005)

    def start(self, stage: str) -> None:
        if self.skip or self._stage is not None:
            return
        import threading

        import torch

        self._stage = stage
        self._start["cpu"] = self._peak = self._rss()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self._start["gpu"] = torch.cuda.memory_allocated()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def stop(self, stage: str) -> dict[str, int]:
        if self.skip or self._stage != stage:
            return {}
        import torch

        self._running = False
        self._thread.join()
        end = self._rss()
        out = {
            f"{stage}_mem_cpu_alloc_delta": end - self._start["cpu"],
            f"{stage}_mem_cpu_peaked_delta": max(0, self._peak - end),
        }
        if "gpu" in self._start:
            gpu_end = torch.cuda.memory_allocated()
            out[f"{stage}_mem_gpu_alloc_delta"] = gpu_end - self._start["gpu"]
            out[f"{stage}_mem_gpu_peaked_delta"] = max(0, torch.cuda.max_memory_allocated() - gpu_end)
        self._stage = None
        self.metrics.update(out)
        return out
