"""A worker group the Ray cluster cannot place: refused at once without an autoscaler, else a warning at
once and an error after a bounded wait -- wherever Ray runs, also once it is up in the process."""

from __future__ import annotations

import time

import pytest
from models import Regressor, make_data

from raytrainer import Trainer, TrainingArguments
from raytrainer.driver import ray_runtime, resources

pytestmark = pytest.mark.timeout(90)


def _trainer(tmp_path, **kw):
    args = TrainingArguments(output_dir=str(tmp_path), num_workers=2, max_steps=2, save_strategy="no",
                             per_device_train_batch_size=4, report_to="none", disable_tqdm=True, **kw)
    return Trainer(model=Regressor(), args=args, train_dataset=make_data(16))


@pytest.fixture
def ray_started_by_the_script(monkeypatch):
    """Ray already up in this process, not started by raytrainer (a notebook's ray.init(), an earlier
    library): nothing but the cluster's nodes says what can run."""
    monkeypatch.setattr(ray_runtime, "_STARTED_HERE", False)


def test_use_gpu_on_a_cluster_without_gpus_is_refused_at_once_once_ray_is_up(tmp_path,
                                                                             ray_started_by_the_script):
    trainer = _trainer(tmp_path, use_gpu=True)
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"the 2 workers \(use_gpu=True.*each need \{GPU: 1\}, and the Ray "
                                         r"cluster's nodes hold 0 such workers: node 0: \{GPU: 0, CPU: \d+.*"
                                         r"set use_gpu=False.*No autoscaler"):
        trainer.train()
    assert time.monotonic() - started < 5
    assert "_group" not in trainer.__dict__  # no worker group was started


def test_a_resource_no_node_has_is_refused_at_once(tmp_path):
    trainer = _trainer(tmp_path, resources_per_worker={"CPU": 1, "special_chip": 1})
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"each need \{CPU: 1, special_chip: 1\}.*nodes hold 0 such workers.*"
                                         r"special_chip: 0.*change resources_per_worker"):
        trainer.train()
    assert time.monotonic() - started < 5


def test_with_an_autoscaler_the_wait_is_announced_at_once_and_bounded(tmp_path, monkeypatch, capfd,
                                                                      ray_started_by_the_script):
    """Where an autoscaler may add GPU nodes (taken as given here: this cluster has none), the console
    says at once what the run waits for and what the cluster has, and the run fails with that after
    RAYTRAINER_RESOURCE_WAIT_S."""
    monkeypatch.setattr(resources, "autoscaler_may_add", lambda bundle: True)
    monkeypatch.setenv(resources.WAIT_ENV, "3")
    trainer = _trainer(tmp_path, use_gpu=True)
    capfd.readouterr()
    started = time.monotonic()
    with pytest.raises(resources.ResourcesUnavailableError, match=r"no nodes came within 3s "
                                                                  r"\(RAYTRAINER_RESOURCE_WAIT_S\).*GPU: 1"):
        trainer.train()
    assert 3 <= time.monotonic() - started < 10
    console = capfd.readouterr().err
    assert "waiting up to 3s (RAYTRAINER_RESOURCE_WAIT_S) for an autoscaler to add nodes" in console
    assert "each need {GPU: 1}" in console


def test_placeable_counts_workers_by_placement_strategy():
    nodes = [{"CPU": 4, "GPU": 2}, {"CPU": 2, "GPU": 1}, {"CPU": 8}]
    assert resources.placeable({"GPU": 1}, nodes) == 3
    assert resources.placeable({"CPU": 2, "GPU": 1}, nodes) == 3
    assert resources.placeable({"GPU": 1}, nodes, "STRICT_PACK") == 2
    assert resources.placeable({"GPU": 1}, nodes, "STRICT_SPREAD") == 2
    assert resources.placeable({"TPU": 1}, nodes) == 0
