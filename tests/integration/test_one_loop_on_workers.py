"""raytrainer.one_loop's Trainer on 2 Ray workers (issue 56): each rank builds the class itself, its own
additions included (label smoothing on a module without a ``config``), and the rank's layer adds the
guarantees (a callback's stop on one rank agreed by all, checkpoints committed with a manifest)."""

from __future__ import annotations

import json
import os

import pytest


@pytest.mark.timeout(300)
def test_one_loop_trainer_on_two_workers_agrees_a_stop_of_one_rank_and_commits(tmp_path, ray_session):
    import torch
    import transformers
    from torch import nn

    import raytrainer
    from raytrainer import one_loop

    class Plain(nn.Module):  # no config: transformers reads model.config to decide on label smoothing
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.linear = nn.Linear(4, 3)

        def forward(self, x, labels=None):  # with label smoothing transformers takes the labels away
            logits = self.linear(x)
            if labels is None:
                return {"logits": logits}
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

    class StopOnRankOne(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3 and os.environ.get("RANK") == "1":
                return {"should_training_stop": True}  # a mapping of flags: raytrainer's handler takes it
            return None

    g = torch.Generator().manual_seed(0)
    rows = [{"x": torch.randn(4, generator=g), "labels": i % 3} for i in range(64)]
    args = raytrainer.TrainingArguments(
        output_dir=str(tmp_path), num_workers=2, per_device_train_batch_size=2, max_steps=8,
        save_strategy="steps", save_steps=2, label_smoothing_factor=0.1, logging_steps=1, report_to="none",
        disable_tqdm=True, learning_rate=0.1)
    model = Plain()
    trainer = one_loop.Trainer(model=model, args=args, train_dataset=rows, callbacks=[StopOnRankOne()])
    assert isinstance(trainer, transformers.Trainer) and type(trainer).hosted_class is one_loop.Trainer
    # the script's own loader, asked for between calls: one process's view, every row once (not rank 0's)
    batches = list(trainer.get_train_dataloader())
    assert [len(b["labels"]) for b in batches] == [2] * 32
    assert sorted(torch.cat([b["x"] for b in batches]).sum(dim=1).tolist()) == \
        sorted(torch.stack([r["x"] for r in rows]).sum(dim=1).tolist())
    output = trainer.train()
    assert output.global_step == 3  # rank 1 stopped; rank 0 stopped with it (the flags agreed)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(0 < loss < 5 for loss in losses)
    manifest = json.loads((tmp_path / "checkpoint-2" / "manifest.json").read_text())
    assert manifest["global_step"] == 2 and "model.safetensors" in manifest["files"]
    # the script's own module holds the trained weights, as after transformers' train(): rank 0's, read in
    assert trainer.model is model
    saved = (tmp_path / ".raytrainer" / "model" / "model.safetensors")
    from safetensors.torch import load_file

    assert torch.equal(model.linear.weight, load_file(saved)["linear.weight"])
    assert not torch.equal(model.linear.weight, Plain().linear.weight.detach())
    trainer.end()


@pytest.mark.timeout(300)
def test_a_pbt_exploit_on_two_workers_takes_the_trial_s_hyperparameters(tmp_path, ray_session):
    """A PBT exploit resumes another trial's checkpoint with this trial's mutated learning_rate and
    weight_decay (raytrainer/search sets ``_resume_with_new_hyperparameters``): on workers too, each rank
    takes them after transformers' loop loads the checkpoint's optimizer and scheduler."""
    import torch
    import transformers
    from torch import nn

    import raytrainer
    from raytrainer import one_loop

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.linear = nn.Linear(6, 3)

        def forward(self, x, labels=None):
            logits = self.linear(x)
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

    class Decays(transformers.TrainerCallback):  # what each rank's optimizer holds at each step
        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            with open(os.path.join(args.output_dir, f"decay-{os.environ.get('RANK', '0')}.txt"), "a") as f:
                f.write(json.dumps(sorted({g["weight_decay"] for g in optimizer.param_groups})) + "\n")

    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 6, generator=g)
    rows = [{"x": x[i], "labels": int(x[i, 0] > 0)} for i in range(48)]

    def args(out, lr, wd, workers):
        return raytrainer.TrainingArguments(
            output_dir=str(out), num_workers=workers, learning_rate=lr, weight_decay=wd, max_steps=6,
            per_device_train_batch_size=8 // max(1, workers), logging_steps=1, save_strategy="steps",
            save_steps=3, disable_tqdm=True, optim="adamw_torch", report_to="none")

    one_loop.Trainer(model=Net(), args=args(tmp_path / "source", 0.1, 0.01, 0), train_dataset=rows).train()
    for mutated in (True, False):
        out = tmp_path / f"trial-{mutated}"
        trial = one_loop.Trainer(model=Net(), args=args(out, 0.01, 0.2, 2), train_dataset=rows,
                                 callbacks=[Decays()])
        trial._resume_with_new_hyperparameters = mutated  # what the search sets for a PBT exploit
        trial.train(resume_from_checkpoint=str(tmp_path / "source" / "checkpoint-3"))
        # linear decay over 6 steps: step 4 logs the rate it used, base * (1 - 3/6)
        history = trial.state.log_history
        (logged,) = [h["learning_rate"] for h in history if h.get("step") == 4 and "loss" in h]
        assert logged == pytest.approx((0.01 if mutated else 0.1) * (1 - 3 / 6))
        for rank in (0, 1):
            seen = {tuple(json.loads(line)) for line in (out / f"decay-{rank}.txt").read_text().splitlines()}
            assert seen == ({(0.0, 0.2)} if mutated else {(0.0, 0.01)}), (rank, seen)
        trial.end()
