"""TRL SFT on 2 CPU workers: raytrainer (``raytrainer.trl.SFTTrainer``, ``num_workers=2``) against the same
script under ``accelerate launch --num_processes 2`` (TRL's ``SFTTrainer`` as it is), side by side, ABAB.

Per run, from a callback on every rank (written to ``<output_dir>/timing-rank<r>.json``):

  first step     seconds from the launch command (``BENCH_T0``) to the end of optimizer step 1: for
                 raytrainer a cold Ray start, the workers' start and imports, building the trainer on each
                 rank; for accelerate launch the processes' start, imports, building the trainer
  steady         optimizer steps per second from step ``--warmup`` to the last step (the slower rank)
  peak memory    each rank process's peak resident memory (``ru_maxrss``), the larger of the two

The model is a GPT-2 of 4 layers x 256 wide (12.8 M parameters) built from a config, the data 4,096 rows
of generated text: big enough that a step is compute, not overhead. Prints a Markdown table and writes the
raw numbers as JSON. Not a test: nothing asserts.

    python bench/bench_trl_sft.py --rounds 2 --out bench/results/trl-sft.json
    python bench/bench_trl_sft.py --rounds 2 --cluster   # Ray already running, as on a cluster
    # before and after a change, in one run:
    mkdir -p /tmp/before && git archive HEAD raytrainer | tar -x -C /tmp/before
    python bench/bench_trl_sft.py --rounds 2 --sides accelerate,raytrainer,raytrainer@before \
        --before /tmp/before
    # peak memory under FSDP against DDP (issue 53), on a model whose weights and Adam state outweigh the
    # ~600 MB every rank spends on torch, transformers and TRL:
    python bench/bench_trl_sft.py --rounds 1 --sides accelerate,accelerate-fsdp,raytrainer,raytrainer-fsdp \
        --layers 12 --width 768 --batch 2 --length 64 --steps 8 --warmup 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(argv: list[str]) -> None:
    """The training script both sides run (``--ray`` picks raytrainer's twins)."""
    import transformers
    from datasets import load_dataset

    ray = "--ray" in argv
    steps = int(argv[argv.index("--max_steps") + 1])

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    out = argv[argv.index("--output_dir") + 1]
    if ray:
        from raytrainer.trl import SFTConfig, SFTTrainer
    else:
        from trl import SFTConfig, SFTTrainer

    class Timing(transformers.TrainerCallback):
        def __init__(self, warmup: int, t0: float):
            self.warmup, self.t0, self.times = warmup, t0, {}  # t0 travels with the callback
            self.begins, self.ends = {}, {}  # every step's on_step_begin / on_step_end time

        def on_train_begin(self, args, state, control, **kwargs):  # built, prepared: what training adds after
            self.rss_at_begin = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

        def on_step_begin(self, args, state, control, **kwargs):
            self.begins[state.global_step + 1] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.ends[state.global_step] = time.perf_counter()
            if state.global_step in (1, self.warmup, state.max_steps):
                self.times[state.global_step] = time.time()

        def on_train_end(self, args, state, control, **kwargs):
            # between a step's end and the next one's begin: logging, and at a save step the save
            gaps = {step: self.begins[step + 1] - end for step, end in self.ends.items()
                    if step + 1 in self.begins}
            record = {"t0": self.t0, "steps": self.times,
                      "raytrainer": getattr(sys.modules.get("raytrainer"), "__file__", None),
                      "warmup": self.warmup, "gaps": gaps,
                      "max_steps": state.max_steps,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "peak_rss_at_begin_mb": self.rss_at_begin}
            with open(os.path.join(args.output_dir, f"timing-rank{args.process_index}.json"), "w") as f:
                json.dump(record, f)

    extra = {"num_workers": 2} if ray else {}
    if "--fsdp" in argv:
        extra["fsdp"] = "full_shard auto_wrap"
    if "--zero3" in argv:
        sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
        from hosted_fixtures import ZERO3

        extra["deepspeed"] = ZERO3
    args = SFTConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=int(flag("--batch")),
                     learning_rate=1e-3, max_length=int(flag("--length")), logging_steps=10,
                     save_strategy="steps" if int(flag("--save-steps")) else "no",
                     save_steps=int(flag("--save-steps")) or 500, report_to="none", use_cpu=True,
                     disable_tqdm=True,
                     dataloader_num_workers=0, seed=0, bf16=False, **extra)
    data = load_dataset("json", data_files=os.path.join(argv[argv.index("--data") + 1], "train.jsonl"))
    trainer = SFTTrainer(model=argv[argv.index("--model") + 1], args=args, train_dataset=data["train"],
                         callbacks=[Timing(warmup=int(flag("--warmup")), t0=float(os.environ["BENCH_T0"]))])
    trainer.train()
    if ray:
        trainer.end()


def make_inputs(folder: str, layers: int = 4, width: int = 256) -> tuple[str, str]:
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
    import torch
    from hosted_fixtures import write_text_data, write_tiny_lm
    from transformers import GPT2Config, GPT2LMHeadModel

    model = write_tiny_lm(os.path.join(folder, "model"))
    torch.manual_seed(0)  # a bigger model with the same tokenizer
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=63, n_positions=128,
                        bos_token_id=2, eos_token_id=2, pad_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(model)
    data = write_text_data(os.path.join(folder, "data"), rows=4096)
    return model, data


def run_side(side: str, folder: str, model: str, data: str, opts) -> dict:
    """One run of ``side``: ``accelerate`` or ``raytrainer``, ``-fsdp`` for ``--fsdp "full_shard
    auto_wrap"``, ``-zero3`` for a ZeRO-3 DeepSpeed config."""
    out = os.path.join(folder, f"out-{side}-{time.time_ns()}")
    os.makedirs(out)
    script = [os.path.abspath(__file__), "--child", "--model", model, "--data", data, "--output_dir", out,
              "--max_steps", str(opts.steps), "--batch", str(opts.batch), "--length", str(opts.length),
              "--warmup", str(opts.warmup), "--save-steps", str(opts.save_steps),
              *([f"--{side.split('@')[0].split('-')[1]}"] if "-" in side else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_T0": repr(time.time())}
    if side.endswith("@before"):  # driver and workers import the older checkout (workers inherit it)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [opts.before, env.get("PYTHONPATH")]))
    if side.startswith("raytrainer"):
        command = [sys.executable, *script, "--ray"]
    else:
        # accelerate's multi-process launcher (torchrun underneath); with use_cpu each process is a CPU rank
        # (MULTI_CPU, gloo). `--cpu --num_processes 2` would start one process: it needs MPI for more.
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", *script]
    subprocess.run(command, env=env, check=True, cwd=folder, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    ranks = []
    for r in (0, 1):
        with open(os.path.join(out, f"timing-rank{r}.json")) as f:
            ranks.append(json.load(f))
    shutil.rmtree(out, ignore_errors=True)
    if side.startswith("raytrainer"):  # each side ran the raytrainer it names
        before = [opts.before is not None and rk["raytrainer"].startswith(os.path.abspath(opts.before))
                  for rk in ranks]
        assert before == [side.endswith("@before")] * 2, (side, [rk["raytrainer"] for rk in ranks])
    first = max(rk["steps"]["1"] - rk["t0"] for rk in ranks)
    steady = min((rk["max_steps"] - rk["warmup"]) / (rk["steps"][str(rk["max_steps"])]
                                                     - rk["steps"][str(rk["warmup"])]) for rk in ranks)
    result = {"first_step_s": first, "steady_steps_per_s": steady,
              "peak_rss_mb": max(rk["peak_rss_mb"] for rk in ranks),
              "peak_rss_at_begin_mb": max(rk["peak_rss_at_begin_mb"] for rk in ranks)}
    if opts.save_steps:  # rank 0 writes: its gap after a save step, less its median gap after another step
        gaps = {int(step): gap for step, gap in ranks[0]["gaps"].items() if int(step) >= opts.warmup}
        saves = [gap for step, gap in gaps.items() if step % opts.save_steps == 0]
        others = [gap for step, gap in gaps.items() if step % opts.save_steps and step % 10]
        result["save_blocks_s"] = statistics.median(saves) - statistics.median(others)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default=None)
    parser.add_argument("--sides", default="accelerate,raytrainer",
                        help="comma-separated: accelerate, raytrainer, each with -fsdp or -zero3; "
                             "raytrainer...@before runs --before's raytrainer")
    parser.add_argument("--before", default=None,
                        help="another raytrainer checkout (e.g. `git archive <commit> raytrainer | tar -x -C "
                             "/tmp/before`), for the sides named ...@before")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--save-steps", type=int, default=0,
                        help="save a checkpoint every N steps and report how long a save blocks the step")
    parser.add_argument("--cluster", action="store_true",
                        help="start a Ray cluster first (`ray start --head`) and run raytrainer's side on "
                             "it, as a Ray user does: the Ray start leaves its time to the first step")
    opts = parser.parse_args()
    if opts.cluster:
        subprocess.run(["ray", "start", "--head", "--num-cpus", "4", "--include-dashboard", "false"],
                       check=True, stdout=subprocess.DEVNULL)
        os.environ["RAY_ADDRESS"] = "auto"
    try:
        _compare(opts)
    finally:
        if opts.cluster:
            subprocess.run(["ray", "stop"], check=False, stdout=subprocess.DEVNULL)


def _compare(opts) -> None:
    folder = tempfile.mkdtemp(prefix="bench-trl-")
    model, data = make_inputs(folder, opts.layers, opts.width)
    sides = opts.sides.split(",")
    runs = {side: [] for side in sides}
    for _ in range(opts.rounds):
        for side in sides:
            runs[side].append(run_side(side, folder, model, data, opts))
            print(side, runs[side][-1], flush=True)
    med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    base = sides[0]
    print(f"\n| measure | {' | '.join(sides)} |\n|---|{'---:|' * len(sides)}")
    for key, label in (("steady_steps_per_s", "steady steps/s"), ("first_step_s", "time to first step (s)"),
                       ("peak_rss_mb", "peak memory per worker (MB)"),
                       ("peak_rss_at_begin_mb", "the same at train begin (MB)"),
                       *([("save_blocks_s", "a save blocks the step (s)")] if opts.save_steps else [])):
        cells = [f"{med[s][key]:.2f} ({med[s][key] / med[base][key]:.2f}x)" for s in sides]
        print(f"| {label} | {' | '.join(cells)} |")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"runs": runs, "median": med, "date": time.strftime("%Y-%m-%d"),
                       "ray": "a running cluster" if opts.cluster else "started by the script"}, f, indent=2)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    if "--child" in sys.argv:
        child(sys.argv)
    else:
        main()
