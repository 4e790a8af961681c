"""FSDP for transformers' loop on CPU workers (raytrainer/worker/hosted_sharding.py), on two spawned gloo
ranks set up by accelerate from the environment, as on Ray workers.

The first test pins what the switch relies on: accelerate alone wraps a CPU group given ``fsdp`` in DDP.
When accelerate starts sharding CPU groups itself, it fails, and the switch can go.
"""

from __future__ import annotations

import functools
import os
import socket

import numpy as np
import pytest
from two_ranks import run_two_ranks

pytestmark = pytest.mark.timeout(300)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _trainer(output_dir: str, hosted: bool, fsdp: str = "full_shard auto_wrap", **overrides):
    """transformers' Trainer over a tiny GPT-2 (4 x 64 wide blocks) with ``fsdp``, as a hosted rank builds
    it (``hosted``) or as transformers does."""
    import torch
    import transformers

    from raytrainer.worker.hosted_sharding import build_trainer

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=128, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(1)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (32, 16), generator=gen)]
    args = transformers.TrainingArguments(
        output_dir, per_device_train_batch_size=2, max_steps=4, save_steps=2, logging_steps=1, report_to=[],
        use_cpu=True, disable_tqdm=True, learning_rate=1e-3, fsdp=fsdp,
        fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"]} if fsdp else None, **overrides)
    kwargs = dict(model=model, args=args, train_dataset=rows)
    return build_trainer(transformers.Trainer, (), kwargs, args) if hosted else transformers.Trainer(**kwargs)


def _rank(hosted: bool, output_dir: str, rank: int, port: str, results, fsdp: str = "full_shard auto_wrap"):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
    from torch.distributed.fsdp import FSDPModule

    trainer = _trainer(output_dir, hosted, fsdp)
    trainer.train()
    params = list(trainer.model.parameters())
    held = sum(getattr(p, "_local_tensor", p).numel() for p in params)  # this rank's share
    whole = sum(p.numel() for p in params)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = {k: v.numpy().copy() for k, v in trainer.accelerator.get_state_dict(trainer.model).items()}
    out = dict(rank=rank, type=trainer.accelerator.distributed_type.name, fsdp=trainer.is_fsdp_enabled,
               sharded=isinstance(trainer.model_wrapped, FSDPModule), held=held, whole=whole, losses=losses,
               weights=weights if rank == 0 else None,
               bucket_view=getattr(trainer.model_wrapped, "gradient_as_bucket_view", None))
    if hosted and not fsdp:  # one more backward: DDP leaves each gradient in its all-reduce bucket
        batch = {k: v[:2] for k, v in trainer.data_collator(trainer.train_dataset[:2]).items()}
        trainer.model_wrapped(**batch).loss.backward()
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        out["grads"], out["grad_storages"] = len(grads), len({g.untyped_storage().data_ptr() for g in grads})
        out["params"] = len(list(trainer.model.parameters()))
    elif hosted:  # the checkpoint of step 2, resumed by a new trainer: the same last two steps
        again = _trainer(output_dir + "-resumed", hosted)
        again.train(resume_from_checkpoint=os.path.join(output_dir, "checkpoint-2"))
        resumed = again.accelerator.get_state_dict(again.model)
        out["resumed_losses"] = [h["loss"] for h in again.state.log_history if "loss" in h]
        out["resumed_equal"] = rank != 0 or all((resumed[k].numpy() == weights[k]).all() for k in weights)
        out["files"] = sorted(os.listdir(os.path.join(output_dir, "checkpoint-2")))
    results.put(out)


def _run(tmp_path, hosted: bool, **kwargs) -> list[dict]:
    results = run_two_ranks(functools.partial(_rank, hosted, str(tmp_path / "out"), **kwargs), _free_port())
    return sorted(results, key=lambda r: r["rank"])


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ddp"), hosted=False)


def test_accelerate_alone_wraps_a_cpu_group_given_fsdp_in_ddp(unsharded):
    for r in unsharded:
        assert (r["type"], r["fsdp"], r["sharded"]) == ("MULTI_CPU", False, False)
        assert r["held"] == r["whole"]  # every rank holds the whole model


def test_a_hosted_cpu_group_given_fsdp_shards_trains_the_same_and_resumes(tmp_path, unsharded):
    sharded = _run(tmp_path, hosted=True)
    for r in sharded:
        assert (r["type"], r["fsdp"], r["sharded"]) == ("FSDP", True, True)
        assert r["whole"] == unsharded[0]["whole"]
        assert r["held"] <= r["whole"] // 2 + 256  # its half (FSDP2 pads each dim-0 split to equal shards)
        assert r["losses"] == pytest.approx(unsharded[0]["losses"], rel=1e-5)
        assert len(r["losses"]) == 4
    assert sharded[0]["held"] + sharded[1]["held"] >= sharded[0]["whole"]
    for name, value in unsharded[0]["weights"].items():  # the same training as DDP's, to float rounding
        np.testing.assert_allclose(sharded[0]["weights"][name], value, rtol=1e-4, atol=1e-5)
    # transformers' FSDP checkpoint (accelerate's files), resumed at step 2: the same last two steps, bitwise
    assert {"pytorch_model_fsdp.bin", "optimizer.bin", "trainer_state.json"} <= set(sharded[0]["files"])
    for r in sharded:
        assert r["resumed_losses"] == sharded[0]["losses"]  # steps 1-2 from the checkpoint's state, 3-4 again
        assert r["resumed_equal"]


def test_a_hosted_ddp_rank_keeps_gradients_in_its_buckets_and_trains_bit_for_bit(tmp_path, unsharded):
    """``gradients_in_the_buckets``: DDP's gradients are views of its all-reduce buckets (one copy of them
    per rank, not two) and the training is transformers' own DDP run's, bit for bit (``unsharded``: the
    same arguments but ``fsdp``, which accelerate ignores on a CPU group)."""
    ddp = _run(tmp_path, hosted=True, fsdp="")
    assert [r["bucket_view"] for r in unsharded] == [False, False]  # transformers' own: a copy of each
    for r in ddp:
        assert (r["type"], r["bucket_view"]) == ("MULTI_CPU", True)
        assert r["grads"] == r["params"] == 52 and r["grad_storages"] < 5  # in a few buckets (25 MB each)
        assert r["losses"] == unsharded[0]["losses"]
    for name, value in unsharded[0]["weights"].items():
        np.testing.assert_array_equal(ddp[0]["weights"][name], value)


def test_an_encoder_decoders_tied_embeddings_become_its_input_embedding_module():
    """``share_tied_embedding``: T5's ``encoder.embed_tokens`` and ``decoder.embed_tokens`` (their own
    modules in transformers 5, tied to ``shared`` by weight) become ``shared`` itself, so accelerate's FSDP2
    unit of the input embedding holds every use of the weight; the outputs and the state dict's names stay.
    A GPT-2's ``lm_head`` (a Linear tied to the embedding) is left as it is."""
    import torch
    import transformers

    from raytrainer.worker.hosted_sharding import share_tied_embedding

    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=24, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                   decoder_start_token_id=0)
    t5 = transformers.T5ForConditionalGeneration(config).eval()
    assert t5.encoder.embed_tokens is not t5.shared and t5.encoder.embed_tokens.weight is t5.shared.weight
    names, ids = list(t5.state_dict()), torch.randint(1, 24, (2, 5))
    before = t5(input_ids=ids, decoder_input_ids=ids).logits
    share_tied_embedding(t5)
    assert t5.encoder.embed_tokens is t5.shared and t5.decoder.embed_tokens is t5.shared
    assert list(t5.state_dict()) == names
    assert torch.equal(t5(input_ids=ids, decoder_input_ids=ids).logits, before)

    gpt2_config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=24)
    gpt2 = transformers.GPT2LMHeadModel(gpt2_config)
    head = gpt2.lm_head
    share_tied_embedding(gpt2)
    assert gpt2.lm_head is head and gpt2.lm_head.weight is gpt2.transformer.wte.weight


def test_a_module_inside_a_unit_stays_there_where_accelerate_shards_it_again(gloo_group):
    """accelerate 1.16's ``fsdp2_prepare_model`` shards each ``_no_split_modules`` block (BERT's include
    ``BertEmbeddings``) and then ``fully_shard``s the input embedding, which torch refuses inside a unit.
    Under ``not_twice`` the embedding stays in its block's unit, the root (every parameter in a unit below
    it) is still sharded, and the model computes what the unsharded one does."""
    import inspect

    import accelerate.utils.fsdp_utils as fsdp_utils
    import torch
    import transformers
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from raytrainer.worker.hosted_loading import not_twice

    prepare = inspect.getsource(fsdp_utils.fsdp2_prepare_model)
    assert "from torch.distributed.fsdp import" in prepare and "fully_shard(input_embed" in prepare

    def bert():
        torch.manual_seed(0)
        config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=64, num_labels=3,
                                         max_position_embeddings=32, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)
        return transformers.BertForSequenceClassification(config)

    ids = torch.randint(1, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = bert()(input_ids=ids).logits
    refused = bert()
    fully_shard(refused.bert.embeddings)
    with pytest.raises(TypeError, match="Invariant encountered"):  # torch's own, without raytrainer's guard
        fully_shard(refused.get_input_embeddings())

    model = bert()
    with not_twice():
        import torch.distributed.fsdp as fsdp

        blocks = [model.bert.embeddings, *model.bert.encoder.layer]
        for block in blocks:
            fsdp.fully_shard(block)
        assert fsdp.fully_shard(model.get_input_embeddings()) is model.get_input_embeddings()
        assert fsdp.fully_shard([model.get_input_embeddings()]) is None
        fsdp.fully_shard(model)
    assert not isinstance(model.get_input_embeddings(), FSDPModule)
    assert all(isinstance(m, FSDPModule) for m in (*blocks, model))
    assert torch.allclose(model(input_ids=ids).logits, expected, atol=1e-6)

    # tensor parallelism's DTensors, which no unit holds yet, are still sharded (FSDP x TP meshes)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    tp = parallelize_module(torch.nn.Linear(4, 4), mesh["tp"], ColwiseParallel())
    assert isinstance(tp.weight, DTensor)
    with not_twice():
        fsdp.fully_shard(tp, mesh=mesh["dp_shard"])
    assert isinstance(tp, FSDPModule)
