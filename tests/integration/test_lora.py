"""PEFT's LoRA through raytrainer's own Trainer on 2 Ray workers (DDP), beyond training and resuming it
(test_from_pretrained.py): load_best_model_at_end brings the best checkpoint's adapter to the driver, a
hyperparameter search builds each trial's adapter with the trial's rank, and a push to the Hub holds the
adapter, never the base model's weights."""

from __future__ import annotations

import json
import os

import optuna
import pytest
import torch
from models import FromPretrained, LoraPerTrial, counting_data, save_tiny_llama
from safetensors.torch import load_file

from raytrainer import Trainer, TrainingArguments
from raytrainer.search import TrialSummary

optuna.logging.set_verbosity(optuna.logging.WARNING)



def _args(out, **kw) -> TrainingArguments:
    base = dict(output_dir=str(out), num_workers=2, per_device_train_batch_size=4, learning_rate=5e-2,
                optim="adamw_torch", logging_steps=2, save_steps=2, disable_tqdm=True, report_to="none")
    return TrainingArguments(**{**base, **kw})


def _adapter_only(files) -> bool:
    """PEFT's adapter files, and no file of a whole model's weights (model.safetensors, its shards, .bin)."""
    files = set(files)
    return {"adapter_model.safetensors", "adapter_config.json"} <= files and not any(
        os.path.basename(f).startswith(("model", "pytorch_model")) for f in files)


def _adapter_of(model) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}


@pytest.mark.timeout(240)
def test_load_best_model_at_end_brings_the_best_checkpoints_adapter_to_the_driver(tmp_path):
    """Evaluated at every save; the best checkpoint is the one of the largest eval loss (greater_is_better),
    the first, as the loss falls: after train() the driver's model holds that checkpoint's adapter, not the
    final one, and the checkpoint loads with PeftModel.from_pretrained into the same model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = save_tiny_llama(tmp_path / "pretrained")
    data = counting_data(80)
    args = _args(tmp_path / "out", max_steps=6, eval_strategy="steps", eval_steps=2,
                 load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True)
    trainer = Trainer(model_init=FromPretrained(path, lora=True), args=args, train_dataset=data[:64],
                      eval_dataset=data[64:])
    trainer.train()
    losses = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    worst = max(losses, key=losses.get)
    assert sorted(losses) == [2, 4, 6] and worst != 6, losses  # the best is not the final model
    best = trainer.state.best_model_checkpoint
    assert best == str(tmp_path / "out" / f"checkpoint-{worst}")
    assert _adapter_only(os.listdir(best)), os.listdir(best)

    saved = load_file(os.path.join(best, "adapter_model.safetensors"))
    final = load_file(str(tmp_path / "out" / "checkpoint-6" / "adapter_model.safetensors"))
    driver = _adapter_of(trainer.model)
    assert driver.keys() == saved.keys() and len(saved) == 8  # A and B of q_proj, v_proj in 2 layers
    for name, tensor in saved.items():
        assert torch.equal(driver[name], tensor), name
    assert any(not torch.equal(saved[k], final[k]) for k in saved)

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), best)
    ids = data[64]["input_ids"].unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trainer.model(input_ids=ids).logits)
    trainer.close()


class ByTrialNumber(optuna.samplers.BaseSampler):
    """Trial n takes the n-th value of each parameter: the two trials differ in r and lora_alpha."""

    values = {"r": [8, 4], "lora_alpha": [8, 32]}

    def infer_relative_search_space(self, study, trial):
        return {}

    def sample_relative(self, study, trial, search_space):
        return {}

    def sample_independent(self, study, trial, name, distribution):
        return self.values[name][trial.number]


@pytest.mark.timeout(300)
def test_a_search_over_the_lora_rank_builds_each_trials_adapter_with_its_r_and_alpha(tmp_path):
    """hp_space suggests r (categorical) and lora_alpha, which are no TrainingArguments field: they reach
    model_init(trial) on the trial's workers, and each trial's checkpoint is an adapter of its own rank."""
    path = save_tiny_llama(tmp_path / "pretrained")
    data = counting_data(72)
    args = _args(tmp_path / "search", max_steps=2, eval_strategy="steps", eval_steps=2)
    trainer = Trainer(model_init=LoraPerTrial(path), args=args, train_dataset=data[:64],
                      eval_dataset=data[64:])

    def hp_space(trial):
        return {"r": trial.suggest_categorical("r", [4, 8]),
                "lora_alpha": trial.suggest_int("lora_alpha", 8, 32)}

    best = trainer.hyperparameter_search(hp_space=hp_space, n_trials=2, sampler=ByTrialNumber())
    assert best.hyperparameters in ({"r": 8, "lora_alpha": 8}, {"r": 4, "lora_alpha": 32})
    for number, (r, alpha) in enumerate(zip(*ByTrialNumber.values.values())):
        summary = TrialSummary.load(str(tmp_path / "search" / f"run-{number}"))
        assert summary.hyperparameters == {"r": r, "lora_alpha": alpha} and summary.global_step == 2
        folder = summary.best_checkpoint
        assert folder == str(tmp_path / "search" / f"run-{number}" / "checkpoint-2")
        with open(os.path.join(folder, "adapter_config.json")) as f:
            config = json.load(f)
        assert (config["r"], config["lora_alpha"]) == (r, alpha), config
        adapter = load_file(os.path.join(folder, "adapter_model.safetensors"))
        assert len(adapter) == 8 and _adapter_only(os.listdir(folder)), os.listdir(folder)
        for name, tensor in adapter.items():  # A: r x 32 (hidden size), B: 32 x r
            assert tuple(tensor.shape) == ((r, 32) if ".lora_A." in name else (32, r)), (name, tensor.shape)
    trainer.close()


@pytest.mark.timeout(240)
def test_a_lora_run_pushes_the_adapter_and_no_full_weights(tmp_path):
    """push_to_hub with a file:// repository (raytrainer's filesystem target, no network): each checkpoint
    push and the final push hold the adapter's files; the driver's consolidated final weights (the whole
    model, in output_dir/.raytrainer) are never pushed. The pushed adapter is the trained one."""
    from raytrainer.hub import FilesystemTarget

    path = save_tiny_llama(tmp_path / "pretrained")
    repo = tmp_path / "hub"
    args = _args(tmp_path / "out", max_steps=2, push_to_hub=True, hub_model_id=f"file://{repo}",
                 hub_strategy="every_save")
    trainer = Trainer(model_init=FromPretrained(path, lora=True), args=args, train_dataset=counting_data(16))
    trainer.train()
    trainer.push_to_hub()
    commits = FilesystemTarget(f"file://{repo}").commits()
    assert [c["message"] for c in commits] == ["Training in progress, step 2", "End of training"]
    for commit in commits:
        assert _adapter_only(commit["files"]), commit["files"]
        assert not any(f.startswith(".raytrainer") for f in commit["files"]), commit["files"]
    pushed = load_file(str(repo / "main" / "adapter_model.safetensors"))
    trained = _adapter_of(trainer.model)
    assert pushed.keys() == trained.keys() and len(pushed) == 8
    for name, tensor in pushed.items():
        assert torch.equal(tensor, trained[name]), name
    assert any(v.abs().max() > 0 for k, v in pushed.items() if ".lora_B." in k)  # trained: B moved from 0
    trainer.close()
