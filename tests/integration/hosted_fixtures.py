"""A tiny causal LM with its tokenizer, saved as a model folder, and a local text data set: what TRL's
scripts load by path (``--model_name_or_path``, ``--dataset_name``), made here from a config (no download)."""

from __future__ import annotations

import json
import os
import random

from transformers import TrainerCallback


def write_tiny_lm(folder: str, dropout: float = 0.1) -> str:
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[EOS]"] + [f"w{i}" for i in range(60)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                        eos_token="[EOS]")
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=len(words), n_positions=64,
                        bos_token_id=2, eos_token_id=2, pad_token_id=0, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_text_data(folder: str, rows: int = 256) -> str:
    """Counting sequences ("w7 w8 w9 ..."): a pattern the tiny model learns within a few steps."""

    def row(rng: random.Random) -> dict:
        start = rng.randrange(60)
        return {"text": " ".join(f"w{(start + k) % 60}" for k in range(12))}

    return _write_splits(folder, {"train": rows, "test": 32}, row)


def _write_splits(folder: str, sizes: dict[str, int], row) -> str:
    """``<split>.jsonl`` files of ``row(rng)`` dicts, one generator seeded 0 for all of them in turn."""
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(0)
    for split, n in sizes.items():
        with open(os.path.join(folder, f"{split}.jsonl"), "w") as f:
            for _ in range(n):
                f.write(json.dumps(row(rng)) + "\n")
    return folder


def trl_script_on_ray(name: str, folder: str) -> str:
    """TRL's own ``trl/scripts/<name>.py`` from the installed package, with only its imports changed:
    ``from trl import`` becomes ``from raytrainer.trl import``."""
    import trl.scripts

    with open(os.path.join(os.path.dirname(trl.scripts.__file__), f"{name}.py")) as f:
        source = f.read()
    assert "from trl import" in source
    path = os.path.join(folder, f"{name}_on_ray.py")
    with open(path, "w") as f:
        f.write(source.replace("from trl import", "from raytrainer.trl import"))
    return path


def write_preference_data(folder: str, rows: int = 128) -> str:
    """Prompts that start a count, a chosen completion that goes on counting, a rejected one of random words
    (DPO's and the reward model's data; GRPO reads the prompts)."""

    def row(rng: random.Random) -> dict:
        start = rng.randrange(60)
        prompt = " ".join(f"w{(start + k) % 60}" for k in range(4))
        chosen = " " + " ".join(f"w{(start + 4 + k) % 60}" for k in range(4))
        rejected = " " + " ".join(f"w{rng.randrange(60)}" for _ in range(4))
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}

    return _write_splits(folder, {"train": rows, "test": 16}, row)


REWARD_MODULE = '''
def counts_on(completions, prompts, **kwargs):
    """1 per word of the completion that goes on with the prompt's count (w7 w8 -> w9 w10 ...)."""
    scores = []
    for prompt, completion in zip(prompts, completions):
        last, score = int(prompt.split()[-1][1:]), 0.0
        for word in completion.split():
            last = (last + 1) % 60
            score += word == f"w{last}"
        scores.append(score)
    return scores
'''



class OneRankDecides(TrainerCallback):
    """Flags each asked on one rank only, as a user's callback may (its own rank's data, a file it polls):
    a save in ``on_evaluate`` on rank 0 at ``save_at``, a stop in ``on_step_end`` on rank 1 at ``stop_at``.
    Each rank writes the steps it saved at and the step it ended at to ``<output_dir>/ended-rank<r>.json``."""

    def __init__(self, save_at: int, stop_at: int):
        self.save_at, self.stop_at, self.saved = save_at, stop_at, []

    def on_evaluate(self, args, state, control, **kwargs):
        if state.global_step == self.save_at and args.process_index == 0:
            control.should_save = True

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.stop_at and args.process_index == 1:
            control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):
        self.saved.append(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        with open(os.path.join(args.output_dir, f"ended-rank{args.process_index}.json"), "w") as f:
            json.dump({"saved": self.saved, "step": state.global_step}, f)


def order_sensitive_metrics(prediction) -> dict:
    """compute_metrics that depends on every row and on their order; it records the rank it ran on
    (``metrics-ran-on-rank<r>`` in the working directory, which is the driver's on every worker)."""
    import numpy as np
    import torch

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    with open(f"metrics-ran-on-rank{rank}", "a") as f:
        f.write("1\n")
    labels, logits = np.asarray(prediction.label_ids), np.asarray(prediction.predictions)
    real = labels != -100
    return {"rows": int(labels.shape[0]),
            "ordered": float(np.sum(np.arange(labels.shape[0])[:, None] * np.where(real, labels, 0))),
            "logit_mean": float(logits[real].mean())}


#: ZeRO-3 as a user's DeepSpeed config gives it ("auto" filled from the training arguments)
ZERO3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
         "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto",
         "bf16": {"enabled": "auto"}}


class ShardReport(TrainerCallback):
    """What each rank holds of the model it trains: ``<output_dir>/shard-rank<r>.json`` with whether the
    model is sharded (FSDP2's ``fully_shard``, or ZeRO-3's partitioned parameters), the elements this rank
    holds and the model's."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        params = list(model.parameters())
        zero3 = all(hasattr(p, "ds_tensor") for p in params)
        if zero3:  # a partitioned parameter: ds_tensor is this rank's partition, ds_numel the whole
            held, whole = sum(p.ds_tensor.numel() for p in params), sum(p.ds_numel for p in params)
        else:
            held = sum(getattr(p, "_local_tensor", p).numel() for p in params)
            whole = sum(p.numel() for p in params)
        report = {"sharded": zero3 or isinstance(model, FSDPModule), "held": held, "whole": whole}
        with open(os.path.join(args.output_dir, f"shard-rank{args.process_index}.json"), "w") as f:
            json.dump(report, f)


def numbers_saved(checkpoint) -> int:
    """How many numbers the tensors in a checkpoint's files hold in all, RNG states aside: its safetensors,
    its torch.save'd files (DeepSpeed's engine state, transformers' FSDP files) and its DCP folders (from
    their metadata)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    def numel(obj) -> int:
        if isinstance(obj, torch.Tensor):
            return obj.numel()
        if isinstance(obj, dict):
            return sum(numel(v) for v in obj.values())
        return sum(numel(v) for v in obj) if isinstance(obj, (list, tuple)) else 0

    total = 0
    for path in checkpoint.rglob("*"):
        if path.suffix == ".safetensors" and not path.name.startswith("rng_state_"):
            total += numel(load_file(str(path)))
        elif path.suffix in (".pt", ".bin"):  # DeepSpeed's engine state; transformers' FSDP model, optimizer
            total += numel(torch.load(path, weights_only=False))
        elif path.name == ".metadata":
            found = dcp.FileSystemReader(str(path.parent)).read_metadata().state_dict_metadata.values()
            total += sum(m.size.numel() for m in found if hasattr(m, "size"))
    return total
