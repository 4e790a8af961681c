#!/usr/bin/env python
"""raytrainer memory benchmark: peak memory per worker with FSDP full_shard against DDP, 2 workers.

The same ~25M-parameter float32 model (an input layer, ``--depth`` ``Block``s of ``Linear(width, width) +
GELU``, a 10-way head) is trained on 2 Ray Train workers (CPU, gloo) with AdamW, two ways, each in its
own fresh driver process (a subprocess of this script, which starts its own local Ray instance):

    ddp    num_workers=2 (DistributedDataParallel)
    fsdp   num_workers=2, fsdp="full_shard auto_wrap",
           fsdp_config={"transformer_layer_cls_to_wrap": ["Block"]}

    zero3  num_workers=2, deepspeed={"zero_optimization": {"stage": 3}, ... "auto"}

A ``TrainerCallback`` travels, pickled with the Trainer, to every worker and measures there:

- RSS of the worker process: the kernel's high-water mark (``VmHWM``, the whole life of the worker:
  unpickling the run spec and sharding included) and a background thread's samples every
  ``--sample-interval`` s (started when the callback is unpickled on the worker), also on every
  ``on_step_end``; RSS when the callback is unpickled (the Trainer spec is being unpickled: imports done,
  the model's full copy already there) and at ``on_train_begin`` (model set up, optimizer created, no
  optimizer state yet).
- exact bytes of training state on the rank: parameters (``DTensor`` -> ``to_local()``), gradients (in
  ``on_pre_optimizer_step`` of the first step) and optimizer state (after the first step), as unique
  tensor storages (so FSDP's shard padding is counted, and a storage shared by views counted once).
- rank 0's step end times: steady-state samples/s from the end of step ``--steady-from`` to the last step.

Each worker writes ``rank-<r>.json`` into the run's folder; this driver reads them, takes medians over
``--repeats`` (sides interleaved, order rotating) and prints a Markdown table with ratios to DDP and the
verdict against the issue's bar (peak memory per worker below 0.6x of DDP's).

With ``--sizes`` (millions of parameters, e.g. ``25,100,200``) the model is built from ``model_init`` by
default (``--model-from instance`` ships a driver-built model instead), once per size and side, and the side's
driver also records its own peak RSS growth during ``train()`` and at the first access of ``trainer.model``
(VmHWM reset through /proc/self/clear_refs), the run spec's bytes (raytrainer's DEBUG line "run spec: N
bytes"), and, after a 2-worker checkpoint at step 1, the bytes each rank reads when 2 fresh workers resume
from it (/proc/self/io rchar minus the same window of the non-resumed run, plus safetensors files loaded by
mmap).

Usage:
    python bench/bench_memory.py --sizes 25,100,200 --out results.json      # ~30 minutes
    python bench/bench_memory.py --quick                          # ~2M parameters, 1 repeat, ~2 minutes
    python bench/bench_memory.py --out /tmp/bench-memory.json --md /tmp/bench-memory.md   # ~5 minutes

See bench/README.md (section "Memory benchmark").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MiB = 2**20
MB = 1e6
BAR = 0.6

SIDES = {
    "ddp": "DDP, 2 workers",
    "fsdp": 'FSDP2 "full_shard auto_wrap" (Block), 2 workers',
    "zero3": "DeepSpeed ZeRO-3, 2 workers",
    "zero3_small": "DeepSpeed ZeRO-3 with CPU-sized buckets (see ZERO3_SMALL), 2 workers",
    "zero3_tiles": "DeepSpeed ZeRO-3 with CPU-sized buckets and optimizer tiles (see ZERO3_TILES), 2 workers",
}
NOT_MEASURED: dict[str, str] = {}
ZERO3 = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
         "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
         "zero_optimization": {"stage": 3}}
# DeepSpeed's defaults are sized for GPUs (reduce_bucket_size 5e8 elements = a 2 GB float32 bucket,
# stage3_max_live_parameters 1e9: a 200M model stays gathered); these keep ~2 Blocks of a 200M model live
ZERO3_SMALL = dict(ZERO3, zero_optimization={
    "stage": 3, "reduce_bucket_size": 20_000_000, "stage3_prefetch_bucket_size": 20_000_000,
    "stage3_max_live_parameters": 50_000_000, "stage3_max_reuse_distance": 50_000_000})
# ... and the optimizer step in tiles of 2e7 elements (sub_group_size, default 1e9): the step's temporaries
# (the flattened gradient, AdamW's intermediates) are a tile's size instead of the whole partition's
ZERO3_TILES = dict(ZERO3, zero_optimization=dict(ZERO3_SMALL["zero_optimization"], sub_group_size=20_000_000))


def side_args(side: str) -> dict:
    if side == "fsdp":
        return {"fsdp": "full_shard auto_wrap", "fsdp_config": {"transformer_layer_cls_to_wrap": ["Block"]}}
    if side == "zero3":
        return {"deepspeed": ZERO3}
    if side == "zero3_small":
        return {"deepspeed": ZERO3_SMALL}
    if side == "zero3_tiles":
        return {"deepspeed": ZERO3_TILES}
    return {}


# =====================================================================================================
# child: one training run (this process is the side's driver; the classes below live in __main__, so
# cloudpickle ships them to the Ray workers by value)
# =====================================================================================================
try:
    import torch
    from torch import nn
    from torch.nn import functional as F

    from raytrainer import TrainerCallback
except ImportError:  # the benchmark driver itself needs neither (run with any Python 3.10+)
    torch = nn = F = None
    TrainerCallback = object

if nn is not None:
    class Block(nn.Module):
        """One FSDP unit: ``Linear(width, width)`` + GELU."""

        def __init__(self, width: int):
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x):
            return F.gelu(self.linear(x))

    class BlockStack(nn.Module):
        """A plain torch model: no root ``reset_parameters()``, no transformers initialisation. Under FSDP
        each rank initialises its shard with each ``nn.Linear``'s own ``reset_parameters()``."""

        def __init__(self, width: int, depth: int, n_classes: int = 10):
            super().__init__()
            self.inp = nn.Linear(width, width)
            self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
            self.head = nn.Linear(width, n_classes)

        def forward(self, x, labels=None):
            h = self.inp(x)
            for block in self.blocks:
                h = block(h)
            logits = self.head(h)
            if labels is None:
                return {"logits": logits}
            return {"loss": F.cross_entropy(logits, labels), "logits": logits}

    class DictDataset(torch.utils.data.Dataset):
        def __init__(self, **tensors):
            self.tensors = tensors
            self.n = len(next(iter(tensors.values())))

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return {k: v[i] for k, v in self.tensors.items()}


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _statm() -> tuple[int, int]:
    """(RSS, RSS not file-backed or shared memory) of this process in bytes, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    resident, shared = int(fields[1]) * _PAGE, int(fields[2]) * _PAGE
    return resident, resident - shared


_STATUS_KEYS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")


def _proc_io() -> dict:
    """This process's /proc/self/io counters (rchar: bytes through read()/readv()/pread() syscalls, page cache
    or not, sockets and pipes included; read_bytes: bytes fetched from the block device)."""
    out = {}
    with contextlib.suppress(OSError), open("/proc/self/io") as f:
        for line in f:
            name, _, value = line.partition(":")
            out[name.strip()] = int(value)
    return out


_MMAP_LOADS: list = []  # safetensors files this worker loaded (load_file maps them: no read() syscalls)


def _patch_safetensors_load_file() -> None:
    """Count the bytes of every safetensors file loaded with ``safetensors.torch.load_file`` (it reads through
    mmap, which /proc/self/io does not see); raytrainer imports it at call time, so the patch applies."""
    try:
        import safetensors.torch as st
    except ImportError:
        return
    if getattr(st.load_file, "_bench_memory", False):
        return
    original = st.load_file

    def load_file(filename, *args, **kwargs):
        with contextlib.suppress(OSError):
            _MMAP_LOADS.append((str(filename), os.path.getsize(filename), time.perf_counter()))
        return original(filename, *args, **kwargs)

    load_file._bench_memory = True
    st.load_file = load_file


def _status_kb(*keys: str) -> dict:
    out = {}
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in keys:
                out[name] = int(rest.split()[0]) * 1024
    return out


def _storage_bytes(tensors) -> tuple[int, int]:
    """(bytes of the unique storages behind ``tensors``, bytes of their elements); DTensor -> local shard."""
    seen, storage_total, element_total = set(), 0, 0
    for t in tensors:
        if t is None:
            continue
        to_local = getattr(t, "to_local", None)
        if callable(to_local):
            t = to_local()
        if not isinstance(t, torch.Tensor):
            continue
        element_total += t.numel() * t.element_size()
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            storage_total += storage.nbytes()
    return storage_total, element_total


class MemoryProbe(TrainerCallback):
    """Runs on every worker: RSS samples and exact training-state bytes; writes ``rank-<r>.json``."""

    same_on_every_rank = True  # never changes control: no extra collective per step

    def __init__(self, out_dir: str, interval: float, steady_from: int):
        self.out_dir, self.interval, self.steady_from = out_dir, interval, steady_from
        self._reset()

    def _reset(self) -> None:
        self.phase = "before train_begin"  # spec unpickling, model set-up (sharding), optimizer creation
        self.in_loop = False
        self._lock = threading.Lock()
        self.rss_unpickle = self.rss_train_begin = None
        self.status_unpickle = self.status_train_begin = None
        self.hwm_train_begin = None
        self.io_unpickle = self.io_train_begin = None
        self.mmap_train_begin = []
        self.peak = {"rss": 0, "anon": 0, "phase": None}  # whole life from unpickling
        self.peak_loop = {"rss": 0, "anon": 0, "phase": None}  # from on_train_begin
        self.trace: list[tuple[float, float, str]] = []
        self.params = self.grads = self.optim = None
        self.step_ends: list[float] = []
        self.logs: list[dict] = []
        self._stop = None
        self._thread = None
        self._t0 = time.perf_counter()

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_stop"] = state["_thread"] = state["_lock"] = None
        return state

    def __setstate__(self, state):  # on a worker: the Trainer spec is being unpickled
        self.__dict__.update(state)
        self._reset()
        self.rss_unpickle = _statm()[0]
        self.status_unpickle = _status_kb(*_STATUS_KEYS)
        self.io_unpickle = _proc_io()
        self.mmap_mark = len(_MMAP_LOADS)
        _patch_safetensors_load_file()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-memory-sampler")
        self._thread.start()

    # -- sampling ------------------------------------------------------------------------------------
    def sample(self) -> None:
        rss, anon = _statm()
        with self._lock:
            for peak in (self.peak, self.peak_loop) if self.in_loop else (self.peak,):
                if rss > peak["rss"]:
                    peak.update(rss=rss, phase=self.phase)
                peak["anon"] = max(peak["anon"], anon)
            if len(self.trace) < 20000:
                self.trace.append((round(time.perf_counter() - self._t0, 3), round(rss / MiB, 1), self.phase))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    # -- events --------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.phase, self.in_loop = "train_begin", True
        self.rss_train_begin = _statm()[0]
        self.status_train_begin = _status_kb(*_STATUS_KEYS)
        self.hwm_train_begin = self.status_train_begin.get("VmHWM")
        self.io_train_begin = _proc_io()
        self.mmap_train_begin = [list(x[:2]) for x in _MMAP_LOADS[getattr(self, "mmap_mark", 0):]]
        self.sample()
        params = list(model.parameters())
        # ZeRO-3 keeps this rank's partition in ds_tensor (the parameter itself is an empty placeholder)
        held = [p.ds_tensor if hasattr(p, "ds_tensor") else p for p in params]
        storage, elements = _storage_bytes(held)
        local = [p.to_local() if hasattr(p, "to_local") else p for p in held]
        self.params = {"storage_bytes": storage, "element_bytes": elements,
                       "global_numel": sum(getattr(p, "ds_numel", p.numel()) for p in params),
                       "local_numel": sum(t.numel() for t in local),
                       "dtensor": any(hasattr(p, "to_local") or hasattr(p, "ds_tensor") for p in params),
                       "model_class": type(model).__name__}
        self.phase = "step 1"

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.sample()
        if self.grads is None:
            storage, elements = _storage_bytes(p.grad for p in model.parameters())
            # (ZeRO-3 keeps gradient partitions in DeepSpeed's own flat buffers: not visible here, so 0)
            self.grads = {"storage_bytes": storage, "element_bytes": elements}

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.step_ends.append(time.perf_counter())
        self.sample()
        if self.optim is None and optimizer is not None:
            base = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the torch optimizer
            tensors = [v for s in base.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            storage, elements = _storage_bytes(tensors)
            self.optim = {"storage_bytes": storage, "element_bytes": elements, "tensors": len(tensors),
                          "class": type(optimizer).__name__}
        self.phase = f"step {state.global_step + 1}"

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self.logs.append({k: v for k, v in logs.items() if isinstance(v, (int, float, str))})

    def on_train_end(self, args, state, control, **kwargs):
        self.phase = "train_end"
        self.sample()
        if self._stop is not None:
            self._stop.set()
            self._thread.join()
        status = _status_kb(*_STATUS_KEYS)
        record = {
            "rank": args.process_index, "world_size": args.world_size, "pid": os.getpid(),
            "torch_threads": torch.get_num_threads(), "global_step": state.global_step,
            "per_device_batch_size": args.per_device_train_batch_size,
            "rss_unpickle": self.rss_unpickle, "rss_train_begin": self.rss_train_begin,
            "vmhwm_train_begin": self.hwm_train_begin, "vmhwm_end": status.get("VmHWM"),
            "status_unpickle": self.status_unpickle, "status_train_begin": self.status_train_begin,
            "status_end": status, "io_unpickle": self.io_unpickle, "io_train_begin": self.io_train_begin,
            "mmap_loads_before_train_begin": self.mmap_train_begin, "peak_sampled": self.peak,
            "peak_sampled_loop": self.peak_loop,
            "params": self.params, "grads": self.grads, "optim": self.optim,
            "step_ends": self.step_ends, "logs": self.logs, "trace": self.trace,
        }
        path = os.path.join(self.out_dir, f"rank-{args.process_index}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)


def _reset_hwm() -> bool:
    """Reset this process's VmHWM to its current RSS (``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _SpecBytes(logging.Handler):
    """Collects the size raytrainer's driver logs for the run spec (logger raytrainer.driver.group, DEBUG:
    "run spec: N bytes in the object store; ...")."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.sizes: list[int] = []

    def emit(self, record):
        match = re.match(r"run spec: (\d+) bytes", record.getMessage())
        if match:
            self.sizes.append(int(match.group(1)))


def model_params(width: int, depth: int) -> int:
    return width * width + width + depth * (width * width + width) + width * 10 + 10


def _tree_sizes(root: str) -> dict:
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError):
                out[os.path.relpath(path, root)] = os.path.getsize(path)
    return out


def run_child(cfg_path: str) -> None:
    with open(cfg_path) as f:
        cfg = json.load(f)
    from raytrainer import Trainer, TrainingArguments

    spec_log = _SpecBytes()
    launch_logger = logging.getLogger("raytrainer.driver.group")
    launch_logger.setLevel(logging.DEBUG)
    launch_logger.addHandler(spec_log)
    width, depth, seed = cfg["width"], cfg["depth"], cfg["seed"]
    from_init = cfg.get("model_from", "instance") == "model_init"

    def make_model():  # cloudpickled by value (defined in __main__); built on the workers under the
        torch.manual_seed(seed)  # strategy's model_init_context
        return BlockStack(width, depth)

    g = torch.Generator().manual_seed(seed)
    data = DictDataset(x=torch.randn(cfg["examples"], width, generator=g),
                       labels=torch.randint(0, 10, (cfg["examples"],), generator=g))

    def make_trainer(out_dir, probe_dir, max_steps, save_steps=None):
        args = TrainingArguments(
            output_dir=out_dir, num_workers=cfg["num_workers"], use_cpu=True,
            per_device_train_batch_size=cfg["batch_size"], max_steps=max_steps, learning_rate=1e-4,
            optim="adamw_torch", save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
            eval_strategy="no", logging_steps=cfg["logging_steps"], disable_tqdm=True, report_to="none",
            dataloader_num_workers=0, dataloader_drop_last=True, remove_unused_columns=False, seed=seed,
            **side_args(cfg["side"]))
        os.makedirs(probe_dir, exist_ok=True)
        probe = MemoryProbe(probe_dir, cfg["sample_interval"], cfg["steady_from"])
        if from_init:
            return Trainer(model_init=make_model, args=args, train_dataset=data, callbacks=[probe])
        return Trainer(model=make_model(), args=args, train_dataset=data, callbacks=[probe])

    n_params = model_params(width, depth)
    model_bytes = n_params * 4
    rss_start = _status_kb("VmRSS")["VmRSS"]
    trainer = make_trainer(cfg["output_dir"], cfg["run_dir"], cfg["max_steps"])
    rss_trainer = _status_kb("VmRSS")["VmRSS"]
    hwm_reset = _reset_hwm()
    rss_before = _status_kb("VmRSS")["VmRSS"]
    t0 = time.perf_counter()
    out = trainer.train()
    wall = time.perf_counter() - t0
    st = _status_kb("VmHWM", "VmRSS")
    train_growth, rss_after = st["VmHWM"] - rss_before, st["VmRSS"]
    _reset_hwm()
    rss_before_access = _status_kb("VmRSS")["VmRSS"]
    t1 = time.perf_counter()
    model = trainer.model  # the final weights, loaded from <output_dir>/final-model/ on first access
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    access_s = time.perf_counter() - t1
    st = _status_kb("VmHWM", "VmRSS")
    driver = {"n_params": n_params, "model_bytes": model_bytes, "model_from": cfg.get("model_from"),
              "train_wall_s": wall, "global_step": out.global_step, "train_loss": out.training_loss,
              "rss_start": rss_start, "rss_after_trainer_init": rss_trainer, "rss_before_train": rss_before,
              "hwm_reset": hwm_reset, "train_peak_growth": train_growth, "rss_after_train": rss_after,
              "model_access_peak_growth": st["VmHWM"] - rss_before_access,
              "rss_after_model_access": st["VmRSS"],
              "model_access_s": access_s, "final_param_sum": checksum,
              "final_model_files": _tree_sizes(os.path.join(cfg["output_dir"], "final-model")),
              "spec_bytes": list(spec_log.sizes)}
    del model, trainer
    if cfg.get("resume"):
        # a 2-worker checkpoint at step 1, then 2 fresh workers resume from it for one more step
        save_out = os.path.join(cfg["run_dir"], "save-out")
        t2 = time.perf_counter()
        make_trainer(save_out, os.path.join(cfg["run_dir"], "save"), 1, save_steps=1).train()
        ckpt = os.path.join(save_out, "checkpoint-1")
        t3 = time.perf_counter()
        make_trainer(os.path.join(cfg["run_dir"], "resume-out"), os.path.join(cfg["run_dir"], "resume"),
                     2).train(resume_from_checkpoint=ckpt)
        driver.update(save_wall_s=t3 - t2, resume_wall_s=time.perf_counter() - t3,
                      checkpoint_files=_tree_sizes(ckpt), spec_bytes=list(spec_log.sizes))
        if not cfg.get("keep_checkpoints"):
            for sub in ("save-out", "resume-out"):
                shutil.rmtree(os.path.join(cfg["run_dir"], sub), ignore_errors=True)
    shutil.rmtree(cfg["output_dir"], ignore_errors=True)
    with open(os.path.join(cfg["run_dir"], "driver.json"), "w") as f:
        json.dump(driver, f)
    print(f"[bench_memory] {cfg['side']} driver: train() peak growth {train_growth / MiB:.0f} MiB "
          f"({train_growth / model_bytes:.2f}x model), first trainer.model access "
          f"{driver['model_access_peak_growth'] / MiB:.0f} MiB, spec bytes {driver['spec_bytes']}",
          flush=True)
    for rank in range(cfg["num_workers"]):
        path = os.path.join(cfg["run_dir"], f"rank-{rank}.json")
        if not os.path.exists(path):
            print(f"[bench_memory] rank {rank}: no record at {path}", flush=True)
            continue
        with open(path) as f:
            r = json.load(f)
        state = sum(r[k]["storage_bytes"] for k in ("params", "grads", "optim"))
        print(f"[bench_memory] {cfg['side']} rank {rank}: VmHWM {r['vmhwm_end'] / MiB:.0f} MiB, RSS at "
              f"unpickle {r['rss_unpickle'] / MiB:.0f} MiB, "
              f"at train_begin {r['rss_train_begin'] / MiB:.0f} MiB, "
              f"training state {state / MB:.1f} MB (params {r['params']['storage_bytes'] / MB:.1f}, grads "
              f"{r['grads']['storage_bytes'] / MB:.1f}, optimizer {r['optim']['storage_bytes'] / MB:.1f})",
              flush=True)


# =====================================================================================================
# driver
# =====================================================================================================
def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update({
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
        "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0",
    })
    env.update(extra or {})
    return env


def _session_procs(sid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(name)) == sid:
                    pids.append(int(name))
    return pids


def _stop_session(sid: int, grace: float) -> list[int]:
    """Processes left in the child's session (ours): wait ``grace`` s, then SIGTERM, then SIGKILL them."""
    deadline = time.time() + grace
    while (left := _session_procs(sid)) and time.time() < deadline:
        time.sleep(0.25)
    if left:
        for sig in (15, 9):
            for pid in _session_procs(sid):
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
            time.sleep(3)
    return left


def run_side(side: str, tag: str, cfg: dict, workdir: str, opts) -> dict:
    run_dir = os.path.join(workdir, tag)
    os.makedirs(run_dir)
    cfg = dict(cfg, side=side, run_dir=run_dir, output_dir=os.path.join(run_dir, "out"))
    cfg_path = os.path.join(run_dir, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    log_path = os.path.join(run_dir, "log.txt")
    print(f"[{tag}] {SIDES[side]} ...", flush=True)
    t0 = time.time()
    with open(log_path, "w") as log:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", cfg_path]
        proc = subprocess.Popen(cmd, env=child_env(opts.env_dict), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=run_dir)
        try:
            rc = proc.wait(timeout=opts.timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.time() - t0
    leftover = _stop_session(proc.pid, 0 if rc == "timeout" else opts.leftover_grace)
    if rc == "timeout":
        proc.wait()
    result = {"side": side, "tag": tag, "rc": rc, "wall_s": wall, "log": log_path, "ranks": []}
    if leftover:
        result["leftover_pids"] = leftover
    for rank in range(cfg["num_workers"]):
        path = os.path.join(run_dir, f"rank-{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                result["ranks"].append(json.load(f))
    with contextlib.suppress(OSError), open(os.path.join(run_dir, "driver.json")) as f:
        result["driver"] = json.load(f)
    if cfg.get("resume"):
        result["resume_ranks"] = []
        for rank in range(cfg["num_workers"]):
            path = os.path.join(run_dir, "resume", f"rank-{rank}.json")
            with contextlib.suppress(OSError), open(path) as f:
                result["resume_ranks"].append(json.load(f))
    if rc != 0 or len(result["ranks"]) != cfg["num_workers"]:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"side {side} ({tag}) failed: rc={rc}, {len(result['ranks'])} rank records; "
                           f"log {log_path}:\n{tail}")
    summarise(result, cfg)
    with open(log_path) as f:
        for line in f:
            if line.startswith("[bench_memory]"):
                print("   " + line.rstrip(), flush=True)
    s = result["summary"]
    print(f"   peak RSS/worker {s['peak_rss'] / MiB:.0f} MiB, training state/worker "
          f"{s['state_bytes'] / MB:.1f} MB, {s['samples_per_s']:.1f} samples/s, wall {wall:.0f} s",
          flush=True)
    return result


def summarise(result: dict, cfg: dict) -> None:
    ranks = result["ranks"]

    def state_bytes(r):
        return sum(r[k]["storage_bytes"] for k in ("params", "grads", "optim"))

    r0 = next(r for r in ranks if r["rank"] == 0)
    ends, k0 = r0["step_ends"], cfg["steady_from"]
    n = len(ends)
    global_batch = r0["per_device_batch_size"] * r0["world_size"]
    steady = ((n - k0) * global_batch / (ends[-1] - ends[k0 - 1])) if n > k0 else float("nan")
    step_times = [b - a for a, b in zip(ends[k0 - 1:], ends[k0:])]
    drv = result.get("driver") or {}
    extra = {}
    if drv:
        extra = {"n_params": drv["n_params"], "model_bytes": drv["model_bytes"],
                 "driver_train_growth": drv["train_peak_growth"],
                 "driver_train_growth_x_model": drv["train_peak_growth"] / drv["model_bytes"],
                 "driver_access_growth": drv["model_access_peak_growth"],
                 "driver_access_growth_x_model": drv["model_access_peak_growth"] / drv["model_bytes"],
                 "spec_bytes": drv["spec_bytes"][0] if drv.get("spec_bytes") else float("nan")}
    if result.get("resume_ranks"):
        fresh = {r["rank"]: r for r in ranks}
        per_rank = []
        for r in sorted(result["resume_ranks"], key=lambda r: r["rank"]):
            f0 = fresh[r["rank"]]
            rchar = r["io_train_begin"]["rchar"] - r["io_unpickle"]["rchar"]
            rchar_fresh = f0["io_train_begin"]["rchar"] - f0["io_unpickle"]["rchar"]
            mapped = sum(size for _, size in r["mmap_loads_before_train_begin"])
            per_rank.append({"rank": r["rank"], "rchar": rchar, "rchar_fresh": rchar_fresh,
                             "read_bytes": r["io_train_begin"]["read_bytes"] - r["io_unpickle"]["read_bytes"],
                             "safetensors_mapped": mapped, "resume_bytes": rchar - rchar_fresh + mapped,
                             "vmhwm": r["vmhwm_end"]})
        extra["resume"] = per_rank
        extra["checkpoint_bytes"] = sum(drv.get("checkpoint_files", {}).values())
        for pr in per_rank:
            extra[f"resume_bytes_rank{pr['rank']}"] = pr["resume_bytes"]
        extra["resume_peak_rss"] = max(pr["vmhwm"] for pr in per_rank)
    result["summary"] = {
        **extra,
        "peak_rss": max(r["vmhwm_end"] for r in ranks),
        "peak_rss_sampled": max(r["peak_sampled"]["rss"] for r in ranks),
        "peak_rss_loop": max(r["peak_sampled_loop"]["rss"] for r in ranks),
        "peak_phase": max(ranks, key=lambda r: r["peak_sampled"]["rss"])["peak_sampled"]["phase"],
        "peak_anon": max(r["peak_sampled"]["anon"] for r in ranks),
        "rss_unpickle": max(r["rss_unpickle"] for r in ranks),
        "rss_train_begin": max(r["rss_train_begin"] for r in ranks),
        "vmhwm_train_begin": max(r["vmhwm_train_begin"] for r in ranks),
        "shmem_end": max(r["status_end"].get("RssShmem", 0) for r in ranks),
        "state_bytes": max(state_bytes(r) for r in ranks),
        "params_bytes": max(r["params"]["storage_bytes"] for r in ranks),
        "grads_bytes": max(r["grads"]["storage_bytes"] for r in ranks),
        "optim_bytes": max(r["optim"]["storage_bytes"] for r in ranks),
        "local_numel": max(r["params"]["local_numel"] for r in ranks),
        "global_numel": r0["params"]["global_numel"],
        "dtensor": r0["params"]["dtensor"],
        "samples_per_s": steady,
        "samples_per_s_median_step": (global_batch / statistics.median(step_times)) if step_times
        else float("nan"),
        "steps": n,
        "train_loss": (result.get("driver") or {}).get("train_loss"),
    }


def _median(results: list[dict], key: str) -> float:
    return statistics.median(r["summary"][key] for r in results)


def markdown(info: dict, cfg: dict, opts, medians: dict, verdicts: list[str]) -> str:
    sides = list(medians)
    ref = medians.get("ddp")
    lines = [
        "# raytrainer memory benchmark: FSDP full_shard and ZeRO-3 vs DDP, 2 workers",
        "",
        f"- date: {info['date']}; machine: {info['cpu']}, {info['nproc']} cores, {info['memory_gib']} GiB, "
        f"{info['os']}; load average at start {info['load_average_at_start']}, at end "
        f"{info.get('load_average_at_end')}",
        f"- python {info['python']}, torch {info['torch']}, ray {info['ray']}, "
        f"raytrainer {info['raytrainer_commit']}",
        f"- model: input Linear + {cfg['depth']} x Block(Linear({cfg['width']}, {cfg['width']}) + GELU) + "
        f"10-way head, {cfg['n_params'] / 1e6:.2f}M float32 parameters ({cfg['n_params'] * 4 / MB:.1f} MB); "
        f"AdamW (`adamw_torch`); {cfg['num_workers']} Ray Train workers on CPU (gloo), batch "
        f"{cfg['batch_size']} per worker, {cfg['max_steps']} steps, OMP_NUM_THREADS=1; model from "
        f"`{cfg.get('model_from', 'instance')}`; {opts.repeats} "
        "repeat(s), sides interleaved, medians",
        *([f"- extra environment of the sides (and their Ray workers): {opts.env_dict}"]
          if opts.env_dict else []),
        "",
        "| side | peak RSS / worker (MiB) | x DDP | peak RSS in the loop (MiB) | x DDP "
        "| training state / worker (MB) | x DDP | samples/s | x DDP |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ratio(side, key):
        if ref is None or not ref[key]:
            return "-"
        return f"{medians[side][key] / ref[key]:.2f}x"

    for side in sides:
        m = medians[side]
        lines.append(f"| {SIDES[side]} | {m['peak_rss'] / MiB:.0f} | {ratio(side, 'peak_rss')} | "
                     f"{m['peak_rss_loop'] / MiB:.0f} | {ratio(side, 'peak_rss_loop')} | "
                     f"{m['state_bytes'] / MB:.1f} | {ratio(side, 'state_bytes')} | "
                     f"{m['samples_per_s']:.1f} | {ratio(side, 'samples_per_s')} |")
    for note in NOT_MEASURED.values():
        lines.append(f"| {note} | - | - | - | - | - | - | - | - |")
    lines += [
        "",
        "Breakdown per worker (max over ranks, medians over repeats):",
        "",
        "| side | params (MB) | grads (MB) | optimizer state (MB) | local / global parameters | RSS at spec "
        "unpickle (MiB) | RSS at train_begin (MiB) | VmHWM at train_begin (MiB) | shared memory at the end "
        "(MiB) | peak during | samples/s (median step) | train loss |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for side in sides:
        m = medians[side]
        lines.append(
            f"| {side} | {m['params_bytes'] / MB:.1f} | {m['grads_bytes'] / MB:.1f} | "
            f"{m['optim_bytes'] / MB:.1f} | {m['local_numel'] / 1e6:.2f}M / {m['global_numel'] / 1e6:.2f}M | "
            f"{m['rss_unpickle'] / MiB:.0f} | "
            f"{m['rss_train_begin'] / MiB:.0f} | {m['vmhwm_train_begin'] / MiB:.0f} | "
            f"{m['shmem_end'] / MiB:.0f} | {m['peak_phase']} | "
            f"{m['samples_per_s_median_step']:.1f} | "
            f"{m['train_loss'] if m['train_loss'] is None else round(m['train_loss'], 4)} |")
    lines += ["", "Verdict (bar: peak memory per worker below 0.6x of DDP's):", ""]
    lines += [f"- {v}" for v in verdicts]
    lines += [
        "",
        "Columns: *peak RSS / worker* is the kernel's high-water mark (VmHWM) of each Ray Train worker "
        "process over its whole life, unpickling the run spec (which carries the full model) and sharding "
        "included, max over ranks. *Peak RSS in the loop* is the largest sample (every "
        f"{cfg['sample_interval'] * 1000:.0f} ms and at every step end) from `on_train_begin` on. RSS "
        "includes the worker's baseline (Python, torch, Ray's worker runtime: see *RSS at spec unpickle*), "
        "which no strategy can shard. *Training state* is exact: the unique tensor storages of the rank's "
        "parameters, gradients (before the first optimizer step) and AdamW state (after it), DTensor shards "
        "as local tensors; DDP's gradient buckets and FSDP's all-gather / reduce-scatter buffers are not in "
        "it (they are in RSS). *Shared memory*: `RssShmem` at the end (Ray's object store pages the worker "
        "mapped, e.g. the run spec's bytes; counted in every worker's RSS, shared between them). With "
        "glibc's default malloc, freed tensor memory often stays in the process (RSS above live memory, "
        "more so with many differently sized buffers, as FSDP's); `--env MALLOC_MMAP_THRESHOLD_=131072` "
        "makes RSS follow live memory, at a throughput cost. *samples/s*: rank 0, "
        f"(steps after step {cfg['steady_from']}) x batch x workers / time from the end of step "
        f"{cfg['steady_from']} to the last.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="~2M parameters, 1 repeat, 10 steps")
    p.add_argument("--repeats", type=int, default=None, help="default 2 (1 with --quick)")
    p.add_argument("--sides", default="ddp,fsdp,zero3")
    p.add_argument("--width", type=int, default=None, help="default 1024 (384 with --quick)")
    p.add_argument("--depth", type=int, default=None, help="Blocks; default 23 (12 with --quick)")
    p.add_argument("--max-steps", type=int, default=None, help="default 30 (10 with --quick)")
    p.add_argument("--batch-size", type=int, default=8, help="per worker")
    p.add_argument("--examples", type=int, default=2048)
    p.add_argument("--steady-from", type=int, default=5, help="throughput from the end of this step")
    p.add_argument("--sample-interval", type=float, default=0.02, help="RSS sampling on the workers, s")
    p.add_argument("--timeout", type=float, default=600.0, help="per run, s")
    p.add_argument("--leftover-grace", type=float, default=15.0)
    p.add_argument("--workdir", help="runs' folders and logs (default: a temporary folder, deleted unless "
                                     "--keep or a run fails)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--out", help="JSON results")
    p.add_argument("--md", help="Markdown table")
    p.add_argument("--sizes", help="comma-separated model sizes in millions of parameters (e.g. 25,100,200): "
                                    "one run per size and side, --depth Blocks (default 11), the width "
                                    "chosen "
                                    "for the size; adds the driver's memory, the spec's bytes and the resume "
                                    "read per rank; default 1 repeat, 3 steps")
    p.add_argument("--model-from", choices=("model_init", "instance"), default="model_init",
                   help="model_init (default): the Trainer gets model_init, the workers build the model "
                        "(sharded construction); instance: a model built on the driver and shipped in the "
                        "spec")
    p.add_argument("--no-resume", action="store_true",
                   help="with --sizes: skip the checkpoint-at-step-1 and resume runs")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the sides and their Ray workers (repeatable), e.g. "
                        "MALLOC_MMAP_THRESHOLD_=131072")
    opts = p.parse_args()
    bad = [e for e in opts.env if "=" not in e]
    if bad:
        p.error(f"--env takes KEY=VALUE, got {bad}")
    opts.env_dict = dict(e.split("=", 1) for e in opts.env)
    if opts.child:
        run_child(opts.child)
        return

    sys.path.insert(0, HERE)
    from _machine import machine_info

    if opts.sizes:
        main_sizes(opts, p)
        return
    quick = opts.quick
    opts.repeats = opts.repeats or (1 if quick else 2)
    width = opts.width or (384 if quick else 1024)
    depth = opts.depth or (12 if quick else 23)
    max_steps = opts.max_steps or (10 if quick else 30)
    n_params = width * width + width + depth * (width * width + width) + width * 10 + 10
    cfg = {"width": width, "depth": depth, "max_steps": max_steps, "batch_size": opts.batch_size,
           "examples": opts.examples, "num_workers": 2, "seed": 42, "logging_steps": 10,
           "steady_from": min(opts.steady_from, max_steps - 1), "sample_interval": opts.sample_interval,
           "n_params": n_params, "model_from": opts.model_from}
    sides = [s.strip() for s in opts.sides.split(",") if s.strip()]
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        p.error(f"unknown side(s) {unknown}; known: {list(SIDES)}")

    info = machine_info(REPO)
    workdir = opts.workdir or tempfile.mkdtemp(prefix="bench-memory-")
    os.makedirs(workdir, exist_ok=True)
    print(f"bench_memory: {n_params / 1e6:.2f}M parameters, sides {sides}, {opts.repeats} repeat(s), "
          f"workdir {workdir}", flush=True)
    for note in NOT_MEASURED.values():
        print(f"  ({note})", flush=True)
    results: dict[str, list[dict]] = {s: [] for s in sides}
    failed = False
    try:
        for rep in range(opts.repeats):
            order = sides[rep % len(sides):] + sides[:rep % len(sides)]
            for side in order:
                results[side].append(run_side(side, f"{side}-r{rep}", cfg, workdir, opts))
    except Exception:
        failed = True
        raise
    finally:
        if not (failed or opts.keep or opts.workdir):
            shutil.rmtree(workdir, ignore_errors=True)
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]

    medians = {}
    for side in sides:
        first = results[side][0]["summary"]
        medians[side] = {k: _median(results[side], k)
                         if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                         for k, v in first.items()}
    verdicts = []
    if "ddp" in medians and "fsdp" in medians:
        ref, fs = medians["ddp"], medians["fsdp"]
        for key, what in (("peak_rss", "peak RSS per worker (whole worker life, VmHWM)"),
                          ("peak_rss_loop", "peak RSS per worker in the training loop"),
                          ("state_bytes", "training-state bytes per worker (params + grads + AdamW state)")):
            r = fs[key] / ref[key]
            verdicts.append(f"FSDP full_shard {what}: {r:.2f}x DDP -> {'MET' if r < BAR else 'NOT MET'} "
                            f"(bar < {BAR}x)")
        def dyn(m):
            return m["grads_bytes"] + m["optim_bytes"]

        grow = (ref["peak_rss_loop"] - ref["rss_train_begin"], fs["peak_rss_loop"] - fs["rss_train_begin"])
        verdicts.append(f"RSS growth in the loop (peak in the loop - RSS at on_train_begin: gradients, "
                        f"optimizer state, communication buffers, allocator retention): DDP "
                        f"{grow[0] / MiB:.0f} MiB, FSDP {grow[1] / MiB:.0f} MiB ({grow[1] / grow[0]:.2f}x); "
                        f"gradients + optimizer state alone: DDP {dyn(ref) / MiB:.0f} MiB, FSDP "
                        f"{dyn(fs) / MiB:.0f} MiB")
        verdicts.append(f"floor: the FSDP worker's RSS at on_train_begin (sharded parameters, no gradient or "
                        f"optimizer state yet) is {fs['rss_train_begin'] / MiB:.0f} MiB = "
                        f"{fs['rss_train_begin'] / ref['peak_rss']:.2f}x DDP's peak: the per-worker baseline "
                        "(interpreter, torch, Ray worker, the run spec with the full model shipped to every "
                        "worker) is not shardable, so at this model size no sharding strategy can bring peak "
                        f"RSS under {BAR}x DDP's unless that floor is below it")
        verdicts.append(f"throughput: FSDP {fs['samples_per_s']:.1f} samples/s vs DDP "
                        f"{ref['samples_per_s']:.1f} ({fs['samples_per_s'] / ref['samples_per_s']:.2f}x)")
    verdicts += [f"{note} (bar not checked for it)" for note in NOT_MEASURED.values()]
    md = markdown(info, cfg, opts, medians, verdicts)
    print()
    print(md)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"machine": info, "config": cfg, "repeats": opts.repeats, "medians": medians,
                       "verdicts": verdicts, "not_measured": NOT_MEASURED, "runs": results}, f, indent=1)
    if opts.md:
        with open(opts.md, "w") as f:
            f.write(md)


def width_for(millions: float, depth: int) -> int:
    """The width (a multiple of 8) whose model (depth + 1 square Linears + head) is nearest to the size."""
    target = millions * 1e6
    return min(range(8, 16384, 8), key=lambda w: abs(model_params(w, depth) - target))


def markdown_sizes(info: dict, opts, cfg: dict, table: dict, sizes: list) -> str:
    sides = list(next(iter(table.values())))
    lines = [
        "# raytrainer memory benchmark: DDP, FSDP full_shard and ZeRO-3 by model size, 2 workers",
        "",
        f"- date: {info['date']}; machine: {info['cpu']}, {info['nproc']} cores, {info['memory_gib']} GiB, "
        f"{info['os']}; load average at start {info['load_average_at_start']}, at end "
        f"{info.get('load_average_at_end')}",
        f"- python {info['python']}, torch {info['torch']}, ray {info['ray']}, "
        f"raytrainer {info['raytrainer_commit']}",
        f"- model: input Linear + {cfg['depth']} x Block(Linear(w, w) + GELU) + 10-way head, float32, model "
        f"from `{opts.model_from}`; AdamW; 2 Ray Train workers on CPU (gloo), batch {cfg['batch_size']} per "
        f"worker, {cfg['max_steps']} steps; {opts.repeats} repeat(s), sides interleaved, medians",
        "",
        "| params | side | peak RSS / worker (MiB) | x DDP | RSS at train_begin (MiB) "
        "| training state / worker "
        "(MB) | x DDP | driver peak growth in train() | x model | first trainer.model access | spec bytes |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in sizes:
        row = table[size]
        ref = row.get("ddp")
        for side in sides:
            m = row[side]
            r_peak = f"{m['peak_rss'] / ref['peak_rss']:.2f}x" if ref else "-"
            r_state = f"{m['state_bytes'] / ref['state_bytes']:.2f}x" if ref else "-"
            lines.append(
                f"| {m['n_params'] / 1e6:.1f}M | {side} | {m['peak_rss'] / MiB:.0f} | {r_peak} | "
                f"{m['rss_train_begin'] / MiB:.0f} | {m['state_bytes'] / MB:.0f} | {r_state} | "
                f"{m['driver_train_growth'] / MiB:.0f} MiB | {m['driver_train_growth_x_model']:.2f}x | "
                f"{m['driver_access_growth'] / MiB:.0f} MiB ({m['driver_access_growth_x_model']:.2f}x) | "
                f"{m['spec_bytes']:,.0f} |")
    if any("resume_bytes_rank0" in table[s][side] for s in sizes for side in sides):
        lines += ["", "Resume from a 2-worker checkpoint (step 1) on 2 fresh workers: bytes each rank read "
                  "before on_train_begin", "",
                  "| params | side | checkpoint (MB) | rank 0 (MB) | rank 1 (MB) "
                  "| rank 0 raw rchar / safetensors mapped (MB) | rank 1 raw rchar / safetensors mapped (MB) "
                  "| peak RSS / worker on resume (MiB) |",
                  "|---:|---|---:|---:|---:|---|---|---:|"]
        for size in sizes:
            for side in sides:
                m = table[size][side]
                if "resume" not in m:
                    continue
                cells = [f"{pr['rchar'] / MB:.0f} (fresh {pr['rchar_fresh'] / MB:.0f}) / "
                         f"{pr['safetensors_mapped'] / MB:.0f}" for pr in m["resume"]]
                lines.append(f"| {m['n_params'] / 1e6:.1f}M | {side} | {m['checkpoint_bytes'] / MB:.0f} | "
                             f"{m['resume_bytes_rank0'] / MB:.0f} | {m['resume_bytes_rank1'] / MB:.0f} | "
                             f"{cells[0]} | {cells[1]} | {m['resume_peak_rss'] / MiB:.0f} |")
    return "\n".join(lines) + "\n"


def main_sizes(opts, p) -> None:
    from _machine import machine_info

    sizes = [float(x) for x in opts.sizes.split(",") if x.strip()]
    opts.repeats = opts.repeats or 1
    depth = opts.depth or 11
    max_steps = opts.max_steps or 3
    sides = [s.strip() for s in opts.sides.split(",") if s.strip()]
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        p.error(f"unknown side(s) {unknown}; known: {list(SIDES)}")
    examples = max(opts.batch_size * 2 * max_steps * 2, 64) if opts.examples == 2048 else opts.examples
    base = {"depth": depth, "max_steps": max_steps, "batch_size": opts.batch_size, "examples": examples,
            "num_workers": 2, "seed": 42, "logging_steps": 1, "steady_from": 1,
            "sample_interval": opts.sample_interval, "model_from": opts.model_from,
            "resume": not opts.no_resume}
    info = machine_info(REPO)
    workdir = opts.workdir or tempfile.mkdtemp(prefix="bench-memory-")
    os.makedirs(workdir, exist_ok=True)
    print(f"bench_memory: sizes {sizes}M, depth {depth}, sides {sides}, {opts.repeats} repeat(s), model from "
          f"{opts.model_from}, workdir {workdir}", flush=True)
    runs: dict = {}
    table: dict = {}
    failed = False
    try:
        for size in sizes:
            width = width_for(size, depth)
            cfg = dict(base, width=width, n_params=model_params(width, depth))
            results: dict[str, list[dict]] = {s: [] for s in sides}
            for rep in range(opts.repeats):
                order = sides[rep % len(sides):] + sides[:rep % len(sides)]
                for side in order:
                    results[side].append(run_side(side, f"{size:g}M-{side}-r{rep}", cfg, workdir, opts))
                    r = results[side][-1]["summary"]
                    print(f"   driver train() growth {r['driver_train_growth'] / MiB:.0f} MiB "
                          f"({r['driver_train_growth_x_model']:.2f}x model), spec {r['spec_bytes']:,.0f} B"
                          + (f", resume read rank0 {r['resume_bytes_rank0'] / MB:.0f} MB, rank1 "
                             f"{r['resume_bytes_rank1'] / MB:.0f} MB" if "resume_bytes_rank0" in r else ""),
                          flush=True)
            runs[size] = results
            table[size] = {side: {k: _median(results[side], k)
                                  if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                                  for k, v in results[side][0]["summary"].items()} for side in sides}
            if opts.out:  # after every size: a partial result survives a later failure or deadline
                with open(opts.out, "w") as f:
                    json.dump({"machine": info, "config": base, "sizes": sizes, "table": table, "runs": runs},
                              f, indent=1, default=str)
    except Exception:
        failed = True
        raise
    finally:
        if not (failed or opts.keep or opts.workdir):
            shutil.rmtree(workdir, ignore_errors=True)
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    md = markdown_sizes(info, opts, base, table, sizes)
    print()
    print(md)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"machine": info, "config": base, "sizes": sizes, "table": table, "runs": runs},
                      f, indent=1, default=str)
    if opts.md:
        with open(opts.md, "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
