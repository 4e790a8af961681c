"""The local Ray instance is started without the Hub token in its (inherited) environment."""

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
