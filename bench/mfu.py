"""Model FLOPs utilisation: the same LLaMA-shaped decoder trained by a hand-written PyTorch loop, by
transformers.Trainer and by raytrainer (``num_workers=0``, and ``num_workers=1, use_gpu=True`` where ray is
importable), each in a fresh process, in one run.

    python bench/mfu.py --out OUT.json --md OUT.md          # ~1.1B parameters, sequence 2048, bf16, on CUDA
    python bench/mfu.py --tiny --check                      # the same code, a tiny config, on CPU (CI)
    python bench/mfu.py --variants                          # also: torch_compile, unfused AdamW, no pinned
                                                            # memory, the loss read every step

Every side: the same random-init model (seed 0; TinyLlama-1.1B's shape: 22 layers, hidden 2048, 32 heads,
4 KV heads, MLP 5632, vocabulary 32000), SDPA attention, the same random token batches, bf16 autocast over
fp32 weights (transformers' ``bf16=True``), fused AdamW, a linear schedule, gradient clipping at 1.0, the
loss read on the host only every ``--logging-steps`` steps. ``--warmup`` steps run untimed; the clock
(after a ``cuda.synchronize``) covers the next ``--steps`` optimizer steps.

MFU = model FLOPs / (time x the card's dense bf16 peak). Model FLOPs per token = 6 N + 12 L d s (N: the
parameters that take part in matrix products, i.e. all but the input embedding; L layers, d hidden size,
s sequence length: attention's scores and values, forward and backward, PaLM's appendix B), the same
count for every side. The peak comes from the card's name (989 TFLOP/s for an H100 SXM) or ``--peak-tflops``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# Dense bf16 peak (TFLOP/s, no sparsity) by a substring of torch.cuda.get_device_name(); first match wins.
PEAK_BF16_TFLOPS = [
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("H20", 148.0),
    ("GH200", 989.0), ("B200", 2250.0), ("A100", 312.0), ("A10G", 70.0), ("L40S", 362.0), ("L4", 121.0),
]

FULL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
            num_key_value_heads=4, vocab_size=32000, seq_len=2048, batch_size=8, warmup=5, steps=20,
            logging_steps=10)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, seq_len=64, batch_size=4, warmup=2, steps=4,
            logging_steps=2)

# side -> (what runs, its options). Variants change one thing of raytrainer (or the plain loop).
SIDES = {
    "plain": ("hand-written PyTorch loop", {}),
    "hf": ("transformers.Trainer", {}),
    "rt0": ("raytrainer, num_workers=0", {}),
    "rt1": ("raytrainer, num_workers=1 (a Ray Train worker; use_gpu=True on CUDA)", {"num_workers": 1}),
}
VARIANTS = {
    "plain_compile": ("hand-written loop + torch.compile", {"compile": True}),
    "rt0_compile": ("raytrainer num_workers=0, torch_compile=True", {"compile": True}),
    "rt1_compile": ("raytrainer num_workers=1 (Ray Train worker), torch_compile=True",
                    {"num_workers": 1, "compile": True}),
    "rt1_init": ("raytrainer num_workers=1 (Ray Train worker), model_init (the worker builds the model)",
                 {"num_workers": 1, "model_init": True}),
    "rt0_unfused": ("raytrainer num_workers=0, optim=adamw_torch (foreach, not fused)",
                    {"optim": "adamw_torch"}),
    "rt0_nopin": ("raytrainer num_workers=0, dataloader_pin_memory=False", {"pin_memory": False}),
    "rt0_log1": ("raytrainer num_workers=0, logging_steps=1 (a host sync every step)", {"logging_steps": 1}),
}


# -- what every side shares ----------------------------------------------------------------------------
def model_config(cfg: dict):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                       num_hidden_layers=cfg["num_hidden_layers"],
                       num_attention_heads=cfg["num_attention_heads"],
                       num_key_value_heads=cfg["num_key_value_heads"], vocab_size=cfg["vocab_size"],
                       max_position_embeddings=cfg["seq_len"], attn_implementation="sdpa",
                       tie_word_embeddings=False, use_cache=False)


def build_model(cfg: dict, device: str | None = "cpu"):
    """The same weights on every side: built under seed 0 (directly on ``device``, which is quicker; None:
    on the default device, or the one a caller's device context names)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device) if device else contextlib.nullcontext():
        return LlamaForCausalLM(model_config(cfg))


class TokenDataset:
    """Random token sequences (seed 1); labels are the inputs (the model shifts them)."""

    def __init__(self, cfg: dict, n: int):
        import torch

        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, cfg["vocab_size"], (n, cfg["seq_len"]), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def flops_per_token(cfg: dict) -> float:
    d, f, L, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = d * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * f  # q, o; k, v; gate, up, down
    n_matmul = L * per_layer + d * v  # + lm_head (the input embedding is a lookup)
    return 6.0 * n_matmul + 12.0 * L * d * cfg["seq_len"]


class Clock:
    """Starts at the end of step ``warmup``, stops at the end of step ``warmup + steps``; both after a
    device synchronisation, so the interval holds the steps' whole GPU work and nothing else."""

    def __init__(self, warmup: int, steps: int):
        self.warmup, self.steps = warmup, steps
        self.t0 = self.t1 = None

    def step_end(self, step: int) -> None:
        if step == self.warmup or step == self.warmup + self.steps:
            _sync()
            now = time.perf_counter()
            if step == self.warmup:
                self.t0 = now
            else:
                self.t1 = now

    @property
    def seconds(self) -> float | None:
        return None if self.t0 is None or self.t1 is None else self.t1 - self.t0


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _peak_gib() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def write_result(path: str, clock: Clock, losses: list, steps_done: int, **extra) -> None:
    import torch

    record = {"seconds": clock.seconds, "losses": losses, "steps_done": steps_done, "peak_gib": _peak_gib(),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", **extra}
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


# -- the sides -----------------------------------------------------------------------------------------
def run_plain(cfg: dict, opts: dict, out: str) -> None:
    """What the trainers do per step and nothing more."""
    import torch

    device = _device()
    model = build_model(cfg, device)
    total = cfg["warmup"] + cfg["steps"]
    data = TokenDataset(cfg, total * cfg["batch_size"])
    # The order raytrainer's sampler gives (seed 0): the logged losses of the two sides can be compared.
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=cfg["batch_size"], sampler=sampler, drop_last=True,
                                         pin_memory=device == "cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, (total - s) / total))
    forward = torch.compile(model) if opts.get("compile") else model
    clock, losses, running = Clock(cfg["warmup"], cfg["steps"]), [], torch.zeros((), device=device)
    model.train()
    for step, batch in enumerate(loader, start=1):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = forward(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        running += loss.detach()
        if step % cfg["logging_steps"] == 0:
            losses.append(round(running.item() / cfg["logging_steps"], 4))
            running.zero_()
        clock.step_end(step)
        if step == 1:
            _sync()
            first_step_at = time.time()
    write_result(out, clock, losses, step, first_step_s=first_step_at - cfg["launched_at"])


def _trainer_kwargs(cfg: dict, opts: dict, out_dir: str) -> dict:
    """TrainingArguments fields raytrainer and transformers share."""
    total = cfg["warmup"] + cfg["steps"]
    return dict(output_dir=out_dir, max_steps=total, per_device_train_batch_size=cfg["batch_size"],
                learning_rate=1e-4, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0,
                max_grad_norm=1.0, optim=opts.get("optim", "adamw_torch_fused"), bf16=True,
                logging_steps=opts.get("logging_steps", cfg["logging_steps"]), save_strategy="no",
                eval_strategy="no", report_to="none", disable_tqdm=True, dataloader_drop_last=True,
                dataloader_pin_memory=opts.get("pin_memory", True), torch_compile=opts.get("compile", False),
                seed=0, data_seed=0)


def _callback(base, cfg: dict, out: str):
    """A TrainerCallback (of ``base``) that runs the clock and writes the result on the rank that trains."""

    class MFUCallback(base):
        def __init__(self):
            self.clock, self.losses = Clock(cfg["warmup"], cfg["steps"]), []
            self.marks = {}  # phase -> seconds since the side's launch (the driver's marks travel along)

        def mark(self, phase: str) -> None:
            self.marks[phase] = round(time.time() - cfg["launched_at"], 2)

        def on_train_begin(self, args, state, control, **kwargs):
            self.mark("on_train_begin")

        def on_step_end(self, args, state, control, **kwargs):
            self.clock.step_end(state.global_step)
            if state.global_step == 1:
                _sync()
                self.first_step_at = time.time()
                self.mark("first_step_end")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

        def on_train_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:  # the side's launch time: the clock of the same machine
                write_result(out, self.clock, self.losses, state.global_step,
                             first_step_s=self.first_step_at - cfg["launched_at"], phases=self.marks)

    return MFUCallback()


def run_hf(cfg: dict, opts: dict, out: str) -> None:
    import torch
    import transformers

    args = transformers.TrainingArguments(**_trainer_kwargs(cfg, opts, os.path.dirname(out) + "/hf"),
                                          use_cpu=not torch.cuda.is_available())
    trainer = transformers.Trainer(model=build_model(cfg, _device()), args=args,
                                   train_dataset=TokenDataset(cfg, args.max_steps * cfg["batch_size"]),
                                   callbacks=[_callback(transformers.TrainerCallback, cfg, out)])
    trainer.train()


def run_raytrainer(cfg: dict, opts: dict, out: str) -> None:
    import torch

    import raytrainer

    workers = opts.get("num_workers", 0)
    use_gpu = workers > 0 and torch.cuda.is_available()
    args = raytrainer.TrainingArguments(**_trainer_kwargs(cfg, opts, os.path.dirname(out) + "/rt"),
                                        num_workers=workers, use_gpu=use_gpu)
    # num_workers=0 trains in this process: build on its device. On Ray the model travels to the worker as a
    # user's model= does (the driver, which does not train, builds it on the CPU); with model_init the worker
    # builds it (the driver's Trainer builds one on the CPU too, as transformers' does).
    callback = _callback(raytrainer.TrainerCallback, cfg, out)
    callback.mark("imports_done")
    if opts.get("model_init"):
        def model_init():
            start = time.time() - cfg["launched_at"]
            built = build_model(cfg, None)
            with open(out + ".model_init", "a") as f:  # each call: pid, start and end since the launch
                f.write(f"{os.getpid()} {start:.2f} {time.time() - cfg['launched_at']:.2f}\n")
            return built

        model = {"model_init": model_init}
    else:
        model = {"model": build_model(cfg, _device() if workers == 0 else "cpu")}
    trainer = raytrainer.Trainer(**model, args=args,
                                 train_dataset=TokenDataset(cfg, args.max_steps * cfg["batch_size"]),
                                 callbacks=[callback])
    callback.mark("trainer_built")
    trainer.train()


RUNNERS = {"plain": run_plain, "hf": run_hf, "rt0": run_raytrainer, "rt1": run_raytrainer}


# -- the driver ----------------------------------------------------------------------------------------
def _peak_tflops(device_name: str, override: float | None) -> float | None:
    if override:
        return override
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


def _versions() -> dict:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for dist in ("torch", "transformers", "accelerate", "ray", "deepspeed"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[dist] = md.version(dist)
    with contextlib.suppress(Exception):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = smi.stdout.strip()
    code = "import torch; print(torch.version.cuda or '')"
    with contextlib.suppress(Exception):
        out["torch_cuda"] = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           timeout=120).stdout.strip()
    with contextlib.suppress(Exception):
        out["commit"] = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                                       capture_output=True, text=True, timeout=30).stdout.strip()
    return out


def _ray_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


def _run_side(side: str, opts: dict, cfg: dict, workdir: str, timeout: float) -> dict:
    out = os.path.join(workdir, side, "result.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--run-side", side, "--config",
           json.dumps({"cfg": {**cfg, "launched_at": time.time()}, "opts": opts}), "--result", out]
    log = os.path.join(workdir, f"{side}.log")
    start = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.time() - start
    if rc != 0 or not os.path.exists(out):
        with open(log) as f:
            tail = f.read()[-3000:]
        return {"side": side, "error": f"exit {rc}", "log_tail": tail, "wall_s": wall}
    with open(out) as f:
        result = json.load(f)
    result.update(side=side, wall_s=wall)
    return result


def _row(result: dict, cfg: dict, peak: float | None) -> dict:
    if "error" in result or not result.get("seconds"):
        return result
    tokens = cfg["steps"] * cfg["batch_size"] * cfg["seq_len"]
    tps = tokens / result["seconds"]
    achieved = flops_per_token(cfg) * tps / 1e12
    return {**result, "tokens_per_s": tps, "step_ms": 1000 * result["seconds"] / cfg["steps"],
            "tflops": achieved, "mfu": achieved / peak if peak else None}


def markdown(rows: list[dict], labels: dict) -> str:
    base = next((r for r in rows if r["side"] == "plain" and "tokens_per_s" in r), None)
    lines = ["| side | what runs | tokens/s | step (ms) | TFLOP/s | MFU | vs hand-written | peak GPU memory "
             "(GiB) | first step (s) | wall (s) | logged losses |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['side']} | {labels[r['side']]} | failed: {r.get('error')} | | | | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}x" if base else "n/a"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "n/a"
        losses = ", ".join(f"{x:.4f}" for x in r["losses"])
        first = f"{r['first_step_s']:.1f}" if r.get("first_step_s") is not None else "n/a"
        lines.append(f"| {r['side']} | {labels[r['side']]} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | "
                     f"{r['tflops']:.1f} | {mfu} | {ratio} | {peak} | {first} | {r['wall_s']:.0f} | "
                     f"{losses} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny config (runs on CPU; what CI runs)")
    p.add_argument("--sides", help=f"comma-separated, from {', '.join([*SIDES, *VARIANTS])} "
                                   "(default: plain,hf,rt0 and rt1 where ray is importable)")
    p.add_argument("--variants", action="store_true", help="also run " + ", ".join(VARIANTS))
    for key in ("batch_size", "seq_len", "warmup", "steps", "logging_steps", "num_hidden_layers"):
        p.add_argument("--" + key.replace("_", "-"), type=int, dest=key)
    p.add_argument("--peak-tflops", type=float, help="the card's dense bf16 peak (where its name is unknown)")
    p.add_argument("--out", help="write the raw results (JSON) here")
    p.add_argument("--md", help="write the table (Markdown) here")
    p.add_argument("--workdir", help="logs and per-side results (default: a new temporary folder)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per side")
    p.add_argument("--check", action="store_true", help="exit 1 unless every side produced its row")
    p.add_argument("--run-side", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()

    if a.run_side:  # inside a side's own process
        spec = json.loads(a.config)
        RUNNERS[a.run_side.split("_")[0]](spec["cfg"], spec["opts"], a.result)
        return 0

    cfg = dict(TINY if a.tiny else FULL)
    cfg.update({k: getattr(a, k) for k in ("batch_size", "seq_len", "warmup", "steps", "logging_steps",
                                            "num_hidden_layers") if getattr(a, k) is not None})
    labels = {k: v[0] for k, v in {**SIDES, **VARIANTS}.items()}
    if a.sides:
        sides = a.sides.split(",")
        unknown = [s for s in sides if s not in labels]
        if unknown:
            p.error(f"unknown side {unknown[0]!r}; choose from {', '.join(labels)}")
    else:
        sides = ["plain", "hf", "rt0"] + (["rt1"] if _ray_importable() else [])
        if a.variants:
            sides += list(VARIANTS)
    workdir = a.workdir or tempfile.mkdtemp(prefix="raytrainer-mfu-")
    os.makedirs(workdir, exist_ok=True)
    versions = _versions()
    print(f"config: {json.dumps(cfg)}\nversions: {json.dumps(versions)}\nworkdir: {workdir}", flush=True)

    results = []
    for side in sides:
        opts = {**SIDES, **VARIANTS}[side][1]
        result = _run_side(side, opts, cfg, workdir, a.timeout)
        results.append(result)
        state = "failed: " + result["error"] if "error" in result else f"{result['seconds']:.2f} s timed"
        print(f"{side}: {state} ({result['wall_s']:.0f} s in all)", flush=True)
        if "error" in result:
            print(result["log_tail"], flush=True)
    device = next((r["device"] for r in results if "device" in r), "cpu")
    peak = _peak_tflops(device, a.peak_tflops)
    rows = [_row(r, cfg, peak) for r in results]
    table = markdown(rows, labels)
    header = (f"{device}; peak {peak or 'unknown'} TFLOP/s bf16 dense; {flops_per_token(cfg) / 1e9:.3g} "
              f"GFLOP per token; {cfg['steps']} timed steps of {cfg['batch_size']} x {cfg['seq_len']} tokens "
              f"after {cfg['warmup']} warm-up steps")
    print("\n" + header + "\n\n" + table, flush=True)
    record = {"config": cfg, "versions": versions, "device": device, "peak_tflops": peak,
              "flops_per_token": flops_per_token(cfg), "rows": rows,
              "date": time.strftime("%Y-%m-%d %H:%M %Z")}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)
    if a.md:
        with open(a.md, "w") as f:
            f.write(header + "\n\n" + table + "\n")
    if a.check:
        bad = [r["side"] for r in rows if "tokens_per_s" not in r or not math.isfinite(r["tokens_per_s"])
               or not r["losses"] or not all(math.isfinite(x) for x in r["losses"])
               or r["steps_done"] != cfg["warmup"] + cfg["steps"]]
        if bad:
            print(f"--check: no valid row for {', '.join(bad)} (logs in {workdir})", flush=True)
            return 1
        print(f"--check: every side ({', '.join(sides)}) produced its row", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
