"""A worker's process state after a command is put back as the fresh worker had it (worker/entry.py), so a
command -- a search trial -- gives the same result whatever ran before it on the same worker."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from raytrainer.trainer_utils import enable_full_determinism, set_seed
from raytrainer.worker.entry import ProcessState


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_a_command_leaves_nothing_the_next_one_sees(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("RAYTRAINER_TEST_LEFTOVER", raising=False)
    fresh = ProcessState()
    expected = _draws()
    fresh.restore()
    flags_before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32,
                    torch.backends.cudnn.benchmark, torch.get_default_dtype())

    # what one command may do: seed, turn on full determinism, change flags, dtype and environment
    set_seed(123)
    enable_full_determinism(7)  # full_determinism, as transformers sets it
    torch.backends.cuda.matmul.allow_tf32 = not torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    torch.set_default_dtype(torch.float64)
    os.environ["RAYTRAINER_TEST_LEFTOVER"] = "1"
    _draws()
    assert torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" in os.environ

    fresh.restore()
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.benchmark, torch.get_default_dtype()) == flags_before
    assert "RAYTRAINER_TEST_LEFTOVER" not in os.environ and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert _draws() == expected  # the random generators are where the fresh process had them
