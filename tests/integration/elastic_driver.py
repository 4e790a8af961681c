"""Driver script for test_elastic.py: an elastic run, ``num_workers=(2, 3)``, on an existing local
multi-node Ray cluster, slow enough for the test to take a node away mid-run; then the same training in
this process (``num_workers=0``) with the same global batch, uninterrupted, to compare with.

    python elastic_driver.py ADDRESS WORKDIR [STEP_S [STRATEGY [HOST]]]

(``STEP_S``: how long each step sleeps, 0.3 s by default; ``STRATEGY``: ddp (the default), fsdp or zero3
for the elastic run; ``HOST``: raytrainer (its own Trainer, the default), transformers
(``on_ray(transformers.Trainer)``: transformers' loop on the workers) or trl (TRL's ``SFTTrainer`` on a tiny
GPT-2, each example's id in its first two tokens).)

Each rank appends, per optimizer step, the ids of the samples it trained to ``WORKDIR/samples-<pid>``
(``<step> <id> <id> ...``), and rank 0 the step and its world size to ``WORKDIR/steps``
(``<pid> <world> <step> <time>``). Prints ``RESULT <json>`` at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time

import multinode_driver
import torch
from models import STRATEGY_ARGS

from raytrainer import Trainer, TrainerCallback, TrainingArguments

SAMPLES = 360  # one epoch; every world size from 2 to 3 splits it and the global batch evenly
PER_DEVICE, WORKERS = 4, (2, 3)  # a global batch of 12: 3 x 4, or 2 x 3 x 2 accumulation steps
STEP_S = 0.3  # each step sleeps this long, so the run outlasts the loss of a node and a restart


class Regressor(torch.nn.Module):
    """Its forward takes ``**kwargs`` (so transformers passes it ``num_items_in_batch``) and its loss is a
    mean, as BERT's classifiers: on 2 workers x 2 accumulation steps, then 3 workers, its logged loss is the
    uninterrupted one-rank run's at every step, across the resize (it was x4, then x3, before raytrainer
    turned such a mean into its share of the step's sum: worker/loss.py)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        self.seen: list[int] = []  # the sample ids of the current optimizer step, on this rank

    def forward(self, x, labels=None, idx=None, **kwargs):
        if idx is not None and self.training:
            self.seen.extend(int(i) for i in idx)
        logits = self.net(x)
        if labels is None:
            return (logits,)
        return torch.nn.functional.cross_entropy(logits, labels), logits


def make_data(n: int) -> list[dict]:
    """test_multinode's data, each example with its id."""
    return [{**example, "idx": i} for i, example in enumerate(multinode_driver.make_data(n))]


class Record(TrainerCallback):
    def __init__(self, work: str, sleep: float):
        self.work, self.sleep = work, sleep

    def on_step_end(self, args, state, control, model=None, **kwargs):
        time.sleep(self.sleep)
        with open(os.path.join(self.work, f"samples-{os.getpid()}"), "a") as f:
            f.write(" ".join(map(str, [state.global_step, *model.seen])) + "\n")
        model.seen.clear()
        if args.process_index == 0:
            with open(os.path.join(self.work, "steps"), "a") as f:
                f.write(f"{os.getpid()} {args.world_size} {state.global_step} {time.time():.2f}\n")


def record_ids(module, args, kwargs) -> None:
    """A forward pre-hook on the tiny GPT-2's decoder: the ids of the examples it trains on (example ``i``
    starts with the words ``w{i // 60}`` and ``w{i % 60}``, then counts on). On the decoder, not the model's
    own ``forward``: TRL's SFTTrainer runs a forward of its own (``fused_lm_head``) around the decoder."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if module.training and ids is not None:  # token 3 is the word w0
        module.seen.extend(int(a - 3) * 60 + int(b - 3) for a, b in ids[:, :2].tolist())


def counting_lm(folder: str):
    """A tiny GPT-2 (no dropout) that records, as the Regressor does, the ids of the examples it trains on
    (``model.seen``, the decoder's list)."""
    from hosted_fixtures import write_tiny_lm
    from transformers import GPT2LMHeadModel

    if not os.path.exists(os.path.join(folder, "config.json")):
        write_tiny_lm(folder, dropout=0.0)
    model = GPT2LMHeadModel.from_pretrained(folder)
    model.transformer.seen = model.seen = []  # one list: it pickles as one
    model.transformer.register_forward_pre_hook(record_ids, with_kwargs=True)
    return model


def counting_rows(n: int) -> list[dict]:
    return [{"input_ids": [3 + i // 60, 3 + i % 60, *(3 + (i + k) % 60 for k in range(8))]} for i in range(n)]


def train(work: str, sleep: float = 0.0, host: str = "raytrainer", **kw) -> dict:
    """One run of ``host``'s trainer: raytrainer's own, ``on_ray(transformers.Trainer)`` or TRL's
    ``SFTTrainer``."""
    trainer_cls, args_cls = Trainer, TrainingArguments
    model, data, given = Regressor(), make_data(SAMPLES), {}
    if host == "trl":
        import datasets
        from transformers import AutoTokenizer

        import raytrainer.trl as trl

        trainer_cls, args_cls = trl.SFTTrainer, trl.SFTConfig
        folder = os.path.join(work, "tiny-lm")
        model, data = counting_lm(folder), datasets.Dataset.from_list(counting_rows(SAMPLES))
        given = {"processing_class": AutoTokenizer.from_pretrained(folder)}
        # SGD: a GPT-2's attention key bias has a zero gradient (softmax ignores a shift shared by every
        # key), and Adam turns the float noise in it, which differs with the summation order of 3 or 2 x 2
        # ranks, into steps of +-lr: weights that differ while the model's outputs agree
        kw.update(use_cpu=True, bf16=False, max_length=16, optim="sgd")
    if host == "transformers":
        import transformers

        import raytrainer

        trainer_cls = raytrainer.on_ray(transformers.Trainer)
        args_cls = raytrainer.config_on_ray(transformers.TrainingArguments)
        kw.setdefault("use_cpu", True)
    args = args_cls(
        output_dir=os.path.join(work, "out"), num_train_epochs=1, learning_rate=0.05,
        save_strategy="steps", save_steps=5, logging_steps=1, report_to="none", disable_tqdm=True, seed=3,
        **kw)
    trainer = trainer_cls(model=model, args=args, train_dataset=data, callbacks=[Record(work, sleep)],
                          **given)
    out = trainer.train()
    result = {"global_step": out.global_step,
              "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
              "weights": [p.detach().flatten().tolist() for p in trainer.model.parameters()],
              "history": trainer.state.log_history}
    trainer.end() if hasattr(trainer, "end") else trainer.close()
    return result




def main(address: str, work: str, step_s: str = str(STEP_S), strategy: str = "ddp",
         host: str = "raytrainer") -> None:
    elastic = train(work, float(step_s), host, ray_address=address, **STRATEGY_ARGS[strategy],
                    num_workers=WORKERS, max_failures=1, per_device_train_batch_size=PER_DEVICE)
    os.makedirs(os.path.join(work, "baseline"))
    baseline = train(os.path.join(work, "baseline"), host="trl" if host == "trl" else "raytrainer",
                     num_workers=0, per_device_train_batch_size=PER_DEVICE * WORKERS[1])
    print("RESULT " + json.dumps({"elastic": elastic, "baseline": baseline}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
