"""The examples that need Ray workers, run as written in their smoke setting on 2 workers: the strategy
comes from the config files in examples/configs, as a user would pass them."""

from __future__ import annotations

import math
import os

import pytest
import search_asha
import torch
import train_gpt2

from raytrainer import Trainer, TrainingArguments

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs")
SMOKE = ["--num_workers", "2", "--disable_tqdm", "1", "--report_to", "none", "--max_steps", "40",
         "--train_examples", "1280", "--eval_examples", "64", "--eval_strategy", "no",
         "--logging_steps", "10"]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("strategy", [
    ["--accelerate_config", os.path.join(CONFIGS, "accelerate_fsdp.yaml")],
    ["--fsdp", "full_shard auto_wrap", "--fsdp_config", os.path.join(CONFIGS, "fsdp.json")],
    ["--deepspeed", os.path.join(CONFIGS, "ds_zero3.json")],
], ids=["accelerate-fsdp-yaml", "fsdp-config", "zero3-json"])
def test_the_gpt2_example_learns_under_each_strategy_config(tmp_path, strategy, capsys):
    out = train_gpt2.main([*SMOKE, "--output_dir", str(tmp_path), "--max_perplexity", "30",
                           "--include_num_input_tokens_seen", "all", *strategy])
    args = out["trainer"].args
    assert out["steps"] == 40 and out["before"] > 50 and out["after"] < 30
    # the tokens of both ranks' batches, counted on the workers (2 ranks x 32 lines x 16 tokens a step)
    # the evaluation before training is one process's: a model that takes num_items_in_batch once got its
    # eval loss multiplied by the 2 ranks (perplexity squared)
    torch.manual_seed(42)
    one = Trainer(model=train_gpt2.small_gpt2(), eval_dataset=train_gpt2.progressions(64, 16, seed=43),
                  args=TrainingArguments(output_dir=str(tmp_path / "one"), num_workers=0, report_to="none",
                                         per_device_eval_batch_size=64, disable_tqdm=True))
    assert out["before"] == pytest.approx(math.exp(one.evaluate()["eval_loss"]), rel=1e-4)
    history = out["trainer"].state.log_history
    logged = [(e["step"], e["num_input_tokens_seen"]) for e in history if "loss" in e]
    assert logged == [(10, 10_240), (20, 20_480), (30, 30_720), (40, 40_960)]
    assert "trained GPT-2 (0.42M parameters) for 40 steps on 2 worker(s)" in capsys.readouterr().out
    if "--deepspeed" in strategy:
        assert args.deepspeed.endswith("ds_zero3.json")
    else:  # the accelerate YAML's fsdp_* keys and the JSON both become fsdp + fsdp_config, as in transformers
        assert args.num_workers == 2 and "full_shard" in str(args.fsdp)
        assert args.fsdp_config["transformer_layer_cls_to_wrap"] == ["GPT2Block"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("workers", [0, 2])
def test_the_asha_search_example(tmp_path, capsys, workers):
    """Each trial in its Tune trial actor (--num_workers 0), and on 2 Ray workers each."""
    out = search_asha.main(["--n_trials", "4", "--num_train_epochs", "2", "--output_dir", str(tmp_path),
                            "--disable_tqdm", "1", "--report_to", "none", "--min_accuracy", "0.5",
                            "--num_workers", str(workers)])
    trials, best = out["trials"], out["best"]
    assert len(trials) == 4 and best.objective >= 0.5
    assert best.objective == max(t.objective for t in trials)
    per_epoch = 45 if workers == 0 else 23  # 1,437 training images / (32 x the workers)
    for t in trials:  # ASHA may end a trial after its first evaluation; none runs past max_t
        assert 1 <= len(t.evaluations) <= 2 and t.global_step == per_epoch * len(t.evaluations)
        assert t.pruned == (len(t.evaluations) < 2)  # ASHA's STOP at max_t is the trial's end, not a prune
    printed = capsys.readouterr().out
    assert printed.count(" evaluation(s), step ") == 4 and f"best trial {best.run_id}: accuracy" in printed


@pytest.mark.timeout(600)
@pytest.mark.parametrize("nodes", [1, 2])
def test_the_local_cluster_job_example(tmp_path, nodes):
    """examples/local_cluster_job.sh as written: a local cluster of 1 or 2 nodes, the demo submitted as a
    job (with Ray's token authentication on the 1-node cluster), its exit status the job's, the cluster
    stopped afterwards."""
    import secrets
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    state = f"/tmp/rt-ex-{nodes}-{os.getpid()}"  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH_TOKEN"))}
    env.update(RAY_MN_STATE=state, RAY_MN_IP_START="22", RAY_MN_WORKER_PORT_BASE="27000",
               RAY_MN_AUTH_MODE="disabled", RAY_MN_VENV=os.path.dirname(os.path.dirname(sys.executable)),
               OMP_NUM_THREADS="1", HOME=str(tmp_path))
    if nodes == 1:  # the cluster asks for a token; the script's `raytrainer submit` sends the user's
        env.update(RAY_MN_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    proc = subprocess.run(["bash", "examples/local_cluster_job.sh", str(nodes), "--num_train_epochs", "5",
                           "--output_dir", str(tmp_path / "out")], env=env, cwd=root, capture_output=True,
                          text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    final = float(proc.stdout.split("final test accuracy: ")[1].split("%")[0])
    assert final > 90.0
    assert not os.path.exists(os.path.join(state, "address"))  # the cluster was stopped
