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
