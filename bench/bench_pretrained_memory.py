#!/usr/bin/env python
"""Fine-tuning from ``from_pretrained`` inside ``model_init`` on 2 workers: peak memory per worker.

A LLaMA-shaped causal LM (``--layers`` decoder layers of width ``--hidden``, a 32k vocabulary, tied
embeddings; ~213M parameters by default) is saved once with ``save_pretrained`` (float32), then fine-tuned
for ``--steps`` steps on 2 Ray workers (CPU, gloo) with ``model_init=lambda:
AutoModelForCausalLM.from_pretrained(path)``, three ways, each in its own fresh driver process (its own
local Ray instance, so its own fresh workers):

    ddp          num_workers=2 (DistributedDataParallel: every rank holds the model, its gradients and
                 AdamW's moments)
    fsdp         fsdp="full_shard auto_wrap" on LlamaDecoderLayer: every rank builds the model on the meta
                 device and reads its own shards from the safetensors file (``strategies/file_shards.py``)
    fsdp_rank0   the same with ``fsdp_config["cpu_ram_efficient_loading"]``: rank 0 builds the whole model
                 and broadcasts it into every rank's shard (what every from_pretrained took before)

and, with ``--sides``: ``hosted_ddp``, ``hosted_fsdp``, ``hosted_fsdp_rank0``, the same three with
``on_ray(transformers.Trainer)`` (transformers' loop on each rank: under FSDP each rank reads its shards,
worker/hosted_loading.py; with ``cpu_ram_efficient_loading`` every rank loads the whole model, which is what
every hosted trainer did before, and accelerate broadcasts rank 0's); ``zero3`` (DeepSpeed ZeRO-3,
``from_pretrained`` partitioned by transformers' ``zero.Init``; DeepSpeed's buckets sized for a CPU worker,
as docs/architecture.md explains), and
``fsdp_config`` / ``zero3_config``: the same model from ``from_config`` (initialised, not loaded).

On every worker a callback reads the kernel's high-water mark of the process's RSS (``VmHWM``: its whole
life, the build included) at ``on_train_begin`` and after the last step, and the parameter bytes the rank
holds. The driver prints a Markdown table with each side's figures against DDP's (the issue's bar: peak RSS
per worker <= 0.6x DDP's).

Usage:
    python bench/bench_pretrained_memory.py --out results.json --md results.md       # ~6 minutes
    python bench/bench_pretrained_memory.py --layers 2 --hidden 256                  # a quick check
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDES = ("ddp", "fsdp", "fsdp_rank0")
MORE = ("zero3", "fsdp_config", "zero3_config")  # --sides ddp,zero3,fsdp_config,zero3_config
HOSTED = ("hosted_ddp", "hosted_fsdp", "hosted_fsdp_rank0")  # --sides hosted_ddp,hosted_fsdp,...


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def run_child(cfg: dict) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    import raytrainer
    from raytrainer import TrainerCallback

    class Probe(TrainerCallback):
        """On every worker: VmHWM at train begin and at the end, the parameter bytes this rank holds."""

        def __init__(self, out: str):
            self.out = out
            self.at_begin = self.held = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.at_begin = _status_kb("VmHWM")
            self.held = sum(getattr(p, "ds_tensor", p.to_local() if hasattr(p, "to_local") else p).nbytes
                            for p in model.parameters())

        def on_train_end(self, args, state, control, **kwargs):
            with open(os.path.join(self.out, f"rank-{args.process_index}.json"), "w") as f:
                json.dump({"vmhwm_train_begin_kb": self.at_begin, "vmhwm_end_kb": _status_kb("VmHWM"),
                           "param_bytes_held": self.held, "global_step": state.global_step}, f)

    path = cfg["pretrained"]
    hosted = cfg["side"].startswith("hosted_")  # transformers' Trainer on the workers (on_ray)
    side = cfg["side"].removeprefix("hosted_")
    if hosted:
        Trainer = raytrainer.on_ray(transformers.Trainer)
        TrainingArguments = raytrainer.config_on_ray(transformers.TrainingArguments)
    else:
        Trainer, TrainingArguments = raytrainer.Trainer, raytrainer.TrainingArguments

    def model_init():
        if side.endswith("_config"):  # the same model from its config: initialised, not loaded
            from transformers import AutoConfig

            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        return AutoModelForCausalLM.from_pretrained(path)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab"], (64, cfg["seq"]), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    if side == "ddp":
        sharding = {}
    elif side.startswith("zero3"):  # DeepSpeed's buckets sized for a CPU worker (docs/architecture.md)
        sharding = {"deepspeed": {
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 2e7, "stage3_prefetch_bucket_size": 2e7,
                                  "stage3_max_live_parameters": 5e7, "stage3_max_reuse_distance": 5e7,
                                  "sub_group_size": 2e7}}}
    else:
        sharding = {"fsdp": "full_shard auto_wrap",
                    "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                    **({"cpu_ram_efficient_loading": True} if side == "fsdp_rank0" else {})}}
    args = TrainingArguments(output_dir=os.path.join(cfg["run_dir"], "out"), num_workers=2,
                             per_device_train_batch_size=2, max_steps=cfg["steps"], learning_rate=1e-4,
                             optim="adamw_torch", save_strategy="no", logging_steps=1, report_to="none",
                             disable_tqdm=True, **sharding)
    trainer = Trainer(model_init=model_init, args=args, train_dataset=data, callbacks=[Probe(cfg["run_dir"])])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    with open(os.path.join(cfg["run_dir"], "driver.json"), "w") as f:
        json.dump({"losses": losses}, f)


def save_pretrained(folder: str, opts) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=opts.vocab, hidden_size=opts.hidden,
                         intermediate_size=opts.hidden * 11 // 4,
                         num_hidden_layers=opts.layers, num_attention_heads=opts.hidden // 64,
                         num_key_value_heads=opts.hidden // 64, max_position_embeddings=opts.seq,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def run_side(side: str, cfg: dict, workdir: str, timeout: float) -> dict:
    run_dir = os.path.join(workdir, side)
    os.makedirs(run_dir)
    child = {**cfg, "side": side, "run_dir": run_dir}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    with open(os.path.join(run_dir, "driver.log"), "w") as log:
        rc = subprocess.run([sys.executable, __file__, "--child", json.dumps(child)], env=env, stdout=log,
                            stderr=subprocess.STDOUT, timeout=timeout).returncode
    if rc != 0:
        raise SystemExit(f"side {side} failed (rc {rc}); see {run_dir}/driver.log")
    ranks = [_load(os.path.join(run_dir, f"rank-{r}.json")) for r in (0, 1)]
    return {"ranks": ranks, **_load(os.path.join(run_dir, "driver.json"))}


def _load(path: str):
    with open(path) as f:
        return json.load(f)


def markdown(result: dict) -> str:
    MiB = 1024
    base = "ddp" if "ddp" in result["sides"] else "hosted_ddp"
    ddp = max(r["vmhwm_end_kb"] for r in result["sides"][base]["ranks"])
    lines = [f"{result['date']}, {result['machine']}: {result['params'] / 1e6:.0f}M parameters (float32 file "
             f"{result['file_bytes'] / 2**20:.0f} MiB), 2 CPU workers, {result['steps']} steps",
             "", "| side | peak RSS rank 0 / rank 1 (MiB) | at train begin rank 0 / rank 1 (MiB) | "
             "largest peak / DDP's | parameters held per rank (MiB) |", "|---|---|---|---|---|"]
    for side, data in result["sides"].items():
        r0, r1 = data["ranks"]
        peak = max(r0["vmhwm_end_kb"], r1["vmhwm_end_kb"])
        lines.append(f"| {side} | {r0['vmhwm_end_kb'] // MiB:,} / {r1['vmhwm_end_kb'] // MiB:,} | "
                     f"{r0['vmhwm_train_begin_kb'] // MiB:,} / {r1['vmhwm_train_begin_kb'] // MiB:,} | "
                     f"{peak / ddp:.2f}x | {r0['param_bytes_held'] / 2**20:.0f} / "
                     f"{r1['param_bytes_held'] / 2**20:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=14)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out")
    p.add_argument("--md")
    opts = p.parse_args()
    if opts.child:
        return run_child(json.loads(opts.child))
    with tempfile.TemporaryDirectory(prefix="bench-pretrained-") as workdir:
        folder = os.path.join(workdir, "pretrained")
        params = save_pretrained(folder, opts)
        cfg = {"pretrained": folder, "vocab": opts.vocab, "seq": opts.seq, "steps": opts.steps}
        result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.node()}, "
                  f"{os.cpu_count()} cores", "params": params, "steps": opts.steps,
                  "file_bytes": os.path.getsize(os.path.join(folder, "model.safetensors")), "sides": {}}
        for side in opts.sides.split(","):
            result["sides"][side] = run_side(side, cfg, workdir, opts.timeout)
            print(side, json.dumps(result["sides"][side]), flush=True)
    table = markdown(result)
    print(table)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(result, f, indent=1)
    if opts.md:
        with open(opts.md, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
