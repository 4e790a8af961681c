"""Helpers shared by the integrations."""

from __future__ import annotations

import numbers


def rewrite_logs(logs: dict) -> dict:
    """HF's metric names for trackers: ``eval_loss`` -> ``eval/loss``, ``loss`` -> ``train/loss``."""
    out = {}
    for key, value in logs.items():
        for prefix in ("eval_", "test_"):
            if key.startswith(prefix):
                out[f"{prefix[:-1]}/{key[len(prefix):]}"] = value
                break
        else:
            out[f"train/{key}"] = value
    return out


def numeric(logs: dict) -> dict[str, float]:
    """The values a tracker can plot (numbers, not bools or strings)."""
    return {k: float(v) for k, v in logs.items() if isinstance(v, numbers.Real) and not isinstance(v, bool)}
