"""Each rank of a hosted trainer under FSDP reads only its shards of the pretrained model it trains
(raytrainer/worker/hosted_loading.py): TRL's ``SFTTrainer(model=<path>)`` and transformers' Trainer with a
``model_init`` that calls ``from_pretrained``, on two spawned gloo ranks set up as on Ray workers. Each is
compared with the same trainer built the ordinary way (every rank loads the whole model, ``prepare``
shards it): the same losses and the same trained weights, bitwise."""

from __future__ import annotations

import functools
import logging
import os
import re
import socket
import sys

import numpy as np
import pytest
from two_ranks import run_two_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
from hosted_fixtures import write_tiny_lm

pytestmark = pytest.mark.timeout(300)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


class _FromPretrained:
    def __init__(self, path: str):
        self.path = path

    def __call__(self):
        import transformers

        return transformers.AutoModelForCausalLM.from_pretrained(self.path)


def _checks_its_weights():
    """A Trainer subclass whose constructor loads the model by path and reads a weight's value (which a
    weightless skeleton has not got): every rank builds it again the ordinary way."""
    import transformers

    class ChecksItsWeights(transformers.Trainer):
        def __init__(self, model, **kwargs):
            model = transformers.AutoModelForCausalLM.from_pretrained(model)
            assert float(model.lm_head.weight.abs().sum()) > 0
            super().__init__(model=model, **kwargs)

    return ChecksItsWeights


def _recipe(kind: str, folder: str, output_dir: str):
    """(trainer class, args, kwargs, training arguments) as a hosted rank unpacks them."""
    import torch
    import transformers

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 60, (32, 12), generator=gen).tolist()
    common = dict(output_dir=output_dir, per_device_train_batch_size=2, max_steps=4, logging_steps=1,
                  report_to=[], use_cpu=True, disable_tqdm=True, learning_rate=1e-2, save_strategy="no",
                  fsdp="full_shard auto_wrap", fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"]})
    if kind == "trl":
        import trl

        args = trl.SFTConfig(**common, max_length=12)
        import datasets

        rows = datasets.Dataset.from_list([{"input_ids": row} for row in ids])
        return trl.SFTTrainer, (), dict(model=folder, args=args, train_dataset=rows), args
    args = transformers.TrainingArguments(**common)
    rows = [{"input_ids": row, "labels": row} for row in ids]
    if kind == "reads_weights":
        return _checks_its_weights(), (), dict(model=folder, args=args, train_dataset=rows), args
    return transformers.Trainer, (), dict(model_init=_FromPretrained(folder), args=args,
                                          train_dataset=rows), args


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _rank(kind: str, by_shard: bool, folder: str, output_dir: str, rank: int, port: str, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
    import torch
    from torch.distributed.fsdp import FSDPModule

    from raytrainer.worker.hosted_sharding import build_trainer

    lines = _Lines()
    for name in ("raytrainer.strategies.file_shards", "raytrainer.worker.hosted_loading",
                 "raytrainer.worker.hosted_sharding"):
        logging.getLogger(name).addHandler(lines)
        logging.getLogger(name).setLevel(logging.INFO)
    torch.distributed.init_process_group("gloo")
    cls, args, kwargs, targs = _recipe(kind, folder, output_dir)
    again = (lambda: _recipe(kind, folder, output_dir)[1:3]) if by_shard else None
    trainer = build_trainer(cls, args, kwargs, targs, again=again)
    built_sharded = isinstance(trainer.model, FSDPModule)  # before train(): sharded at construction
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = {k: v.numpy().copy() for k, v in trainer.accelerator.get_state_dict(trainer.model).items()}
    results.put(dict(rank=rank, losses=losses, weights=weights if rank == 0 else None,
                     built_sharded=built_sharded, lines=lines.lines,
                     sharded=isinstance(trainer.model_wrapped, FSDPModule)))


def _run(tmp_path, kind: str, by_shard: bool) -> list[dict]:
    folder = str(tmp_path / "tiny")
    if not os.path.isdir(folder):
        write_tiny_lm(folder, dropout=0.0)
    target = functools.partial(_rank, kind, by_shard, folder, str(tmp_path / f"out-{by_shard}"))
    return sorted(run_two_ranks(target, _free_port(), timeout=240), key=lambda r: r["rank"])


@pytest.mark.parametrize("kind", ["trl", "model_init", "reads_weights"])
def test_under_fsdp_a_hosted_rank_reads_its_shards_where_it_can_and_trains_as_the_whole_load(tmp_path, kind):
    from safetensors.torch import load_file

    whole = _run(tmp_path, kind, by_shard=False)
    shards = _run(tmp_path, kind, by_shard=True)
    saved = load_file(str(tmp_path / "tiny" / "model.safetensors"))
    file_bytes = sum(t.numel() * t.element_size() for t in saved.values())
    for ordinary, r in zip(whole, shards):
        assert r["sharded"] and ordinary["sharded"]
        read = [line for line in r["lines"] if "bytes of this rank's shards" in line]
        if kind == "reads_weights":  # built again, whole, and sharded by prepare as before
            assert not read and not r["built_sharded"], r["lines"]
            assert any("could not be built on a weightless model" in line for line in r["lines"])
            assert any("builds the trainer again" in line for line in r["lines"])
            assert r["losses"] == ordinary["losses"] and len(r["losses"]) == 4
            continue
        assert r["built_sharded"] and not ordinary["built_sharded"]  # sharded before train(), by construction
        assert len(read) == (1 if kind == "trl" else 2), r["lines"]  # model_init: __init__'s and train()'s
        found = re.search(r"read (\d+) bytes .* whole weights: (\d+) bytes", read[0])
        count, total = map(int, found.groups())
        assert total == file_bytes and 0.4 * total < count < 0.6 * total, read  # about half, never the whole
        assert not any("builds the trainer again" in line for line in r["lines"])
        assert len(r["losses"]) == 4 and r["losses"] == ordinary["losses"], (r["losses"], ordinary["losses"])
    for name, value in whole[0]["weights"].items():
        np.testing.assert_array_equal(shards[0]["weights"][name], value, err_msg=name)
