"""Train a small GPT-2 from a config (no download) as a causal language model, with any strategy.

    python examples/train_gpt2.py                                      # 2 Ray workers, DDP
    python examples/train_gpt2.py --num_workers 0 --max_steps 60       # in this process, a smoke run
    python examples/train_gpt2.py --neftune_noise_alpha 5              # NEFTune: noisy embeddings in training
    python examples/train_gpt2.py --fsdp "full_shard auto_wrap" --fsdp_config examples/configs/fsdp.json
    python examples/train_gpt2.py --accelerate_config examples/configs/accelerate_fsdp.yaml
    python examples/train_gpt2.py --deepspeed examples/configs/ds_zero3.json

Data: arithmetic progressions written as words ("17 20 23 26 ..." modulo 100), generated. The first two
numbers of a line are random; every later one follows from them, so a model that learned the pattern
predicts them almost surely. The script prints the evaluation perplexity before and after training and
exits with status 1 unless it fell below ``--max_perplexity`` (the untrained model's is about 100).
"""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass, field

import torch

from raytrainer import ArgumentParser, Trainer, TrainingArguments

VOCAB = 100  # the numbers 0..99 are the tokens; one more for the beginning of a line
BOS = VOCAB


def progressions(n: int, length: int, seed: int) -> list[dict]:
    """``n`` lines of ``length`` tokens: BOS, then a, a+d, a+2d, ... (mod 100)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, d = rng.randrange(VOCAB), rng.randrange(1, 10)
        ids = [BOS] + [(a + i * d) % VOCAB for i in range(length - 1)]
        rows.append({"input_ids": torch.tensor(ids), "labels": torch.tensor(ids)})
    return rows


def small_gpt2(n_layer: int = 2, n_embd: int = 128):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB + 1, n_positions=64, n_embd=n_embd, n_layer=n_layer, n_head=4,
                        bos_token_id=BOS, eos_token_id=BOS)
    return GPT2LMHeadModel(config)


@dataclass
class LMArguments:
    train_examples: int = field(default=4000, metadata={"help": "Generated training lines."})
    eval_examples: int = field(default=256, metadata={"help": "Generated evaluation lines."})
    max_perplexity: float = field(default=4.0, metadata={"help": "Exit with status 1 above this perplexity."})


def main(argv: list[str] | None = None) -> dict:
    defaults = {
        "output_dir": "gpt2_output", "num_workers": 2, "num_train_epochs": 3,
        "per_device_train_batch_size": 32, "per_device_eval_batch_size": 64, "learning_rate": 3e-3,
        "warmup_steps": 20, "weight_decay": 0.01, "eval_strategy": "epoch", "logging_steps": 20,
        "save_strategy": "no",
    }
    parser = ArgumentParser((LMArguments, TrainingArguments))
    parser.set_defaults(**defaults)
    task, args = parser.parse_args_into_dataclasses(args=argv)

    torch.manual_seed(args.seed)
    trainer = Trainer(model=small_gpt2(), args=args,
                      train_dataset=progressions(task.train_examples, 16, seed=args.seed),
                      eval_dataset=progressions(task.eval_examples, 16, seed=args.seed + 1))
    before = math.exp(trainer.evaluate()["eval_loss"])
    trainer.train()
    after = math.exp(trainer.evaluate()["eval_loss"])
    print(f"trained GPT-2 ({sum(p.numel() for p in trainer.model.parameters()) / 1e6:.2f}M parameters) for "
          f"{trainer.state.global_step} steps on {max(args.num_workers, 1)} worker(s): evaluation perplexity "
          f"{before:.1f} before, {after:.2f} after")
    if after > task.max_perplexity:
        print(f"perplexity {after:.2f} is above --max_perplexity {task.max_perplexity}", file=sys.stderr)
        sys.exit(1)
    return {"before": before, "after": after, "steps": trainer.state.global_step, "trainer": trainer}


if __name__ == "__main__":
    main()
