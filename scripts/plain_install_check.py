"""What a user who ran `pip install -c constraints.txt .` (no extras) does first, run in that environment:

1. train in this process and save checkpoints, then resume from the last one (`resume_from_checkpoint=True`);
2. train on 2 Ray workers with `max_failures=1` while one worker's process dies at step 5: the run restarts
   the group, resumes from the last committed checkpoint and ends at the uninterrupted run's weights;
3. train with DeepSpeed ZeRO-3 and a `model_init` on 2 Ray workers.

Each step asserts on values (steps, weights); any missing dependency fails here, not on a user's machine.
Usage: python scripts/plain_install_check.py WORK_DIR   (the CI runs it from a clean venv: .ci/run)
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from raytrainer import Trainer, TrainerCallback, TrainingArguments


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)

    def forward(self, x, labels=None):
        out = self.net(x).squeeze(-1)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


class DieOnce(TrainerCallback):
    """Rank 1's process exits at step 5, once (``output_dir/died`` marks it): a lost worker."""

    def on_step_end(self, args, state, control, **kwargs):
        marker = os.path.join(args.output_dir, "died")
        if state.global_step == 5 and args.process_index == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)


def data(n=32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    return [{"x": x[i], "labels": x[i].sum()} for i in range(n)]


def run(out, callbacks=(), resume=None, max_steps=8, **fields):
    args = TrainingArguments(output_dir=out, max_steps=max_steps, per_device_train_batch_size=4,
                             save_strategy="steps", save_steps=2, report_to="none", disable_tqdm=True, seed=3,
                             learning_rate=0.05,
                             **fields)
    trainer = Trainer(model=Regressor(), args=args, train_dataset=data(), callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def main(work: str) -> None:
    reference = run(os.path.join(work, "in-process"))
    assert reference.state.global_step == 8
    resumed = run(os.path.join(work, "in-process"), resume=True, max_steps=10)
    assert resumed.state.global_step == 10, resumed.state.global_step
    assert sorted(os.listdir(os.path.join(work, "in-process")))[:1] == ["checkpoint-10"]
    print("plain install: in-process training and resume from checkpoint-8: ok")

    whole = {k: v.clone() for k, v in run(os.path.join(work, "ray-reference"), num_workers=2,
                                              max_failures=1).model.state_dict().items()}
    lost = run(os.path.join(work, "ray-lost-worker"), [DieOnce()], num_workers=2, max_failures=1)
    assert os.path.exists(os.path.join(work, "ray-lost-worker", "died")), "the worker did not die"
    assert lost.state.global_step == 8
    for name, tensor in whole.items():
        assert torch.equal(lost.model.state_dict()[name], tensor), name
    print("plain install: 2 Ray workers, a lost worker replaced and the run resumed to the same weights: ok")

    # ZeRO-3 with model_init: the model is built under deepspeed.zero.Init on the workers (transformers'
    # DeepSpeed integration is imported there), half of it on each rank; it trains and comes back whole
    zero3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
             "train_batch_size": "auto", "gradient_accumulation_steps": "auto"}
    args = TrainingArguments(output_dir=os.path.join(work, "zero3"), num_workers=2, deepspeed=zero3,
                             max_steps=4, per_device_train_batch_size=4, save_strategy="no",
                             optim="adamw_torch", report_to="none", disable_tqdm=True, learning_rate=0.05)
    trainer = Trainer(model_init=Regressor, args=args, train_dataset=data())
    assert trainer.train().global_step == 4
    assert not torch.equal(trainer.model.net.weight, Regressor().net.weight), "ZeRO-3 did not train"
    print("plain install: ZeRO-3 with model_init on 2 Ray workers: ok")


if __name__ == "__main__":
    main(sys.argv[1])
