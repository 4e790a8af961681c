"""What asking a loss for its kind costs (raytrainer/worker/loss.py): in one process, a GPT-2 causal LM (its
loss divides by num_items_in_batch) and a BERT sequence classifier (its loss is a mean) built from configs,
each trained for a few steps by raytrainer's Trainer (num_workers=0) as it is and with the asking switched off
(the model's forward left unadapted), interleaved. Prints the first step's extra seconds against the
median step, and the median steady step with and without: a Markdown table for docs/benchmarks.md.

    python bench/bench_loss_kind.py [--steps 12] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch
import transformers

from raytrainer import Trainer, TrainerCallback, TrainingArguments


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=128)
    return transformers.GPT2LMHeadModel(config)


def bert():
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
        max_position_embeddings=128, num_labels=3))


def rows(n: int, causal: bool) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 2048, (128,), generator=g)
        out.append({"input_ids": ids, "labels": ids if causal else int(ids[0]) % 3})
    return out


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times, self.start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.start)


def one_run(build, causal: bool, steps: int, ask: bool) -> list[float]:
    times = StepTimes()
    args = TrainingArguments(output_dir="/tmp/bench-loss-kind", num_workers=0, per_device_train_batch_size=8,
                             max_steps=steps, save_strategy="no", report_to="none", disable_tqdm=True,
                             use_cpu=True, optim="adamw_torch", logging_steps=steps)
    trainer = Trainer(model=build(), args=args, train_dataset=rows(8 * steps, causal), callbacks=[times])
    if ask:
        trainer.train()
    else:
        with mock.patch("raytrainer.worker.hosted.adapt_mean_losses", lambda trainer: None):
            trainer.train()
    return times.times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    print("| model (loss) | first step, asked | first step, not asked | extra on the first step | "
          "steady step, asked | steady step, not asked |")
    print("|---|--:|--:|--:|--:|--:|")
    for name, build, causal in (("GPT-2 4x256 (divides by the count)", gpt2, True),
                                ("BERT 4x256 classifier (a mean)", bert, False)):
        runs = {True: [], False: []}
        for _ in range(opts.repeats):
            for ask in (True, False):  # interleaved: the machine's noise falls on both
                runs[ask].append(one_run(build, causal, opts.steps, ask))
        first = {ask: statistics.median(r[0] for r in runs[ask]) for ask in runs}
        steady = {ask: statistics.median(t for r in runs[ask] for t in r[2:]) for ask in runs}
        print(f"| {name} | {first[True]:.3f} s | {first[False]:.3f} s | {first[True] - first[False]:+.3f} s "
              f"({(first[True] - first[False]) / steady[False]:.2f} steps) | {steady[True]:.3f} s | "
              f"{steady[False]:.3f} s |")


if __name__ == "__main__":
    main()
