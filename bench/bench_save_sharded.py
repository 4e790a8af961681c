#!/usr/bin/env python
"""How long a training step is blocked by a checkpoint save on 2 Ray workers, sharded against consolidated.

A plain torch model from ``model_init`` (``--depth`` x ``Linear(--width, --width)``, 201M parameters by
default, ~800 MB of float32; with AdamW's two moments a checkpoint is ~2.4 GB) trains ``--steps`` steps on
2 CPU workers, saving every ``--save-steps``, one side after the other in one Ray instance:

    fsdp_sharded   FSDP, ``SHARDED_STATE_DICT`` (the default): each rank writes its DCP shard of the model
                   and of the optimizer state, nothing gathered
    fsdp_full      FSDP, ``FULL_STATE_DICT``: rank 0 gathers the model and the optimizer state and writes
                   ``model.safetensors`` and ``optimizer.pt`` (the save before issue 33, kept on request)
    zero3_sharded  DeepSpeed ZeRO-3: the engine's partitions only
    zero3_gathered ZeRO-3 with ``stage3_gather_16bit_weights_on_model_save``: the partitions plus the
                   gathered ``model.safetensors`` on rank 0 (the save before issue 33)

Blocked time per save, on rank 0: the gap between a save step's ``on_step_end`` and the next step's
``on_step_begin``, less the median gap after the steps that do not save. The table shows the median over
the saves.

    python bench/bench_save_sharded.py --out results.json --md results.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import cloudpickle
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import raytrainer
from raytrainer import Trainer, TrainerCallback, TrainingArguments

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SIDES = ("fsdp_sharded", "fsdp_full", "zero3_sharded", "zero3_gathered")


class Stack(nn.Module):
    """Plain torch layers (each ``Linear`` has its own ``reset_parameters``), a squared-error loss."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x, labels=None):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return {"loss": ((x - labels) ** 2).mean(), "logits": x}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, width: int):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, width, generator=g), torch.randn(n, width, generator=g).tanh()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Gaps(TrainerCallback):
    """Rank 0 writes, per step, the seconds from its on_step_end to the next step's on_step_begin."""

    def __init__(self, path: str):
        self.path, self.ended, self.gaps = path, None, {}

    def on_step_begin(self, args, state, control, **kwargs):
        if self.ended is not None:
            self.gaps[state.global_step] = time.monotonic() - self.ended

    def on_step_end(self, args, state, control, **kwargs):
        self.ended = time.monotonic()

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            with open(self.path, "w") as f:
                json.dump(self.gaps, f)


def side_args(side: str, out: str, a) -> dict:
    if side.startswith("fsdp"):
        kw = {"fsdp": "full_shard auto_wrap", "fsdp_config": {
            "transformer_layer_cls_to_wrap": ["Linear"],
            "state_dict_type": "SHARDED_STATE_DICT" if side == "fsdp_sharded" else "FULL_STATE_DICT"}}
    else:
        zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": side == "zero3_gathered"}
        kw = {"deepspeed": {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                            "gradient_clipping": "auto", "zero_optimization": zero}}
    return dict(output_dir=out, num_workers=2, per_device_train_batch_size=2, max_steps=a.steps,
                save_strategy="steps", save_steps=a.save_steps, save_total_limit=1, logging_steps=1000,
                report_to="none", disable_tqdm=True, learning_rate=1e-4, optim="adamw_torch", **kw)


def run_side(side: str, a, work: str) -> dict:
    out, gaps_file = os.path.join(work, side), os.path.join(work, f"{side}.gaps.json")
    args = TrainingArguments(**side_args(side, out, a))
    trainer = Trainer(model_init=lambda: Stack(a.width, a.depth), args=args, train_dataset=Rows(64, a.width),
                      callbacks=[Gaps(gaps_file)])
    started = time.monotonic()
    trainer.train()
    wall = time.monotonic() - started
    with open(gaps_file) as f:
        gaps = {int(k): v for k, v in json.load(f).items()}  # keyed by the step that ended
    saves = [s for s in gaps if s % a.save_steps == 0]
    plain = [gaps[s] for s in gaps if s % a.save_steps != 0]
    base = statistics.median(plain)
    blocked = [gaps[s] - base for s in saves]
    last = max(int(n.split("-")[1]) for n in os.listdir(out) if n.startswith("checkpoint-"))
    folder = os.path.join(out, f"checkpoint-{last}")
    files = {os.path.relpath(os.path.join(r, n), folder): os.path.getsize(os.path.join(r, n))
             for r, _, ns in os.walk(folder) for n in ns}
    shutil.rmtree(out, ignore_errors=True)
    return {"side": side, "blocked_s": statistics.median(blocked), "blocked_each_s": blocked,
            "step_gap_s": base, "wall_s": wall, "checkpoint_bytes": sum(files.values()),
            "gathered_model": "model.safetensors" in files, "largest_file": max(files, key=files.get),
            "largest_file_bytes": max(files.values())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--save-steps", type=int, default=3)
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--out")
    p.add_argument("--md")
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = tempfile.mkdtemp(prefix="bench-save-sharded-")
    rows = []
    try:
        for side in a.sides.split(","):
            rows.append(run_side(side, a, work))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        raytrainer.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    params = a.depth * (a.width * a.width + a.width)
    by = {r["side"]: r for r in rows}
    head = ("| side | blocked per save (s) | vs consolidated | checkpoint (MB) | gathered model.safetensors "
            "| largest file (MB) |")
    lines = [f"{params / 1e6:.1f}M parameters, 2 CPU workers, {a.steps} steps, a save every {a.save_steps}",
             "", head, "|---|---:|---:|---:|---|---:|"]
    for r in rows:
        ref = by.get(r["side"].split("_")[0] + ("_full" if r["side"].startswith("fsdp") else "_gathered"))
        ratio = f"{r['blocked_s'] / ref['blocked_s']:.2f}x" if ref else ""
        lines.append(f"| {r['side']} | {r['blocked_s']:.2f} | {ratio} | {r['checkpoint_bytes'] / 1e6:,.0f} | "
                     f"{'yes' if r['gathered_model'] else 'no'} | {r['largest_file_bytes'] / 1e6:,.0f} |")
    table = "\n".join(lines)
    print(table)
    meta = {"date": datetime.date.today().isoformat(), "params": params, "width": a.width, "depth": a.depth,
            "steps": a.steps, "save_steps": a.save_steps, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(meta, f, indent=2)
    if a.md:
        with open(a.md, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
