"""What every side of the benchmark shares: the data, the models, the settings and the step recorder.

Imported by the side scripts (and, through the pickled Trainer, by Ray Train workers), so it imports
only torch and numpy at module level; transformers is imported only when the BERT model is built.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

SEED = 42
LOGGING_STEPS = 50


# -- data ---------------------------------------------------------------------------------------------
class DictDataset(torch.utils.data.Dataset):
    """Equal-length tensors; item i is {name: tensor[i]}. Collated by ``torch.utils.data.default_collate``."""

    def __init__(self, **tensors: torch.Tensor):
        self.tensors = tensors
        self.n = len(next(iter(tensors.values())))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.tensors.items()}


def collate(batch):
    """The one collator every side uses (so collators are not what is being compared)."""
    return torch.utils.data.default_collate(batch)


def build_dataset(cfg: dict) -> DictDataset:
    if cfg["workload"] == "mlp":
        data = np.load(cfg["digits_path"])
        return DictDataset(x=torch.from_numpy(data["x"]), labels=torch.from_numpy(data["y"]))
    rng = np.random.default_rng(SEED)
    ids = rng.integers(0, cfg["vocab_size"], size=(cfg["examples"], cfg["seq_len"]), dtype=np.int64)
    # The tokens determine the label: more than half of them from the lower half of the vocabulary.
    labels = ((ids < cfg["vocab_size"] // 2).sum(axis=1) > cfg["seq_len"] // 2).astype(np.int64)
    return DictDataset(input_ids=torch.from_numpy(ids), labels=torch.from_numpy(labels))


def write_digits(path: str) -> None:
    """sklearn's digits (bundled, no download), features scaled to [0, 1]; saved once by the driver."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    np.savez(path, x=(digits.data / 16.0).astype(np.float32), y=digits.target.astype(np.int64))


# -- models -------------------------------------------------------------------------------------------
class MLPClassifier(nn.Module):
    def __init__(self, d_in: int = 64, hidden: int = 256, n_classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, n_classes))

    def forward(self, x, labels=None):
        logits = self.net(x)
        if labels is None:
            return {"logits": logits}
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def build_model(cfg: dict) -> nn.Module:
    torch.manual_seed(SEED)
    if cfg["workload"] == "mlp":
        return MLPClassifier()
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=cfg["vocab_size"], hidden_size=128, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=512,
                        max_position_embeddings=cfg["seq_len"], num_labels=2)
    return BertForSequenceClassification(config)


def prepare(cfg: dict) -> None:
    """The script's own preparation before it builds its model and Trainer (``--prepare-s``): Python work on
    one core for that long, as tokenising a data set is (under torchrun every rank does it)."""
    import time

    end = time.perf_counter() + float(cfg.get("prepare_s", 0) or 0)
    n = 0
    while time.perf_counter() < end:
        n += sum(i * i for i in range(1000))


def trainer_kwargs(cfg: dict) -> dict:
    """TrainingArguments fields that are the same for raytrainer and transformers."""
    return dict(
        per_device_train_batch_size=cfg["batch_size"],
        num_train_epochs=cfg["epochs"],
        learning_rate=cfg["lr"],
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",
        eval_strategy="no",
        save_strategy="no",
        logging_strategy="steps",
        logging_steps=LOGGING_STEPS,
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_drop_last=True,
        remove_unused_columns=False,
        seed=SEED,
        use_cpu=True,
    )


def linear_schedule(optimizer, total_steps: int):
    """transformers' get_linear_schedule_with_warmup with 0 warmup steps."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: max(0.0, float(total_steps - step) / float(max(1, total_steps))))


# -- recording --------------------------------------------------------------------------------------
def hand_loop(cfg: dict, clock) -> tuple[nn.Module, int, list[tuple[int, float]], float]:
    """The hand-written PyTorch loop (bench_core's side (a), bench_step's hand side): what the trainers do
    per step and nothing more. ``clock`` is told ``mark("train_begin")``, each ``mark_optimizer_step()`` and
    ``mark_step_end()`` (a Recorder has these). Returns the model, the step count, each logging step's
    summed losses ``(step, sum over LOGGING_STEPS steps)`` and the sum of the steps after the last one."""
    dataset, model = build_dataset(cfg), build_model(cfg)
    generator = torch.Generator().manual_seed(SEED)
    loader = torch.utils.data.DataLoader(dataset, batch_size=cfg["batch_size"], shuffle=True, drop_last=True,
                                         collate_fn=collate, num_workers=0, generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0, fused=True)
    scheduler = linear_schedule(optimizer, len(loader) * cfg["epochs"])

    clock.mark("train_begin")
    model.train()
    step, running, sums = 0, torch.zeros(()), []
    for _epoch in range(cfg["epochs"]):
        for batch in loader:
            loss = model(**batch)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            clock.mark_optimizer_step()
            scheduler.step()
            model.zero_grad(set_to_none=True)
            running += loss.detach()
            step += 1
            clock.mark_step_end()
            if step % LOGGING_STEPS == 0:
                sums.append((step, running.item()))
                running.zero_()
    return model, step, sums, running.item()


class Recorder:
    """Rank 0's clock: time to the first optimizer step (from BENCH_T0, the driver's launch time) and the
    end time of every step. The driver turns these into the steady-state rate.

    Mixed into a TrainerCallback by the raytrainer and transformers sides (then it travels, pickled, to
    the Ray Train workers: t0 and the output path are attributes, not read from the worker's env).
    """

    def __init__(self, t0: float | None = None, out_path: str | None = None):
        self.t0 = float(os.environ["BENCH_T0"]) if t0 is None else t0
        self.out_path = os.environ["BENCH_OUT"] if out_path is None else out_path
        # Seconds since launch at a few milestones: imports done (made in main()), training begins.
        self.marks: dict[str, float] = {"imports_done": time.time() - self.t0}
        self.first_step_s: float | None = None
        self.step_ends: list[float] = []
        self.logs: list[dict] = []

    def __setstate__(self, state: dict) -> None:  # arriving on a Ray Train worker inside the Trainer
        self.__dict__.update(state)
        self.mark("spec_unpickled_on_worker")

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, time.time() - self.t0)

    def mark_optimizer_step(self) -> None:
        if self.first_step_s is None:
            self.first_step_s = time.time() - self.t0

    def mark_step_end(self) -> None:
        self.step_ends.append(time.perf_counter())

    def write(self, world_size: int, batch_size: int, **extra) -> None:
        record = {"time_to_first_step_s": self.first_step_s, "marks_s": self.marks,
                  "step_ends": self.step_ends, "world_size": world_size, "per_device_batch_size": batch_size,
                  "logs": self.logs, "pid": os.getpid(), "torch_threads": torch.get_num_threads(),
                  # which raytrainer this process (rank 0) imported: a --tree side's own checkout
                  "raytrainer_file": getattr(sys.modules.get("raytrainer"), "__file__", None), **extra}
        tmp = self.out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.out_path)

    # -- TrainerCallback events (rank 0 only) --------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.mark("train_begin")

    def on_optimizer_step(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.mark_optimizer_step()

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.mark_step_end()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            self.logs.append({k: v for k, v in logs.items() if isinstance(v, (int, float, str))})

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.write(args.world_size, args.per_device_train_batch_size, global_step=state.global_step)


def load_config(argv: list[str]) -> dict:
    """Side scripts take one argument: the JSON config written by the driver."""
    with open(argv[1]) as f:
        return json.load(f)
