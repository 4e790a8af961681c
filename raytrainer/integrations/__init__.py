"""``report_to``: transformers' own integration callbacks, each value logged once.

raytrainer writes no tracker code: ``report_to`` takes the names transformers knows
(``transformers.integrations.INTEGRATION_TO_CALLBACK``: ``tensorboard``, ``mlflow``, ``wandb``, ``trackio``,
``codecarbon``, ``comet_ml``, ``dvclive``, ...) and the callbacks are transformers' classes, configured by
transformers' environment variables. What raytrainer decides is where they run:

- with ``num_workers=0`` they run in place, as in transformers;
- on Ray workers they run where transformers runs them under ``accelerate launch``: on world rank 0 (each
  rank builds the trainer from the constructor's arguments, its trackers anew from ``report_to``; the other
  ranks' ``state.is_world_process_zero`` is False, so each value is logged once), so a worker needs the
  tracker's package, as a node under ``torchrun`` does (decided: what a TRL user sees under ``accelerate
  launch``); the trackers' settings in the driver's environment (``TRACKER_ENV``: ``WANDB_PROJECT``,
  ``MLFLOW_TRACKING_URI``, ``TENSORBOARD_LOGGING_DIR``, a tracker's API key, ...) are set on every rank for
  each call, as torchrun's ranks inherit its shell's (a running cluster's workers do not inherit the
  script's environment; a local instance's only what was set before it started);
- in a hyperparameter search each trial gets new instances (``for_trial``): one tracker run per trial, with
  ``state.is_hyper_param_search``, ``trial_name`` and ``trial_params`` set as transformers sets them.

A name transformers does not know, or one whose package is missing, is refused when the Trainer is built,
before anything starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from raytrainer.callbacks import TrainerCallback, runs_on_driver  # runs_on_driver: re-exported

__all__ = ["PACKAGES", "TRACKER_ENV", "for_trial", "get_available_reporting_integrations",
           "get_reporting_integration_callbacks", "is_tracker", "reporting_callbacks", "runs_on_driver"]

_HF = "transformers.integrations.integration_utils"

#: The prefixes of the environment variables transformers' trackers read when their callbacks start
#: (integration_utils: ``WANDB_PROJECT``, ``MLFLOW_TRACKING_URI``, ``HF_MLFLOW_LOG_ARTIFACTS``,
#: ``TENSORBOARD_LOGGING_DIR``, ``COMET_PROJECT_NAME``, ...), each tracker's own library's included (its API
#: key). Never the Hub's token: only the driver pushes (driver/ray_runtime._SECRETS).
TRACKER_ENV = ("TENSORBOARD_", "WANDB_", "MLFLOW_", "HF_MLFLOW_", "COMET_", "NEPTUNE_", "CLEARML_",
               "DVCLIVE_", "HF_DVCLIVE_", "SWANLAB_", "TRACKIO_", "HF_DAGSHUB_", "DAGSHUB_", "CODECARBON_",
               "AZUREML_")


def tracker_environment() -> tuple[tuple[str, str], ...]:
    """The trackers' settings in this process's environment (``TRACKER_ENV``), for the ranks."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(TRACKER_ENV)))

#: What each of transformers' ``report_to`` names imports ("a|b": either) and what to ``pip install``.
#: A name transformers adds later and this table lacks is still accepted: its callback's own check applies.
PACKAGES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "azure_ml": (("azureml.core",), "azureml-core"),
    "clearml": (("clearml",), "clearml"),
    "codecarbon": (("codecarbon",), "codecarbon"),
    "comet_ml": (("comet_ml",), "comet-ml"),
    "dagshub": (("dagshub", "mlflow"), "dagshub mlflow"),
    "dvclive": (("dvclive",), "dvclive"),
    "flyte": (("flytekit",), "flytekit"),
    "kubeflow": ((), None),  # talks HTTP to the Kubeflow Trainer controller: no package
    "mlflow": (("mlflow",), "mlflow"),  # mlflow-skinny provides the same module
    "neptune": (("neptune",), "neptune"),
    "swanlab": (("swanlab",), "swanlab"),
    "tensorboard": (("tensorboard|tensorboardX",), "tensorboard"),
    "trackio": (("trackio",), "trackio"),
    "wandb": (("wandb",), "wandb"),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # "a.b" whose parent "a" is missing
        return False


def _missing(name: str) -> list[str]:
    modules, _ = PACKAGES.get(name, ((), None))
    return [m.split("|")[0] for m in modules if not any(_installed(alt) for alt in m.split("|"))]


def _names(report_to) -> list[str]:
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    return [] if names in (["none"], []) else names


def get_available_reporting_integrations() -> list[str]:
    """transformers' answer: the integrations installed (and configured) here -- what ``"all"`` means."""
    return importlib.import_module(_HF).get_available_reporting_integrations()


def get_reporting_integration_callbacks(report_to) -> list[type]:
    """transformers' callback classes for ``report_to`` (a name, a list of names, ``"all"`` or ``"none"``).

    An unknown name (listing the known ones) and a missing package (naming it and the pip command) are
    ValueErrors, raised where the Trainer is built. Nothing is imported for ``"none"``."""
    names = _names(report_to)
    if not names:
        return []
    hf = importlib.import_module(_HF)
    if "all" in names:
        names = hf.get_available_reporting_integrations()
    known = hf.INTEGRATION_TO_CALLBACK
    for name in names:
        if name not in known:
            raise ValueError(
                f"report_to={name!r} is not an integration transformers knows. Use one of "
                f"{', '.join(sorted(known))}; 'all' (every installed one) or 'none'.")
        missing = _missing(name)
        if missing:
            pip = PACKAGES[name][1]
            raise ValueError(
                f"report_to={name!r} needs the {missing[0]!r} package, which is not installed here: "
                f"pip install {pip} (on the machine that runs the script; the workers do not need it), "
                f"or drop {name!r} from report_to.")
    return [known[name] for name in names]


def reporting_callbacks(args) -> list[TrainerCallback]:
    """Instances of ``args.report_to``'s callbacks, built as transformers' Trainer builds them."""
    return [_new(cls, args) for cls in get_reporting_integration_callbacks(args.report_to)]


def _new(cls: type, args) -> TrainerCallback:
    if "://" not in str(args.output_dir):
        # transformers' Trainer.__init__ has made output_dir before on_init_end, where codecarbon's
        # tracker is built to write there
        os.makedirs(args.output_dir, exist_ok=True)
    return cls()  # TensorBoard's folder: TENSORBOARD_LOGGING_DIR, else output_dir/runs/<time>_<host>


def is_tracker(callback) -> bool:
    """Whether ``callback`` is one of transformers' ``report_to`` callbacks (or a subclass of one)."""
    hf = sys.modules.get(_HF)  # not imported: no instance of its classes can exist
    return hf is not None and isinstance(callback, tuple(hf.INTEGRATION_TO_CALLBACK.values()))


def for_trial(callback, args):
    """A search trial's own tracker: a new instance of ``callback``'s class (one tracker run per trial, as
    transformers' callbacks start one per trial); None when ``callback`` is not a tracker."""
    if is_tracker(callback):
        return _new(type(callback), args)
    return None
