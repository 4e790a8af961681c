"""Optional packages, imported where a feature needs them and named with the fix when missing.

A ``num_workers=0`` run needs only torch (and safetensors, pyarrow): Ray, DeepSpeed and Optuna load
when a run uses them, so the one-process path runs on a machine that has none of them.
"""

from __future__ import annotations

import importlib

INSTALL = {
    "ray": "pip install 'ray[train,tune]'",
    "deepspeed": "pip install deepspeed",
    "optuna": "pip install optuna",
    "transformers": "pip install transformers",
}


def require(module: str, needed_for: str):
    """Import ``module`` (e.g. ``"ray.train"``), or raise ImportError naming ``needed_for`` and the fix."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        raise ImportError(f"{needed_for} needs the {top!r} package, which is not installed here ({e}); "
                          f"install it: {INSTALL.get(top, f'pip install {top}')}") from e
