"""The script bench/chaos.py runs (and runs again after a fault that ends it): a 2-worker run of a tiny GPT-2
from a model folder on an existing Ray cluster, written as a user writes one -- it resumes from the output
folder's latest checkpoint when there is one, as transformers' example scripts do.

    python chaos_driver.py ADDRESS WORKDIR HOST STEPS

HOST: ``ddp``, ``fsdp``, ``zero3`` (raytrainer's Trainer) or ``trl`` (TRL's SFTTrainer, ``raytrainer.trl``).
Every rank writes ``WORKDIR/rank<r>.json`` (pid, node, IP) at the first step of each worker group; rank 0
appends ``<pid> <step>`` to ``WORKDIR/steps`` after each step. When ``WORKDIR/fail-next-save`` appears,
rank 0's next checkpoint write fails as a full disk does (ENOSPC), once. At the end the final weights are
saved to ``WORKDIR/out/final``.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time

import torch
from transformers import TrainerCallback

STEP_S = 0.1  # each step sleeps this long on every rank, so a fault lands mid-run, not after it
SAVE_STEPS = 4
#: On this running cluster a script's workers stay up, idle, this long after it ends (raytrainer's keeper):
#: a script run again after its driver was killed may take them, and the harness checks that the idle group
#: then ends and leaves nothing (bench/chaos.py ``leftovers``)
KEEP_WORKERS_S = 10
#: ZeRO-3 with ``save_model`` writing the whole model (``model.safetensors``, what the harness compares), as
#: a transformers user asks for it; without the flag transformers' ``save_model`` writes DeepSpeed's
#: partitions only
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
         "train_micro_batch_size_per_gpu": "auto",
         "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto"}


class Record(TrainerCallback):
    """What the chaos harness reads: where each rank runs, each step rank 0 finished."""

    def __init__(self, work: str):
        self.work, self.first = work, True

    def on_step_end(self, args, state, control, **kwargs):
        import ray

        time.sleep(STEP_S)
        rank = args.process_index
        if self.first:
            self.first = False
            path = os.path.join(self.work, f"rank{rank}.json")
            with open(path + ".tmp", "w") as f:
                json.dump({"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                           "ip": ray.util.get_node_ip_address()}, f)
            os.replace(path + ".tmp", path)
        if rank == 0:
            with open(os.path.join(self.work, "steps"), "a") as f:
                f.write(f"{os.getpid()} {state.global_step}\n")


class FullDiskOnce(TrainerCallback):
    """Rank 0's next checkpoint write fails with ENOSPC once ``WORKDIR/fail-next-save`` appears: the first
    file the save writes through ``torch.save`` (optimizer state, DeepSpeed's engine files) or DCP's
    ``FileSystemWriter`` (FSDP's shards) below a ``checkpoint-<step>`` folder. The narrowest place a full
    disk can be made to happen on one machine; the patch undoes itself when it has fired."""

    def __init__(self, work: str):
        self.trigger = os.path.join(work, "fail-next-save")

    def on_step_begin(self, args, state, control, **kwargs):
        if args.process_index != 0 or not os.path.exists(self.trigger):
            return
        os.replace(self.trigger, self.trigger + ".armed")
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        original_save, original_write = torch.save, FileSystemWriter.write_data

        def fail(where: str) -> None:
            torch.save, FileSystemWriter.write_data = original_save, original_write
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), where)

        def save(obj, f, *a, **kw):
            if isinstance(f, (str, os.PathLike)) and f"{os.sep}checkpoint-" in os.fspath(f):
                fail(os.fspath(f))
            return original_save(obj, f, *a, **kw)

        def write_data(writer, plan, planner):
            fail(str(writer.path))

        torch.save, FileSystemWriter.write_data = save, write_data


def arguments(host: str, out: str, address: str, steps: int) -> dict:
    values = dict(output_dir=out, ray_address=address, num_workers=2, placement_strategy="STRICT_SPREAD",
                  max_failures=-1, max_steps=steps, per_device_train_batch_size=2, learning_rate=1e-3,
                  save_strategy="steps", save_steps=SAVE_STEPS, logging_steps=1, report_to="none",
                  disable_tqdm=True, use_cpu=True, seed=3, log_level="warning", keep_workers_s=KEEP_WORKERS_S)
    if host == "fsdp":
        values.update(fsdp="full_shard auto_wrap",
                      fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"]})
    elif host == "zero3":
        values.update(deepspeed=ZERO3)
    return values


def rows(n: int) -> list[dict]:
    """Counting sequences of the tiny model's words (w7 w8 w9 ...), as text and as token ids."""
    out = []
    for i in range(n):
        start = (i * 7) % 60
        ids = torch.tensor([3 + (start + k) % 60 for k in range(12)])
        out.append({"input_ids": ids, "attention_mask": torch.ones(12, dtype=torch.long), "labels": ids,
                    "text": " ".join(f"w{(start + k) % 60}" for k in range(12))})
    return out


def trainer_for(host: str, work: str, address: str, steps: int):
    out = os.path.join(work, "out")
    values = arguments(host, out, address, steps)
    callbacks = [Record(work), FullDiskOnce(work)]
    model_dir = os.path.join(work, "tiny-model")
    train = rows(2 * 2 * steps)  # one epoch: each step takes new rows
    if host == "trl":
        import datasets

        import raytrainer.trl as trl

        return trl.SFTTrainer(model=model_dir, args=trl.SFTConfig(max_length=16, **values),
                              train_dataset=datasets.Dataset.from_list([{"text": r["text"]} for r in train]),
                              callbacks=callbacks)
    import transformers

    import raytrainer

    tokens = [{k: v for k, v in r.items() if k != "text"} for r in train]
    model = transformers.GPT2LMHeadModel.from_pretrained(model_dir)
    return raytrainer.Trainer(model=model, args=raytrainer.TrainingArguments(**values), train_dataset=tokens,
                              callbacks=callbacks)


def main(address: str, work: str, host: str, steps: int) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    trainer = trainer_for(host, work, address, steps)
    out = trainer.args.output_dir
    last = get_last_checkpoint(out) if os.path.isdir(out) else None
    result = trainer.train(resume_from_checkpoint=True if last else None)
    trainer.save_model(os.path.join(out, "final"))
    print("RESULT " + json.dumps({"global_step": result.global_step}), flush=True)
    trainer.end() if hasattr(trainer, "end") else trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
