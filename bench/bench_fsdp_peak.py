#!/usr/bin/env python
"""FSDP's peak memory per worker against DDP's, on the two models issue 54 names, side by side in one run.

- ``linear``: ``model_init`` returns 12 bias-free ``nn.Linear(4096, 4096)`` with ``tanh`` between them
  (201M parameters, 805 MB in fp32; every module has ``reset_parameters``), FSDP as
  ``fsdp="full_shard"``, ``fsdp_config={"transformer_layer_cls_to_wrap": ["Linear"]}`` (no ``auto_wrap``).
- ``causal_lm``: a Llama causal LM from a config (``model_init``; 12 layers of width 1024, vocabulary 32k:
  268M parameters), ``fsdp="full_shard"`` alone: its layers are its ``_no_split_modules``.

2 CPU workers, 3 steps of batch 4, AdamW, ``save_strategy="no"``. Each worker's peak RSS is the kernel's
high-water mark (``ru_maxrss``) at ``on_train_end``; its RSS at ``on_train_begin`` is printed beside it.
Each (model, side) runs in a fresh driver process of its own, one after the other.

    python bench/bench_fsdp_peak.py --out bench/results/fsdp-peak-DATE.json
    mkdir -p /tmp/before && git archive <commit> raytrainer | tar -x -C /tmp/before
    python bench/bench_fsdp_peak.py --before /tmp/before --steps 5     # before and after, one run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def child(model: str, side: str, out: str) -> None:
    import resource
    import time

    import torch
    from torch import nn

    from raytrainer import Trainer, TrainerCallback, TrainingArguments

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            layers = []
            for _ in range(12):
                layers += [nn.Linear(4096, 4096, bias=False), nn.Tanh()]
            self.layers = nn.Sequential(*layers)

        def forward(self, x, labels=None):
            out = self.layers(x)
            return {"loss": ((out - labels) ** 2).mean(), "logits": out}

    def linear():
        return Stack()

    def causal_lm():
        import transformers

        config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12,
                                          num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                                          max_position_embeddings=128, tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(config)

    class Peak(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            with open("/proc/self/status") as f:
                self.begin = int(f.read().split("VmRSS:")[1].split()[0]) // 1024
            self.ends = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

        def on_train_end(self, args, state, control, **kwargs):
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
            import raytrainer

            params = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                         for p in kwargs["model"].parameters())
            with open(os.path.join(args.output_dir, f"rank{args.process_index}.json"), "w") as f:
                json.dump({"begin_mib": self.begin, "peak_mib": peak, "local_params": params,
                           "steady_step_s": (self.ends[-1] - self.ends[0]) / (len(self.ends) - 1),
                           "raytrainer": raytrainer.__file__}, f)

    torch.manual_seed(0)
    if model == "linear":
        data = [{"x": torch.randn(4096), "labels": torch.randn(4096)} for _ in range(64)]
        init = linear
        fsdp = dict(fsdp="full_shard", fsdp_config={"transformer_layer_cls_to_wrap": ["Linear"]})
    else:
        data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 32000, (64, 64))]
        init, fsdp = causal_lm, dict(fsdp="full_shard")
    args = TrainingArguments(output_dir=out, num_workers=2, max_steps=int(os.environ.get("BENCH_STEPS", 3)),
                             per_device_train_batch_size=4, save_strategy="no", report_to="none",
                             disable_tqdm=True, logging_steps=1, **(fsdp if side == "fsdp" else {}))
    trainer = Trainer(model_init=init, args=args, train_dataset=data, callbacks=[Peak()])
    trainer.train()
    trainer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--models", default="linear,causal_lm")
    p.add_argument("--before", help="another raytrainer checkout (e.g. a git archive of an older commit): "
                                    "the sides ddp@before and fsdp@before run with it, driver and workers")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", help="JSON results")
    a = p.parse_args()
    if a.child:
        return child(*a.child)
    from _machine import machine_info

    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled", BENCH_STEPS=str(a.steps))
    sides = ["ddp", "fsdp"] + (["ddp@before", "fsdp@before"] if a.before else [])
    rows = []
    for model in a.models.split(","):
        for side in sides:
            out = tempfile.mkdtemp(prefix=f"fsdp-peak-{model}-{side}-")
            path = os.pathsep.join(filter(None, [a.before, env.get("PYTHONPATH")]))
            side_env = dict(env, PYTHONPATH=path) if side.endswith("@before") else env
            # run from the output folder: the workers put the driver's folder first on their path, and
            # this repository's would shadow --before's raytrainer
            subprocess.run([sys.executable, os.path.abspath(__file__), "--child", model, side.split("@")[0],
                            out], env=side_env, check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=900, cwd=out)
            ranks = []
            for r in (0, 1):
                with open(os.path.join(out, f"rank{r}.json")) as f:
                    ranks.append(json.load(f))
            rows.append({"model": model, "side": side, "ranks": ranks,
                         "peak_mib": max(r["peak_mib"] for r in ranks)})
    for row in rows:
        before = [a.before is not None and r["raytrainer"].startswith(os.path.abspath(a.before))
                  for r in row["ranks"]]
        assert before == [row["side"].endswith("@before")] * 2, row  # each side ran the raytrainer it names
    print("| model | side | peak RSS / worker (MiB) | x DDP (same tree) | RSS at train begin (MiB) | "
          "parameters / worker | s / step |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        ddp_side = "ddp@before" if row["side"].endswith("@before") else "ddp"
        ddp = next(r for r in rows if r["model"] == row["model"] and r["side"] == ddp_side)["peak_mib"]
        rank0 = row["ranks"][0]
        print(f"| {row['model']} | {row['side']} | {row['peak_mib']:,} | {row['peak_mib'] / ddp:.2f}x | "
              f"{rank0['begin_mib']:,} | {rank0['local_params'] / 1e6:.1f}M | {rank0['steady_step_s']:.2f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"machine": machine_info(os.path.dirname(HERE)), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
