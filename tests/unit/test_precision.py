"""Mixed precision in-process on CPU: bf16 autocast, fp16 autocast with dynamic loss scaling."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import transformers
from torch import nn

from raytrainer import Trainer, TrainerCallback, TrainingArguments

# transformers' loop (raytrainer.Trainer's, issue 56; ``pytest --one-loop`` until it is the default) runs
# fp16 on a CPU without autocast or loss scaling (accelerate's native_amp is off there); raytrainer's own
# loop ran both
FP16_ON_CPU = not issubclass(Trainer, transformers.Trainer)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.dtypes = set()  # of the logits in the training forward (accelerate may cast its outputs after)

    def forward(self, x, labels=None):
        logits = self.net(x)
        if self.training:
            self.dtypes.add(logits.dtype)
        return {"loss": nn.functional.cross_entropy(logits.float(), labels), "logits": logits}


def data(n=64):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    return [{"x": x[i], "labels": int(x[i, 0] > 0) + int(x[i, 1] > 0)} for i in range(n)]


class Recording(Trainer):
    """Can plant an inf loss at one update."""

    plant_inf_at: int | None = None
    plant_factor = float("inf")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True)
        if model.training and self.state.global_step == self.plant_inf_at:
            loss = loss * self.plant_factor
        return (loss, outputs) if return_outputs else loss


class Weights(TrainerCallback):
    def __init__(self):
        self.by_step = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.by_step[state.global_step] = {k: v.clone() for k, v in model.state_dict().items()}


def args(tmp_path, **kw):
    kw = {"save_strategy": "no", **kw}
    return TrainingArguments(output_dir=str(tmp_path), num_workers=0, per_device_train_batch_size=8,
                             num_train_epochs=3, learning_rate=0.05, optim="adamw_torch",
                             disable_tqdm=True, logging_steps=4, report_to="none", **kw)


@pytest.mark.parametrize("flag, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_forward_in_low_precision_weights_stay_fp32(tmp_path, flag, dtype):
    if flag == "fp16" and not FP16_ON_CPU:
        pytest.skip("transformers' loop runs fp16 on a CPU without autocast (accelerate)")
    trainer = Recording(model=Net(), args=args(tmp_path, **{flag: True}), train_dataset=data())
    trainer.train()
    assert trainer.model.dtypes == {dtype}
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]


def test_fp16_skips_a_step_with_inf_gradients_and_lowers_the_scale(tmp_path):
    if not FP16_ON_CPU:
        pytest.skip("transformers' loop runs fp16 on a CPU without loss scaling (accelerate)")
    weights = Weights()
    trainer = Recording(model=Net(), args=args(tmp_path, fp16=True, max_steps=5), train_dataset=data(),
                        callbacks=[weights])
    trainer.plant_inf_at = 2  # the update that ends at global_step 3
    trainer.plant_factor = 1e38  # a finite loss whose scaled gradients overflow fp16's range
    trainer.train()
    same = all(torch.equal(weights.by_step[3][k], weights.by_step[2][k]) for k in weights.by_step[2])
    moved = any(not torch.equal(weights.by_step[4][k], weights.by_step[3][k]) for k in weights.by_step[3])
    assert same and moved


def test_fp16_with_fsdp_is_refused_with_a_fix(tmp_path):
    with pytest.raises(ValueError, match=r"fp16=True: is not supported with FSDP sharding.*--bf16"):
        TrainingArguments(output_dir=str(tmp_path), num_workers=2, fsdp="full_shard", fp16=True)


# -- nonfinite_loss ------------------------------------------------------------------------------------------
def test_a_nonfinite_loss_stops_the_run_before_its_update_by_default(tmp_path):
    from raytrainer.worker.nonfinite import NonFiniteLossError

    weights = Weights()
    trainer = Recording(model=Net(), args=args(tmp_path, max_steps=6, save_strategy="steps", save_steps=2),
                        train_dataset=data(), callbacks=[weights])
    trainer.plant_inf_at = 3  # the update that would end at global_step 4
    with pytest.raises(NonFiniteLossError, match=r"rank 0 computed a training loss of inf in the update to "
                                                 r"step 4 .*nonfinite_loss='skip_step'"):
        trainer.train()
    assert trainer.state.global_step == 3
    for name, tensor in trainer.model.state_dict().items():  # the weights before the bad update
        assert torch.equal(tensor, weights.by_step[3][name]) and torch.isfinite(tensor).all(), name
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]


def test_skip_step_skips_the_update_and_trains_on(tmp_path, caplog):
    weights = Weights()
    trainer = Recording(model=Net(), args=args(tmp_path, max_steps=5, nonfinite_loss="skip_step"),
                        train_dataset=data(), callbacks=[weights])
    trainer.plant_inf_at = 2
    with caplog.at_level(logging.WARNING, logger="raytrainer.worker.nonfinite"):
        trainer.train()
    assert trainer.state.global_step == 5
    assert all(torch.equal(weights.by_step[3][k], weights.by_step[2][k]) for k in weights.by_step[2])
    assert any(not torch.equal(weights.by_step[4][k], weights.by_step[3][k]) for k in weights.by_step[3])
    assert all(torch.isfinite(t).all() for t in trainer.model.state_dict().values())
    assert "not finite in the update to step 3; that update is skipped (1 so far)" in caplog.text


@pytest.mark.parametrize("mode", ["skip_step", "ignore"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_nonfinite_loss_is_logged_as_the_running_mean(tmp_path, mode, accumulation):
    """logging_nan_inf_filter, as transformers: a non-finite micro-batch loss adds the window's running mean,
    ``tr_loss / (1 + global_step - last logged step)``, in its place."""

    class Losses(Recording):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.losses.append((self.state.global_step, loss.item()))
            return loss

    trainer = Losses(model=Net(), train_dataset=data(),
                     args=args(tmp_path, max_steps=8, nonfinite_loss=mode,  # logging every 4 steps
                               gradient_accumulation_steps=accumulation))
    trainer.losses, trainer.plant_inf_at = [], 5  # the update to step 6, in the second window
    trainer.train()
    expected, window = [], 0.0
    for i, (step, loss) in enumerate(trainer.losses):
        window += loss if math.isfinite(loss) else window / (1 + step - 4 * (step // 4))
        if (i + 1) % (4 * accumulation) == 0:
            expected.append(window / 4)
            window = 0.0
    assert not all(math.isfinite(loss) for _, loss in trainer.losses)
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged == pytest.approx(expected, rel=1e-6) and all(map(math.isfinite, logged))


def test_ignore_trains_on_as_transformers(tmp_path):
    trainer = Recording(model=Net(), args=args(tmp_path, max_steps=5, nonfinite_loss="ignore"),
                        train_dataset=data())
    trainer.plant_inf_at = 2
    trainer.train()
    assert trainer.state.global_step == 5
    assert not all(torch.isfinite(t).all() for t in trainer.model.state_dict().values())


def test_nonfinite_loss_values_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"nonfinite_loss='stop'.*'error', 'skip_step', 'ignore'"):
        TrainingArguments(output_dir=str(tmp_path), nonfinite_loss="stop")
