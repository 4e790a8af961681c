"""Tiny models, data and callbacks for the integration tests (pickled by value to the Ray workers)."""

from __future__ import annotations

import importlib
import json
import logging
import os
import time

import torch
import transformers

import raytrainer
from raytrainer import Trainer, TrainerCallback

log = logging.getLogger("tests.integration")


#: The arguments that pick each strategy, for tests run once per strategy.
STRATEGY_ARGS = {
    "ddp": {},
    "fsdp": {"fsdp": "full_shard"},
    "zero3": {"deepspeed": {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                            "zero_optimization": {"stage": 3}}},
}


class Regressor(torch.nn.Module):
    """No dropout, so 2-rank DDP and 1 rank with twice the batch compute the same update."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    def forward(self, x, labels=None):
        logits = self.net(x)
        if labels is None:
            return (logits,)
        return torch.nn.functional.cross_entropy(logits, labels), logits


class SeenRegressor(Regressor):
    """Records the examples each training forward takes (their first feature, unique per example)."""

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.seen: list[list[float]] = []

    def forward(self, x, labels=None):
        if self.training:
            self.seen.append(sorted(x[:, 0].tolist()))
        return super().forward(x, labels)


class Seen(TrainerCallback):
    """What a ``SeenRegressor`` took in training, rank 0's read back on the driver (a callback's state)."""

    def __init__(self):
        self.seen: list[list[float]] = []

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.seen = list(model.seen)


class InitFailsOnShards(Regressor):
    """A root ``reset_parameters`` that fails on rank 1's shards: FSDP must fall back to rank 0's build."""

    def reset_parameters(self):
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
            raise RuntimeError("this model cannot initialise a shard")
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                layer.reset_parameters()


def rng_files(*ranks: int, of_a_new_process: bool = False) -> set[str]:
    """The ranks' RNG state files in a checkpoint: transformers' loop (raytrainer's Trainer on it, any hosted
    trainer) writes ``rng_state_<rank>.pth``, raytrainer's own loop ``rng_state_<rank>.safetensors``;
    ``of_a_new_process``: a driver script's, which ``pytest --one-loop`` does not reach."""
    trainer = importlib.import_module(raytrainer._EXPORTS["Trainer"]).Trainer if of_a_new_process \
        else raytrainer.Trainer
    suffix = "pth" if issubclass(trainer, transformers.Trainer) else "safetensors"
    return {f"rng_state_{rank}.{suffix}" for rank in ranks}


def make_data(n: int, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return [{"x": x[i], "labels": int(y[i])} for i in range(n)]


class StopAtStepOnRank(TrainerCallback):
    """The HF docs' callback that returns a dict of flags, asked on ONE rank only."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and args.process_index == self.rank:
            return {"should_training_stop": True}
        return None

    def on_train_end(self, args, state, control, **kwargs):
        log.error("rank %d ended at step %d", args.process_index, state.global_step)


class FlagsOnOneRank(TrainerCallback):
    """Flags set outside on_step_end, each on one rank only: a save asked in on_evaluate on rank 0, a stop
    asked in on_log on rank 1. Each rank writes the steps it saved at and where it ended."""

    def __init__(self, save_at: int, stop_at: int):
        self.save_at, self.stop_at, self.saved = save_at, stop_at, []

    def on_evaluate(self, args, state, control, **kwargs):
        if state.global_step == self.save_at and args.process_index == 0:
            control.should_save = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.global_step == self.stop_at and args.process_index == 1 and "loss" in (logs or {}):
            control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):
        self.saved.append(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        log.error("rank %d saved at %s and ended at step %d", args.process_index, self.saved,
                  state.global_step)


class FlagSyncCounter(TrainerCallback):
    """Counts, on each rank, the all-reduces of the control flags during training (the loop's agreement:
    one int32 tensor of the five flags and the busy bit), by wrapping ``torch.distributed.all_reduce``
    between on_train_begin and on_train_end. Never touches ``control``."""

    def __init__(self):
        self.flag_syncs = None

    def on_train_begin(self, args, state, control, **kwargs):
        import torch.distributed as dist

        self.flag_syncs, real = 0, dist.all_reduce

        def counting(tensor, *a, **kw):
            if tensor.dtype == torch.int32 and tensor.numel() == 6:
                self.flag_syncs += 1
            return real(tensor, *a, **kw)

        counting.real = real
        dist.all_reduce = counting

    def on_train_end(self, args, state, control, **kwargs):
        import torch.distributed as dist

        dist.all_reduce = dist.all_reduce.real


class FlagSyncCounterThatMayStop(FlagSyncCounter):
    """The same, and a stop it would ask for at a step the run never reaches: it may decide, so the ranks
    agree on the flags after every step."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > 10**6:
            control.should_training_stop = True


class LoggingTrainer(Trainer):
    """compute_loss override that says where it runs, at WARNING and at ERROR level, once per rank."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not getattr(self, "_announced", False):
            self._announced = True
            log.warning("warning from rank %d", self.args.process_index)
            log.error("compute_loss override running on rank %d", self.args.process_index)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class DropoutRegressor(Regressor):
    """With dropout: exact resume needs every rank's RNG state back."""

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.net.insert(2, torch.nn.Dropout(0.3))


class ReportSharding(TrainerCallback):
    """Says, on every rank, what the model is and how much of each weight this rank holds."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        weight = model.net[0].weight
        local = weight.to_local().numel() if isinstance(weight, DTensor) else weight.numel()
        log.error("rank %d: FSDPModule=%s DTensor=%s local=%d of %d", args.process_index,
                  isinstance(model, FSDPModule), isinstance(weight, DTensor), local, weight.numel())


class ReportEngine(Trainer):
    """Says once, on every rank, what training_step is handed: the DeepSpeed engine, its ZeRO stage, its
    optimizer wrapper, and how much of the first parameter this rank holds (ZeRO-3 partitions it)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not getattr(self, "_reported", False):
            self._reported = True
            weight = next(model.module.parameters())
            local = weight.ds_tensor.numel() if hasattr(weight, "ds_tensor") else weight.numel()
            full = getattr(weight, "ds_numel", weight.numel())
            log.error("rank %d: %s stage=%d optimizer=%s local=%d of %d dtype=%s", self.args.process_index,
                      type(model).__name__, model.zero_optimization_stage(), type(model.optimizer).__name__,
                      local, full, str(getattr(weight, "ds_tensor", weight).dtype).removeprefix("torch."))
        return super().training_step(model, inputs, num_items_in_batch)


class OutOfMemoryOnRank1(Regressor):
    """Rank 1 alone 'runs out of memory' (the CPU allocator's error) on training batches above 5."""

    def forward(self, x, labels=None):
        import torch.distributed as dist

        if self.training and x.shape[0] > 5 and dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 TB")
        return super().forward(x, labels)


class TokenNet(torch.nn.Module):
    """Token ids -> mean of the input embeddings -> 2 classes (input embeddings for NEFTune)."""

    def __init__(self, seq: int = 5, dim: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, dim)
        self.head = torch.nn.Linear(dim, 2)

    def get_input_embeddings(self):  # what transformers' loop hooks NEFTune's noise on
        return self.emb

    def forward(self, input_ids, labels=None):
        logits = self.head(self.emb(input_ids).mean(dim=1))
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def token_data(n: int, seq: int = 5) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 20, (n, seq), generator=g)
    return [{"input_ids": ids[i], "labels": int(ids[i, 0] > 9)} for i in range(n)]


class NEFTuneProbe(TrainerCallback):
    """On every rank: the noise train-mode lookups of the same ids get (and eval mode does not), and, at an
    ``evaluate()`` after ``train()``, whether the hook is gone (transformers removes it once ``train()``'s
    loop has returned, after ``on_train_end``)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step != 1:
            return
        ids = torch.arange(5).unsqueeze(0)
        clean = torch.nn.functional.embedding(ids, model.emb.weight).detach()
        model.train()
        first, second = (model.emb(ids).detach() - clean for _ in range(2))
        model.eval()
        eval_delta = (model.emb(ids).detach() - clean).abs().max().item()
        model.train()
        log.error("rank %d: neftune train max=%.6f fresh=%s eval=%.1f", args.process_index,
                  first.abs().max().item(), not torch.equal(first, second), eval_delta)

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        log.error("rank %d: neftune hooks after train=%d", args.process_index, len(model.emb._forward_hooks))


class RecordPid(TrainerCallback):
    """Every rank writes its process id to ``output_dir/pid-rank<r>`` (to attribute storage requests)."""

    def on_train_begin(self, args, state, control, **kwargs):
        import os

        with open(os.path.join(args.output_dir, f"pid-rank{args.process_index}"), "w") as f:
            f.write(str(os.getpid()))


class WideDropoutRegressor(torch.nn.Module):
    """Big enough (68k parameters) that each rank's optimizer shard outweighs the small replicated entries
    (step counters, parameter groups) DCP spreads across the ranks' files."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 256), torch.nn.Tanh(), torch.nn.Dropout(0.3),
                                       torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 3))

    def forward(self, x, labels=None):
        logits = self.net(x)
        return torch.nn.functional.cross_entropy(logits, labels), logits


class UnusedHead(Regressor):
    """A head the loss never uses (as a pooler in a token-classification model): DDP must be told to look
    for unused parameters, or the second step fails with "Expected to have finished reduction"."""

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.unused = torch.nn.Linear(16, 2)


# -- memory of sharded construction ------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class WideStack(torch.nn.Module):
    """``layers`` x Linear(width, width) and a bias-free head: a model whose size dominates a worker's
    memory (16 x 2048^2 fp32 = 256 MiB), with a non-persistent buffer (as rotary tables are)."""

    def __init__(self, width: int = 2048, layers: int = 16):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))
        self.head = torch.nn.Linear(width, 2)
        self.register_buffer("scale", torch.full((width,), 0.5), persistent=False)

    def reset_parameters(self):
        """Every parameter and buffer as ``__init__`` makes them (FSDP initialises each rank's shard so)."""
        for layer in self.layers:
            layer.reset_parameters()
        self.head.reset_parameters()
        self.scale.fill_(0.5)

    def forward(self, x, labels=None):
        for layer in self.layers:
            x = torch.tanh(layer(x * self.scale) + x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits, labels), logits


def build_wide_stack() -> WideStack:
    """model_init: records this process's resident memory, and resets its peak, before building."""
    return _measured(WideStack)


def _measured(build):
    """``build()``, with this process's resident memory before it and its peak during it recorded."""
    import torch.distributed.fsdp  # imports are not the model: loaded before the baseline
    import torch.distributed.tensor  # noqa: F401

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    os.environ["TESTS_RSS_AT_MODEL_INIT_KIB"] = str(_status_kib("VmRSS"))  # this worker process's
    model = build()
    os.environ["TESTS_PEAK_AFTER_MODEL_INIT_KIB"] = str(_status_kib("VmHWM"))  # construction's peak
    return model


class PlainStack(torch.nn.Module):
    """A plain torch model with no root ``reset_parameters()`` and no transformers initialisation: FSDP
    initialises each rank's shard with each module's own (``nn.Linear``'s, ``nn.LayerNorm``'s)."""

    def __init__(self, width: int = 256, layers: int = 4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 2)

    def forward(self, x, labels=None):
        for layer in self.layers:
            x = torch.tanh(layer(x) + x)
        logits = self.head(self.norm(x))
        return torch.nn.functional.cross_entropy(logits, labels), logits


def build_plain_stack() -> PlainStack:
    return _measured(PlainStack)


class ReportPlainInit(TrainerCallback):
    """On every rank before the first step: how this rank's shard of a PlainStack was initialised -- the
    largest |weight| of its Linear shards over nn.Linear's bound 1/sqrt(in_features), their spread, whether
    the LayerNorm's shard is ones, and a checksum of its first layer's shard (ranks must differ)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        import math

        from torch.distributed.tensor import DTensor

        def local(t):
            return t.to_local() if isinstance(t, DTensor) else t

        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        ratio = max(float(local(m.weight).abs().max()) * math.sqrt(m.in_features) for m in linears)
        spread = min(float(local(m.weight).std()) * math.sqrt(m.in_features) for m in linears)
        norm = next(m for m in model.modules() if isinstance(m, torch.nn.LayerNorm))
        ones = bool(torch.all(local(norm.weight) == 1))
        log.error("rank %d: bound_ratio=%.4f spread=%.4f norm_ones=%s first=%.6f", args.process_index, ratio,
                  spread, ones, float(local(linears[0].weight).sum()))


def wide_data(n: int, width: int = 2048) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, width, generator=g)
    return [{"x": x[i], "labels": int(x[i, 0] > 0)} for i in range(n)]


class ReportParameterMemory(TrainerCallback):
    """On every rank before the first step: the bytes of parameter storage the rank holds (a DTensor's local
    shard, a ZeRO-3 partition), the model's full size, and the peak growth of resident memory since
    model_init began, until now and until model_init returned (construction alone)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from torch.distributed.tensor import DTensor

        held = full = 0
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else getattr(p, "ds_tensor", p)
            held += local.numel() * local.element_size()
            full += getattr(p, "ds_numel", p.numel()) * p.element_size()
        base = int(os.environ["TESTS_RSS_AT_MODEL_INIT_KIB"])
        growth = (_status_kib("VmHWM") - base) * 1024
        built = (int(os.environ["TESTS_PEAK_AFTER_MODEL_INIT_KIB"]) - base) * 1024
        log.error("rank %d: held=%d full=%d peak_growth=%d init_growth=%d", args.process_index, held, full,
                  growth, built)


def tiny_gpt2():
    """model_init: a 2-layer GPT-2 from a config (transformers initialises it with its ``_init_weights``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=64, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def counting_data(n: int) -> list[dict]:
    """Lines of 16 tokens counting up from a start by a step of 1-3 (mod 31, 0 left out): learnable."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(n):
        start = int(torch.randint(1, 32, (1,), generator=g))
        step = int(torch.randint(1, 4, (1,), generator=g))
        ids = torch.tensor([(start + i * step - 1) % 31 + 1 for i in range(16)])
        rows.append({"input_ids": ids, "labels": ids})
    return rows


class ReportInitialShards(TrainerCallback):
    """On every rank before the first step: the parameter bytes the rank holds against the model's, and the
    initial weights' statistics, gathered (a collective on every rank): the std of GPT-2's residual
    projections (scaled by 1/sqrt(2 n_layer)) and of its other matrices, whether the norms are ones, and
    whether the two halves of the token embedding (the two ranks' shards) hold the same numbers."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from torch.distributed.tensor import DTensor

        held = full = 0
        weights = {}
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            held += local.numel() * local.element_size()
            full += p.numel() * p.element_size()
            weights[name] = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        proj = torch.cat([w.flatten() for n, w in weights.items() if n.endswith("c_proj.weight")])
        attn = torch.cat([w.flatten() for n, w in weights.items() if n.endswith("c_attn.weight")])
        ones = all(bool((w == 1).all()) for n, w in weights.items() if ".ln_" in n and n.endswith("weight"))
        wte = weights["transformer.wte.weight"]
        log.error("rank %d: held=%d full=%d proj_std=%.5f attn_std=%.5f norms_ones=%s halves_equal=%s",
                  args.process_index, held, full, proj.std(), attn.std(), ones,
                  torch.equal(wte[:16], wte[16:]))


class SeenRows(torch.nn.Module):
    """A Regressor that records the first feature of every training row it sees (each row's id)."""

    def __init__(self):
        super().__init__()
        self.inner = Regressor()
        self.seen: list[int] = []

    def forward(self, x, labels=None):
        if self.training:
            self.seen.extend(int(v) for v in x[:, 0].round().tolist())
        return self.inner(x, labels)


class ReportSeenRows(TrainerCallback):
    """Each rank logs the ids its model trained on in each epoch."""

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        log.error("rank %d epoch %d seen=%s", args.process_index, round(state.epoch), model.seen)
        model.seen.clear()


class _InfLossOnRank:
    """A training loss of inf on one rank, in the update to ``inf_step`` (a deterministic failure)."""

    inf_rank, inf_step = 1, 2

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.args.process_index == self.inf_rank and self.state.global_step + 1 == self.inf_step:
            return (out[0] * float("inf"), *out[1:]) if return_outputs else out * float("inf")
        return out


class InfLossOnRank(_InfLossOnRank, Trainer):
    """raytrainer's Trainer, with an inf loss on rank 1 in the update to step 2."""


class HostedInfLossOnRank(_InfLossOnRank, raytrainer.on_ray(transformers.Trainer)):
    """transformers' own Trainer on Ray workers, with an inf loss on rank 1 in the update to step 2."""


class CountTrainingStarts(TrainerCallback):
    """Every rank appends a line to ``output_dir/train-starts`` when it starts training."""

    def on_train_begin(self, args, state, control, **kwargs):
        with open(os.path.join(args.output_dir, "train-starts"), "a") as f:
            f.write(f"rank {args.process_index}\n")


class PreemptionNoticeAt(TrainerCallback):
    """Ray Train's preemption notice, with a deadline ``deadline_s`` away, reaches rank ``rank`` at the end
    of step ``step``, as Ray's PreemptionWatcher delivers it (its ``mark_preempt`` on the worker actor sets
    this same field of the worker's train context): a real drain needs a node this one-node test instance
    cannot spare (tests/integration/test_preemption_multinode.py drains one of a local cluster's). The
    notice is taken back at the end of training: the warm workers serve the next call."""

    def __init__(self, rank: int, step: int, deadline_s: float):
        self.rank, self.step, self.deadline_s = rank, step, deadline_s

    def _context(self):
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().preemption_context

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and args.process_index == self.rank:
            from ray.train.v2.api.preemption import PreemptionInfo

            self._context().preemption_info = PreemptionInfo(
                deadline_ms=int((time.time() + self.deadline_s) * 1000),
                preempted_node_to_ranks={"a-node-of-this-run": [self.rank]})

    def on_train_end(self, args, state, control, **kwargs):
        self._context().preemption_info = None


class StepLog(TrainerCallback):
    """Rank 0 appends "<pid> <step>" to ``output_dir/steps`` at each step's end: a restarted worker group's
    steps come from another process, and a step written twice was trained twice."""

    def on_step_end(self, args, state, control, **kwargs):
        if args.process_index == 0:
            with open(os.path.join(args.output_dir, "steps"), "a") as f:
                f.write(f"{os.getpid()} {state.global_step}\n")


class SlowStepLog(TrainerCallback):
    """Each step sleeps ``seconds`` on every rank; rank 0 appends ``<pid> <step>`` to ``path``."""

    def __init__(self, path: str, seconds: float):
        self.path, self.seconds = path, seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)
        if state.is_world_process_zero:
            with open(self.path, "a") as f:
                f.write(f"{os.getpid()} {state.global_step}\n")


class PrintingTrainer(Trainer):
    """Prints one line per rank at the first training step (user code's print() on a worker)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.state.global_step == 0 and model.training:
            print(f"PRINTED-BY-RANK-{self.args.process_index}", flush=True)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class DieOnceOnRank(TrainerCallback):
    """Rank ``rank``'s process exits at ``step``, ``times`` times in all (a lost worker; each death is a line
    of ``output_dir/died``)."""

    def __init__(self, step: int, rank: int, times: int = 1):
        self.step, self.rank, self.times = step, rank, times

    def on_step_end(self, args, state, control, **kwargs):
        marker = os.path.join(args.output_dir, "died")
        if state.global_step != self.step or args.process_index != self.rank:
            return
        deaths = 0
        if os.path.exists(marker):
            with open(marker) as f:
                deaths = len(f.read().split())
        if deaths < self.times:
            with open(marker, "a") as f:
                f.write(f"{os.getpid()}\n")
            os._exit(1)


class RaiseOnRank(TrainerCallback):
    """The user's code fails on one rank: ``ValueError`` as step ``step`` ends on rank ``rank``."""

    def __init__(self, step: int, rank: int = 1):
        self.step, self.rank = step, rank

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and args.process_index == self.rank:
            raise ValueError(f"the user's callback failed on rank {self.rank} at step {self.step}")


class SigtermOnceOnRank(TrainerCallback):
    """Rank ``rank``'s process is sent SIGTERM as step ``step`` begins, once (``output_dir/sigterm`` holds
    its pid), as a scheduler ending the job signals it: the OS delivers it and Ray's handler on the actor's
    main thread meets it. The step waits until raytrainer has heard it (at most 5 s), so the signal arrives
    within step ``step`` however busy the machine is."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_step_begin(self, args, state, control, **kwargs):
        import signal

        from raytrainer.worker import signals

        marker = os.path.join(args.output_dir, "sigterm")
        if state.global_step != self.step - 1 or args.process_index != self.rank or os.path.exists(marker):
            return
        with open(marker, "w") as f:
            f.write(f"{os.getpid()}\n")
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 5
        while time.time() < deadline and not (signals._listener and signals._listener.received):
            time.sleep(0.01)


class DieOnceInEvaluation(TrainerCallback):
    """Rank 1's process exits at its first prediction step, once (``output_dir/died`` marks it)."""

    def on_prediction_step(self, args, state, control, **kwargs):
        marker = os.path.join(args.output_dir, "died")
        if args.process_index == 1 and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            os._exit(1)


class DiesWhileSaving(TrainerCallback):
    """Rank 0's process exits while ``checkpoint-<step>`` is being saved, once (a node lost during a save;
    ``output_dir/died`` marks it): its weights file cut short, before the checkpoint is committed (the
    rank layer's commit runs after the script's callbacks, its background write dies with the process)."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        marker = os.path.join(args.output_dir, "died")
        if state.global_step == self.step and args.process_index == 0 and not os.path.exists(marker):
            with open(os.path.join(folder, "model.safetensors"), "wb") as f:
                f.write(b"\0" * 64)  # a partial file
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            os._exit(1)


# -- sequence to sequence (Seq2SeqTrainer) -------------------------------------------------------------------
def tiny_t5(state: dict | None = None):
    """A 2-layer T5 built from a config (no download); ``state``: weights to load."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=24, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                      num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    model = T5ForConditionalGeneration(config)
    if state is not None:
        model.load_state_dict(state)
    return model


def reversal_pairs(n: int, seed: int = 3) -> list[dict]:
    """A deterministic 'translation': the target is the source reversed, then </s>; sources of 3 to 5 ids,
    labels padded with -100 (as DataCollatorForSeq2Seq does)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 3 + i % 3
        src = torch.randint(2, 24, (length,), generator=g)
        ids = torch.zeros(6, dtype=torch.long)
        ids[:length] = src
        labels = torch.full((7,), -100, dtype=torch.long)
        labels[:length] = src.flip(0)
        labels[length] = 1
        out.append({"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": labels})
    return out


def token_accuracy(p) -> dict:
    preds, labels = p.predictions, p.label_ids
    if isinstance(preds, tuple):  # logits (predict_with_generate=False)
        preds = preds[0].argmax(-1)
    n = min(preds.shape[1], labels.shape[1])
    mask = labels[:, :n] != -100
    return {"token_accuracy": float((preds[:, :n][mask] == labels[:, :n][mask]).mean())}


class SlowOnRank:
    """A collator that takes ``seconds`` longer on one rank: a straggler's slow data loading."""

    def __init__(self, rank: int, seconds: float):
        self.rank, self.seconds = rank, seconds

    def __call__(self, examples):
        import time

        from raytrainer import default_data_collator

        if torch.distributed.is_initialized() and torch.distributed.get_rank() == self.rank:
            time.sleep(self.seconds)
        return default_data_collator(examples)


class Journal(TrainerCallback):
    """Records on the workers what a script reads on the driver afterwards (as transformers' callbacks, which
    run in the script's own process): the events, the world size it saw, and a file handle that cannot be
    pickled (it stays on the worker; the driver's instance never gets one)."""

    def __init__(self):
        self.events: list[str] = []
        self.world_size = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append("train_begin")
        self.world_size = args.world_size
        self.handle = open(os.devnull)  # noqa: SIM115

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(f"step_end {state.global_step}")

    def on_evaluate(self, args, state, control, **kwargs):
        self.events.append("evaluate")

    def on_predict(self, args, state, control, **kwargs):
        self.events.append("predict")


def tiny_hf_regressor():
    """A transformers model (its ``config`` is what trackers log) as small as Regressor, for model_init."""
    from transformers import PretrainedConfig, PreTrainedModel

    class TinyTrackedConfig(PretrainedConfig):
        model_type = "raytrainer-tiny-tracked"

        def __init__(self, in_features: int = 6, num_labels: int = 3, **kwargs):
            self.in_features = in_features
            super().__init__(num_labels=num_labels, **kwargs)

    class TinyTracked(PreTrainedModel):
        config_class = TinyTrackedConfig

        def __init__(self, config):
            super().__init__(config)
            self.linear = torch.nn.Linear(config.in_features, config.num_labels)

        def forward(self, x, labels=None):
            logits = self.linear(x)
            if labels is None:
                return (logits,)
            return torch.nn.functional.cross_entropy(logits, labels), logits

    torch.manual_seed(0)
    return TinyTracked(TinyTrackedConfig())


class RecordRaytrainerFile(TrainerCallback):
    """Where each rank imported raytrainer from (a checkout's tests must run its own code on the workers)."""

    def __init__(self):
        self.files = {}

    def on_train_begin(self, args, state, control, **kwargs):
        import raytrainer

        self.files[args.process_index] = (raytrainer.__file__, os.getpid())


def save_tiny_llama(folder) -> str:
    """A tiny Llama causal LM (tied embeddings, a rotary buffer transformers leaves out of the file) saved
    with ``save_pretrained``: the "pretrained" model a from_pretrained test fine-tunes (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    return str(folder)


class FromPretrained:
    """model_init: ``AutoModelForCausalLM.from_pretrained(path)``, with PEFT's LoRA on ``targets`` (a Llama's
    attention q and v projections by default) when ``lora``. Records where the weights it returned live
    (``TESTS_BUILT_ON``: ``meta``, ``cpu`` or ``partitioned`` by ZeRO-3) for ``ReportStartingWeights``."""

    def __init__(self, path: str, lora: bool = False, targets: tuple = ("q_proj", "v_proj")):
        self.path, self.lora, self.targets = path, lora, list(targets)

    def __call__(self):
        return self.build(r=4, lora_alpha=8)

    def build(self, r: int, lora_alpha: int):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.path)
        weight = model.get_input_embeddings().weight
        os.environ["TESTS_BUILT_ON"] = "partitioned" if hasattr(weight, "ds_id") else weight.device.type
        if self.lora:
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=self.targets)
            model = get_peft_model(model, config)
        return model


class LoraPerTrial(FromPretrained):
    """model_init(trial) of a hyperparameter search: FromPretrained's LoRA with the trial's ``r`` and
    ``lora_alpha`` (4 and 8 without a trial)."""

    def __init__(self, path: str):
        super().__init__(path, lora=True)

    def __call__(self, trial=None):
        params = trial.params if trial is not None else {}
        return self.build(r=params.get("r", 4), lora_alpha=params.get("lora_alpha", 8))


def pretrained_key(name: str) -> str:
    """A parameter's name in the saved file, from its name in the (possibly LoRA-wrapped) model."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


class ReportStartingWeights(TrainerCallback):
    """On every rank before the first step, gathered (a collective): how far the model's weights are from
    the saved pretrained ones, the largest LoRA B value (PEFT starts B at zero: the adapted model is the
    pretrained one), the parameter bytes this rank holds against the model's, and where model_init's
    from_pretrained put the weights on this rank."""

    def __init__(self, path: str):
        self.path = path

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        import contextlib

        from safetensors.torch import load_file
        from torch.distributed.tensor import DTensor

        saved = load_file(os.path.join(self.path, "model.safetensors"))
        params = dict(model.named_parameters())
        gathered = contextlib.nullcontext()
        if any(hasattr(p, "ds_id") for p in params.values()):
            import deepspeed

            gathered = deepspeed.zero.GatheredParameters(list(params.values()))
        held = full = 0
        diff = lora_b = 0.0
        compared = 0
        for p in params.values():
            local = p.to_local() if isinstance(p, DTensor) else getattr(p, "ds_tensor", p)
            held += local.numel() * local.element_size()
            full += getattr(p, "ds_numel", p.numel()) * p.element_size()
        with gathered, torch.no_grad():
            for name, p in params.items():
                value = p.full_tensor() if isinstance(p, DTensor) else p.detach()
                if ".lora_B." in name:
                    lora_b = max(lora_b, float(value.abs().max()))
                elif ".lora_" not in name and pretrained_key(name) in saved:
                    diff = max(diff, float((value.float() - saved[pretrained_key(name)].float()).abs().max()))
                    compared += 1
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        tied = inner.get_output_embeddings().weight is inner.get_input_embeddings().weight
        log.error("rank %d: built_on=%s start_diff=%g compared=%d lora_b_max=%g held=%d full=%d tied=%d",
                  args.process_index, os.environ.get("TESTS_BUILT_ON"), diff, compared, lora_b, held, full,
                  tied)




class FirstLogitShift(torch.nn.Module):
    """Adds a learned number (named ``bias``: a no-decay parameter) to the first logit."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def forward(self, logits):
        return logits + torch.nn.functional.pad(self.bias, (0, logits.shape[-1] - 1))


class OneBiasRegressor(DropoutRegressor):
    """A DropoutRegressor whose only bias is one number (FirstLogitShift): the optimizer's no-decay group
    holds 1 number, which ZeRO-1/2 pads to 4 and cuts in 2 on 2 ranks, so rank 1's partition of that group is
    padding only."""

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        torch.manual_seed(seed)
        self.net[0] = torch.nn.Linear(6, 16, bias=False)
        self.net[-1] = torch.nn.Linear(16, 3, bias=False)
        self.net.append(FirstLogitShift())


def train_into_the_full_disk(trainer, out) -> set[str]:
    """Run ``trainer`` (with ``SlowThenFullDisk(slow=5, full=10)``) to its failure, and check what a failed
    background write leaves: the run fails naming checkpoint-10 and ENOSPC, the step did not wait for
    checkpoint-5's held-back write, checkpoint-5 alone is committed. Returns checkpoint-5's manifest files."""
    import pytest

    from raytrainer.checkpoint import committed_checkpoints
    from raytrainer.storage import Storage

    failed = r"writing checkpoint .*checkpoint-10 failed, so it is not committed"
    with pytest.raises(Exception, match=failed) as info:
        trainer.train()
    assert "No space left on device" in str(info.value)
    seen = [json.loads(line) for line in (out / "written-at-save.jsonl").read_text().splitlines()]
    assert seen[0] == {"step": 5, "written": False}, seen  # the step did not wait for the 5 s write
    assert [step for step, _ in committed_checkpoints(Storage.from_uri(str(out)), warn=False)] == [5]
    assert not (out / "checkpoint-10" / "manifest.json").exists()
    return set(json.loads((out / "checkpoint-5" / "manifest.json").read_text())["files"])


class SlowThenFullDisk(TrainerCallback):
    """Rank 0's background checkpoint writes for two of this run's checkpoints: ``checkpoint-<slow>`` is held
    back 5 s, ``checkpoint-<full>`` fails as a full disk does (ENOSPC), after which the patch is undone (warm
    workers outlive the run). Patched at the narrowest place where a slow or a full disk can be made to
    happen here: DCP's ``FileSystemWriter.write_data`` (FSDP, ``writer="dcp"``), ``torch.save`` of a
    DeepSpeed engine file (``writer="deepspeed"``: files under ``global_step<N>/``) or of the optimizer's
    state under DDP (``writer="optimizer"``: ``optimizer.pt``). At each save rank 0
    records whether the checkpoint's sharded files were all written when its training thread went on."""

    def __init__(self, slow: int, full: int, writer: str = "dcp"):
        self.slow, self.full, self.writer = slow, full, writer

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        out = os.path.abspath(args.output_dir)
        slow, full = (os.path.join(out, f"checkpoint-{step}") for step in (self.slow, self.full))

        def hold_or_fail(where: str, undo) -> None:
            if where.startswith(slow + os.sep):
                time.sleep(5)
            elif where.startswith(full + os.sep):
                undo()
                raise OSError(28, "No space left on device", where)

        if self.writer in ("deepspeed", "optimizer"):
            original_save = torch.save
            marks = f"{os.sep}global_step" if self.writer == "deepspeed" else f"{os.sep}optimizer.pt"

            def save(obj, f, *a, **kw):
                if isinstance(f, (str, os.PathLike)) and marks in str(f):
                    hold_or_fail(os.path.abspath(f), lambda: setattr(torch, "save", original_save))
                return original_save(obj, f, *a, **kw)

            torch.save = save
            return
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        original = FileSystemWriter.write_data

        def write_data(writer, plan, planner):
            hold_or_fail(str(writer.path), lambda: setattr(FileSystemWriter, "write_data", original))
            return original(writer, plan, planner)

        FileSystemWriter.write_data = write_data

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            import glob

            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if self.writer == "deepspeed":
                rank0 = os.path.join(folder, "global_step*", "*zero_pp_rank_0_*optim_states.pt")
                written = bool(glob.glob(rank0))
            elif self.writer == "optimizer":
                written = os.path.exists(os.path.join(folder, "optimizer.pt"))
            else:
                written = all(os.path.exists(os.path.join(folder, d, ".metadata"))
                              for d in ("optimizer_0", "pytorch_model_fsdp_0"))
            with open(os.path.join(args.output_dir, "written-at-save.jsonl"), "a") as f:
                f.write(json.dumps({"step": state.global_step, "written": written}) + "\n")


class ReportMesh(TrainerCallback):
    """On every rank before the first step: how the first attention's query projection and the final norm
    are laid out -- the mesh dimensions, the placements, this rank's local shape against the whole."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from torch.distributed.tensor import DTensor

        params = dict(model.named_parameters())
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
            p = params[name]
            if not isinstance(p, DTensor):
                log.error("rank %d: %s plain %s", args.process_index, name, tuple(p.shape))
                continue
            placements = ",".join(type(x).__name__.lstrip("_") + str(getattr(x, "dim", ""))
                                  for x in p.placements)
            log.error("rank %d: %s mesh=%s placements=%s local=%s of %s", args.process_index, name,
                      ",".join(p.device_mesh.mesh_dim_names), placements, tuple(p.to_local().shape),
                      tuple(p.shape))


class TPBlock(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, h):
        return h + self.down(torch.relu(self.up(h)))


class TPBlocks(torch.nn.Module):
    """A plain torch classifier with a tensor-parallel plan in transformers' names (``*`` for a layer
    number) and its layers named for FSDP's units, as a user's own model would declare them."""

    tp_plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
    _no_split_modules = ["TPBlock"]

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(6, 16)
        self.blocks = torch.nn.ModuleList(TPBlock(16) for _ in range(2))
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x, labels=None):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        logits = self.out(h)
        if labels is None:
            return (logits,)
        return torch.nn.functional.cross_entropy(logits, labels), logits


class ReportBlocks(TrainerCallback):
    """On every rank before the first step: the layout of TPBlocks' first block (mesh dimensions,
    placements, local shape), the largest value of its up projection's local shard and its first value."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        block = model.blocks[0]
        for name, p in (("up", block.up.weight), ("down", block.down.weight)):
            placements = ",".join(type(x).__name__.lstrip("_") + str(getattr(x, "dim", ""))
                                  for x in p.placements)
            local = p.to_local()
            log.error("rank %d: %s mesh=%s %s local=%s max=%.4f first=%.6f", args.process_index, name,
                      ",".join(p.device_mesh.mesh_dim_names), placements, tuple(local.shape),
                      float(local.abs().max()), float(local.flatten()[0]))


def seeded_tp_blocks() -> TPBlocks:
    """model_init: the same TPBlocks weights at every call."""
    torch.manual_seed(0)
    return TPBlocks()


class MarkThenWait(TrainerCallback):
    """Rank 0 writes ``<output_dir>/at-step`` at the end of step ``step``, then waits ``seconds``: a run
    caught mid-command, for a test to act on from outside."""

    def __init__(self, step: int, seconds: float):
        self.step, self.seconds = step, seconds

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and state.is_world_process_zero:
            with open(os.path.join(args.output_dir, "at-step"), "w") as f:
                f.write(str(state.global_step))
            time.sleep(self.seconds)
