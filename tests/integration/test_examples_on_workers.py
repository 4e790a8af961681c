"""The examples that need Ray workers, run as written in their smoke setting on 2 workers: the strategy
comes from the config files in examples/configs, as a user would pass them."""

from __future__ import annotations

import os

import pytest
import train_gpt2

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs")
SMOKE = ["--num_workers", "2", "--disable_tqdm", "1", "--report_to", "none", "--max_steps", "40",
         "--train_examples", "1280", "--eval_examples", "64", "--eval_strategy", "no",
         "--logging_steps", "10"]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("strategy", [
    ["--accelerate_config", os.path.join(CONFIGS, "accelerate_fsdp.yaml")],
    pytest.param(["--fsdp", "full_shard auto_wrap", "--fsdp_config", os.path.join(CONFIGS, "fsdp.json")],
                 marks=pytest.mark.full),
    pytest.param(["--deepspeed", os.path.join(CONFIGS, "ds_zero3.json")], marks=pytest.mark.full),
], ids=["accelerate-fsdp-yaml", "fsdp-config", "zero3-json"])
def test_the_gpt2_example_learns_under_each_strategy_config(tmp_path, strategy, capsys):
    out = train_gpt2.main([*SMOKE, "--output_dir", str(tmp_path), "--max_perplexity", "30", *strategy])
    args = out["trainer"].args
    assert out["steps"] == 40 and out["before"] > 50 and out["after"] < 30
    assert "trained GPT-2 (0.42M parameters) for 40 steps on 2 worker(s)" in capsys.readouterr().out
    if "--deepspeed" in strategy:
        assert args.deepspeed.endswith("ds_zero3.json")
    else:  # the accelerate YAML's fsdp_* keys and the JSON both become fsdp + fsdp_config, as in transformers
        assert args.num_workers == 2 and "full_shard" in str(args.fsdp)
        assert args.fsdp_config["transformer_layer_cls_to_wrap"] == ["GPT2Block"]
