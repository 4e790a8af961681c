"""The run spec of a call (``protocol.Spec``): the Trainer pickled for the ranks, the call's arguments as
they will run, and what the driver learnt for the ranks (a Ray Dataset's rows, counted once; evaluation sets
that are Ray Datasets, read into rows). Built after ``driver/preflight`` has checked the call."""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Mapping

import cloudpickle

from raytrainer import data as rdata
from raytrainer import meta_model
from raytrainer.protocol import Spec
from raytrainer.worker.logs import driver_transformers_level
from raytrainer.worker.place import driver_place


def build(trainer, method: str, kwargs: dict) -> Spec:
    """The spec of ``trainer.<method>(**kwargs)`` on Ray workers."""
    rows = None
    if method == "train" and rdata.is_ray_dataset(trainer.train_dataset):
        rows = trainer.train_dataset.count()  # sizes the epoch on every rank without a recount
    kwargs = {key: _materialized(value) if key in ("eval_dataset", "test_dataset") else value
              for key, value in kwargs.items()}
    return Spec(pickled_trainer(trainer, kwargs, method), kwargs, rows, driver_transformers_level(),
                *driver_place())


def _materialized(dataset):
    """A Ray Dataset used for evaluation, read once here into rows.

    Evaluation needs every example once and in order; and a worker cannot read a Ray Dataset itself:
    Ray Data's tasks would wait for CPUs inside the Ray Train placement group that the workers hold.
    """
    if rdata.is_ray_dataset(dataset):
        return dataset.take_all()
    if isinstance(dataset, Mapping):
        return {k: _materialized(v) for k, v in dataset.items()}
    return dataset


def pickled_trainer(trainer, kwargs: dict, method: str = "train") -> bytes:
    """The Trainer pickled for the workers; on failure, the error names the object that fails.

    ``train`` with ``model_init`` ships no model: every worker builds its own (``training_loop``), so the
    driver's instance -- built, as HF does, in ``Trainer.__init__`` -- never crosses the network. Nor does
    evaluate/predict's while the driver holds a weightless skeleton (raytrainer.meta_model): the workers build
    the model under the run's seed, as the driver's ``Trainer.__init__`` would have."""
    shipped = copy.copy(trainer)  # workers may run in another directory: paths become absolute
    skeleton = "_pending_weights" not in vars(trainer) and meta_model.is_skeleton(vars(trainer).get("_model"))
    if trainer.model_init is not None and (method == "train" or skeleton):
        shipped.model = shipped.model_wrapped = None
        shipped.callback_handler = copy.copy(trainer.callback_handler)
        shipped.callback_handler.model = None
    shipped.eval_dataset = _materialized(trainer.eval_dataset)
    shipped.args = copy.copy(trainer.args)
    shipped.args.output_dir = os.path.abspath(trainer.args.output_dir)
    if shipped.args.storage_path and "://" not in shipped.args.storage_path:
        shipped.args.storage_path = os.path.abspath(shipped.args.storage_path)
    ship_dynamic_modules()
    try:
        cloudpickle.dumps(kwargs)
        return cloudpickle.dumps(shipped)
    except Exception as exc:
        culprit = _find_unpicklable(trainer, kwargs)
        raise ValueError(
            f"{culprit} cannot be pickled to send it to the Ray workers ({type(exc).__name__}: {exc}). "
            "Define functions and classes at module level, and keep locks, open files, sockets and "
            "generators out of models, datasets and callbacks (or build them inside model_init / the "
            "dataset's __getitem__)."
        ) from exc


#: Packages that transformers, evaluate and datasets create at run time from code under ``HF_HOME/modules``
#: (a Hub model's ``trust_remote_code`` classes, an ``evaluate.load`` metric, a data set's loading script).
#: A worker on another node has no such folder, and one on this node not on its ``sys.path``.
DYNAMIC_MODULE_PACKAGES = ("transformers_modules", "evaluate_modules", "datasets_modules")


def ship_dynamic_modules() -> None:
    """Let the classes and functions of those packages travel by value (their source with them), as
    cloudpickle does for ``__main__``: a ``compute_metrics`` holding an ``evaluate`` metric then unpickles on
    every worker (transformers' example scripts load theirs that way)."""
    for name in DYNAMIC_MODULE_PACKAGES:
        module = sys.modules.get(name)
        if module is not None:
            cloudpickle.register_pickle_by_value(module)


def _find_unpicklable(trainer, kwargs: dict) -> str:
    candidates = [(f"{name}=", value) for name, value in kwargs.items()]
    for name, value in vars(trainer).items():
        if name == "callback_handler":
            candidates += [(f"callback {type(cb).__name__}", cb) for cb in value.callbacks]
        else:
            candidates.append((f"Trainer.{name}", value))
    for label, value in candidates:
        try:
            cloudpickle.dumps(value)
        except Exception:
            described = getattr(value, "__qualname__", None) or type(value).__name__
            return f"{label} ({described})"
    return f"the {type(trainer).__name__} object"
