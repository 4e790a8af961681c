"""Shared fixtures for the in-process unit tests: tiny models, tiny datasets, quiet TrainingArguments.

Everything here runs in the test's own process (``num_workers=0``, no Ray) and takes milliseconds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from raytrainer import TrainingArguments


class TinyClassifier(nn.Module):
    """A linear classifier in the HF model style: ``{"loss", "logits"}`` with labels, ``{"logits"}`` without.

    No dropout and no randomness in forward, so two runs from the same weights on the same batches agree.
    """

    def __init__(self, in_features: int = 4, num_classes: int = 3):
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        if labels is None:
            return {"logits": logits}
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def classification_data(n: int, in_features: int = 4, num_classes: int = 3, seed: int = 0):
    """``n`` random feature rows and integer labels, reproducible from ``seed``.

    The first feature of row ``i`` is ``i`` itself, so a batch tells which examples it holds.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=g)
    x[:, 0] = torch.arange(n, dtype=torch.float32)
    y = torch.randint(0, num_classes, (n,), generator=g)
    return x, y


def as_examples(x: torch.Tensor, y: torch.Tensor | None = None, **extra_columns) -> list[dict]:
    """A list of dict examples ``{"x": ..., "labels": ...}`` (plus per-example extra columns)."""
    examples = []
    for i in range(len(x)):
        example = {"x": x[i]}
        if y is not None:
            example["labels"] = y[i]
        for name, values in extra_columns.items():
            example[name] = values[i]
        examples.append(example)
    return examples


@pytest.fixture
def make_args(tmp_path):
    """``make_args(**overrides)``: quiet in-process TrainingArguments writing under ``tmp_path``."""

    def make(**overrides) -> TrainingArguments:
        kwargs = {
            "output_dir": str(tmp_path),
            "num_workers": 0,
            "save_strategy": "no",
            "report_to": "none",
            "disable_tqdm": True,
        }
        kwargs.update(overrides)
        return TrainingArguments(**kwargs)

    return make


@pytest.fixture
def make_classifier():
    """``make_classifier(in_features=4, num_classes=3, seed=0)``: a TinyClassifier with seeded weights."""

    def make(in_features: int = 4, num_classes: int = 3, seed: int = 0) -> TinyClassifier:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return TinyClassifier(in_features, num_classes)

    return make


@pytest.fixture
def make_examples():
    """``make_examples(n, in_features=4, num_classes=3, seed=0)`` -> (list of dicts, x, y)."""

    def make(n: int, in_features: int = 4, num_classes: int = 3, seed: int = 0):
        x, y = classification_data(n, in_features, num_classes, seed)
        return as_examples(x, y), x, y

    return make


@pytest.fixture(scope="session")
def digits():
    """scikit-learn's bundled 8x8 digits (no download): features scaled to [0, 1] and int64 labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.from_numpy((data.data / 16.0).astype(np.float32))
    y = torch.from_numpy(data.target.astype(np.int64))
    return x, y


def state_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the model's weights, to compare before and after."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), f"{k} differs: max {(a[k] - b[k]).abs().max()}"


@pytest.fixture
def weights():
    """Helpers ``weights.copy(model)`` and ``weights.assert_same(a, b, atol=0)``."""

    class _Weights:
        copy = staticmethod(state_copy)
        assert_same = staticmethod(assert_same_weights)

    return _Weights()


@pytest.fixture
def gloo_group():
    """A real one-rank gloo process group in this process (FSDP's and DCP's collectives run on it)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
    yield
    dist.destroy_process_group()
