"""Code that transformers / evaluate / datasets load at run time from HF_HOME/modules (an ``evaluate.load``
metric, say) travels to the workers by value: the spec unpickles where that folder is not importable."""

from __future__ import annotations

import contextlib
import importlib
import sys
from types import SimpleNamespace

import cloudpickle
import numpy as np
import pytest

from raytrainer import Trainer

METRIC = '''
class Accuracy:
    """What evaluate.load("accuracy") returns: an instance of a class from a module it wrote."""

    def compute(self, predictions, references):
        return {"accuracy": sum(p == r for p, r in zip(predictions, references)) / len(references)}
'''


@pytest.fixture
def evaluate_modules(tmp_path, monkeypatch):
    """An ``evaluate_modules.metrics.accuracy`` package under tmp_path, importable only while on sys.path."""
    package = tmp_path / "evaluate_modules" / "metrics"
    package.mkdir(parents=True)
    (tmp_path / "evaluate_modules" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "accuracy.py").write_text(METRIC)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("evaluate_modules.metrics.accuracy")
    package = sys.modules["evaluate_modules"]
    yield module
    for name in [n for n in sys.modules if n.startswith("evaluate_modules")]:
        del sys.modules[name]
    with contextlib.suppress(ValueError):  # registered by the recipe's pickling
        cloudpickle.unregister_pickle_by_value(package)


def test_an_evaluate_metric_in_compute_metrics_reaches_the_workers(make_args, make_classifier, make_examples,
                                                                  evaluate_modules, monkeypatch, tmp_path):
    metric = evaluate_modules.Accuracy()

    def compute_metrics(p):
        return metric.compute(predictions=p.predictions.argmax(-1), references=p.label_ids)

    trainer = Trainer(model=make_classifier(), args=make_args(num_workers=2),
                      train_dataset=make_examples(8)[0], compute_metrics=compute_metrics)
    payload = trainer._recipe.payload  # what each rank builds its trainer from (hosted_recipe.py)
    # a worker: the package is neither loaded nor on its path
    for name in [n for n in sys.modules if n.startswith("evaluate_modules")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("evaluate_modules.metrics.accuracy")
    _cls, _args, kwargs = cloudpickle.loads(payload)
    p = SimpleNamespace(predictions=np.eye(3)[[1, 2, 2]], label_ids=np.array([1, 2, 0]))
    assert kwargs["compute_metrics"](p) == {"accuracy": 2 / 3}
