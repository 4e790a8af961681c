"""Initialising each rank's shard of a ``model_init`` model (raytrainer/worker/hosted_loading.py
``plain_build``) redoes the modules' own initialisation; weights that ``model_init`` sets another way (a
plain module's ``self.apply(self._init_weights)``, a custom init after a transformers constructor, loaded
weights) are seen while the model is built on the meta device (``meta_model.InPlaceWrites``), and such a
model is built by rank 0 and broadcast instead: on two spawned gloo ranks it trains bit for bit as when
rank 0's way is asked for (``cpu_ram_efficient_loading``)."""

from __future__ import annotations

import functools
import logging
import os

import pytest
import torch
from two_ranks import run_two_ranks

from raytrainer.meta_model import InPlaceWrites, build_on_meta
from raytrainer.strategies.fsdp import initialiser_methods

pytestmark = pytest.mark.timeout(300)


class SmallGPT(torch.nn.Module):
    """nanoGPT's convention: ``__init__`` applies the model's own ``_init_weights`` (N(0, 0.02)), which no
    ``reset_parameters()`` redoes."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 16)
        self.blocks = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(2)))
        self.head = torch.nn.Linear(16, 2)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            torch.nn.init.zeros_(module.bias)

    def forward(self, x, labels=None):
        logits = self.head(torch.tanh(self.blocks(self.embed(x))))
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def _tiny_bert():
    import transformers

    return transformers.BertForSequenceClassification(transformers.BertConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=20, vocab_size=50))


def _bert_with_a_custom_head():
    model = _tiny_bert()
    torch.nn.init.zeros_(model.classifier.weight)
    return model


def _loaded_linear():
    model = torch.nn.Linear(2, 2)
    model.load_state_dict({"weight": torch.ones(2, 2), "bias": torch.ones(2)})
    return model


def _outside(build) -> list[str]:
    writes = InPlaceWrites()
    with writes:
        model = build_on_meta(build)
    return writes.outside(model, initialiser_methods(model))


def test_writes_the_modules_own_initialisation_redoes_are_theirs_and_others_are_named():
    plain = functools.partial(torch.nn.Sequential, torch.nn.Linear(4, 8), torch.nn.LayerNorm(8),
                              torch.nn.Embedding(5, 8))
    assert _outside(lambda: plain()) == []
    assert _outside(_tiny_bert) == []  # transformers' own construction (its _init_weights redoes it)
    assert _outside(SmallGPT) == ["embed.weight", "embed.bias", "blocks.0.weight", "blocks.0.bias",
                                  "blocks.1.weight", "blocks.1.bias", "head.weight", "head.bias"]
    assert _outside(_bert_with_a_custom_head) == ["classifier.weight"]
    assert _outside(_loaded_linear) == ["weight", "bias"]


def _rank(rank0_asked: bool, output_dir: str, rank: int, store: str, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      OMP_NUM_THREADS="1")
    import transformers

    from raytrainer.worker.hosted_sharding import build_trainer

    lines = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("raytrainer.worker.hosted_loading")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    gen = torch.Generator().manual_seed(3)
    rows = [{"x": torch.randn(4, generator=gen), "labels": int(i % 2)} for i in range(32)]
    config = {"fsdp_version": 2, **({"cpu_ram_efficient_loading": True} if rank0_asked else {})}
    args = transformers.TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=4, max_steps=3, logging_steps=1, report_to=[],
        use_cpu=True, disable_tqdm=True, learning_rate=0.1, save_strategy="no", fsdp="full_shard",
        fsdp_config=config)
    kwargs = dict(model_init=SmallGPT, args=args, train_dataset=rows)
    trainer = build_trainer(transformers.Trainer, (), kwargs, args)
    trainer.train()
    state = trainer.accelerator.get_state_dict(trainer.model)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    results.put(dict(rank=rank, lines=lines, losses=losses,
                     weights={k: v.numpy().copy() for k, v in state.items()} if rank == 0 else None))
    torch.distributed.destroy_process_group()


def test_a_model_init_with_its_own_init_is_built_by_rank_0_and_trains_as_rank_0_s_way_asked(tmp_path):
    runs = {}
    for asked in (True, False):
        target = functools.partial(_rank, asked, str(tmp_path / f"out-{asked}"))
        runs[asked] = sorted(run_two_ranks(target, str(tmp_path / f"store-{asked}"), timeout=240),
                             key=lambda r: r["rank"])
    said = [line for line in runs[False][0]["lines"] if "beyond the modules' own initialisation" in line]
    assert said and "embed.weight" in said[0] and "SmallGPT" in said[0], runs[False][0]["lines"]
    assert len(runs[True][0]["losses"]) == 3
    assert runs[False][0]["losses"] == runs[True][0]["losses"]
    for name, value in runs[True][0]["weights"].items():
        assert (runs[False][0]["weights"][name] == value).all(), name
