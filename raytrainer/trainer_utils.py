"""Small public types and helpers shared by the driver and the workers: transformers' own
(``transformers.trainer_utils``), re-exported here so that raytrainer's import sites stay.

Only ``MemoryTracker`` is raytrainer's: transformers' ``TrainerMemoryTracker`` names its stage after the
calling method (``train``, ``_inner_training_loop``, ``evaluate``, ...), which raytrainer's per-rank loop does
not share, and samples the peak in a thread that never sleeps (a whole core on a small worker).
"""

from __future__ import annotations

import time

from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    BestRun,
    EvalLoopOutput,
    EvalPrediction,
    HPSearchBackend,
    HubStrategy,
    IntervalStrategy,
    PredictionOutput,
    SaveStrategy,
    SchedulerType,
    TrainOutput,
    denumpify_detensorize,
    enable_full_determinism,
    get_last_checkpoint,
    has_length,
    seed_worker,
    set_seed,
    speed_metrics,
)

__all__ = [
    "PREFIX_CHECKPOINT_DIR",
    "BestRun",
    "EvalLoopOutput",
    "EvalPrediction",
    "HPSearchBackend",
    "HubStrategy",
    "IntervalStrategy",
    "MemoryTracker",
    "PredictionOutput",
    "SaveStrategy",
    "SchedulerType",
    "TrainOutput",
    "denumpify_detensorize",
    "enable_full_determinism",
    "get_last_checkpoint",
    "has_length",
    "seed_worker",
    "set_seed",
    "speed_metrics",
]


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
        if stage == "init":  # as transformers: the memory in use when the Trainer was made
            out["before_init_mem_cpu"] = self._start["cpu"]
            if "gpu" in self._start:
                out["before_init_mem_gpu"] = self._start["gpu"]
        self._stage = None
        self.metrics.update(out)
        return out
