"""``report_to`` integrations: experiment trackers fed with the Trainer's logs.

Each integration is a ``TrainerCallback`` with ``on_driver = True``: on a Ray run it runs once, in the
driver's process, on world rank 0's relayed events (never once per worker); with ``num_workers=0`` it
runs in-process. The tracker's package is imported only when the integration is used.

==============  ==========================  =====================================================
report_to       package                     where it writes
==============  ==========================  =====================================================
tensorboard     tensorboard                 ``logging_dir`` (default ``output_dir/runs/<time>_<host>``)
mlflow          mlflow or mlflow-skinny     ``MLFLOW_TRACKING_URI`` (default ``output_dir/mlruns``)
wandb           wandb                       W&B (``WANDB_MODE=offline`` keeps it local)
==============  ==========================  =====================================================
"""

from __future__ import annotations

import importlib.util

INTEGRATIONS = {
    # name: (module with the callback, class name, package to import, pip name)
    "tensorboard": ("raytrainer.integrations.tensorboard", "TensorBoardCallback", "tensorboard",
                    "tensorboard"),
    "mlflow": ("raytrainer.integrations.mlflow", "MLflowCallback", "mlflow", "mlflow-skinny"),
    "wandb": ("raytrainer.integrations.wandb", "WandbCallback", "wandb", "wandb"),
}

__all__ = ["INTEGRATIONS", "get_available_reporting_integrations", "get_reporting_integration_callbacks"]


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def get_available_reporting_integrations() -> list[str]:
    return [name for name, (_, _, package, _) in INTEGRATIONS.items() if _installed(package)]


def get_reporting_integration_callbacks(report_to: list[str] | str | None) -> list[type]:
    """The callback classes for ``report_to`` ("all": every installed one). Unknown names and missing
    packages are errors that say what to do -- raised when the Trainer is built, before any worker starts."""
    import importlib

    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if names == ["none"]:
        return []
    if "all" in names:
        names = get_available_reporting_integrations()
    classes = []
    for name in names:
        if name not in INTEGRATIONS:
            raise ValueError(
                f"report_to={name!r} is not a known integration. Use one of "
                f"{', '.join(sorted(INTEGRATIONS))}, 'all' (every installed one) or 'none'."
            )
        module, cls, package, pip_name = INTEGRATIONS[name]
        if not _installed(package):
            raise ValueError(
                f"report_to={name!r} needs the {package!r} package, which is not installed: "
                f"pip install {pip_name} (or drop {name!r} from report_to)."
            )
        classes.append(getattr(importlib.import_module(module), cls))
    return classes
