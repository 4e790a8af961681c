"""The local Ray instance: started without the Hub token in its (inherited) environment, with the CPUs the
workers ask for (and a warning when the machine has fewer cores)."""

from __future__ import annotations

import os

from raytrainer.driver.ray_runtime import _without_secrets


def test_hub_tokens_are_out_of_the_environment_ray_inherits_and_back_after(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "hf_other")
    monkeypatch.setenv("KEEP_ME", "1")
    with _without_secrets():
        assert "HF_TOKEN" not in os.environ and "HUGGING_FACE_HUB_TOKEN" not in os.environ
        assert os.environ["KEEP_ME"] == "1"
    assert os.environ["HF_TOKEN"] == "hf_secret" and os.environ["HUGGING_FACE_HUB_TOKEN"] == "hf_other"


def test_use_gpu_without_gpus_fails_before_ray_starts(monkeypatch, make_args, make_classifier, make_examples):
    """On this CPU machine, with no cluster address, raytrainer would start a local Ray instance that can
    never hold a GPU worker (or uses one it started before, in a whole-suite run): the error comes at once,
    and no Ray instance is started."""
    import time

    import pytest
    import ray
    import torch

    from raytrainer import Trainer

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert torch.cuda.device_count() == 0
    data, _, _ = make_examples(16)
    args = make_args(num_workers=2, use_gpu=True)
    trainer = Trainer(model=make_classifier(), args=args, train_dataset=data)
    started = time.monotonic()
    running = ray.is_initialized()
    # Ray not yet up: the local machine's GPUs decide; Ray already up (a whole-suite run, after the
    # integration tests' instance): the cluster's nodes do (driver/resources.py). Either way, at once.
    before_ray = (r"use_gpu=True asks for 2 GPUs \(2 workers\), but .* has 0\. Run on a machine with GPUs"
                  r".*ray_address.*use_gpu=False")
    ray_up = r"use_gpu=True.*each need \{GPU: 1\}.*hold 0 such workers.*use_gpu=False.*ray_address="
    with pytest.raises(ValueError, match=f"{before_ray}|{ray_up}"):
        trainer.train()
    assert time.monotonic() - started < 5 and ray.is_initialized() == running


def test_the_local_instance_gets_the_workers_cpus_plus_two_and_too_many_workers_are_warned_of(
        monkeypatch, make_args, caplog):
    """On this machine's cores: 2 workers of 1 CPU fit 2 cores (Ray gets 2 spare: 4, no warning); 8 workers
    ask for 8 CPUs of 2 cores: a warning naming the count that fits, and Ray gets 10."""
    import logging

    from raytrainer.driver import ray_runtime

    monkeypatch.setattr(ray_runtime, "machine_cores", lambda: 2)
    with caplog.at_level(logging.WARNING, logger="raytrainer"):
        assert ray_runtime.local_instance_cpus(make_args(num_workers=2)) == (2, 2, 4)
        assert not caplog.records
        assert ray_runtime.local_instance_cpus(make_args(num_workers=8)) == (2, 8, 10)
    [warning] = caplog.records
    assert warning.getMessage() == (
        "num_workers=8 asks for 8 CPUs, but this machine has 2 CPU core(s): the workers would share them, "
        "each step slower than on fewer workers. Set num_workers to 2 or fewer, or give a cluster's address "
        "(ray_address= or RAY_ADDRESS).")
    half = make_args(num_workers=8, resources_per_worker={"CPU": 0.5})
    assert ray_runtime.local_instance_cpus(half) == (2, 4, 6)  # 4 of 2 cores: 4 workers of half a CPU fit
    assert "Set num_workers to 4 or fewer" in caplog.records[-1].getMessage()
