"""A PEFT model under a sharding strategy saves its adapter without gathering the frozen base: the strategy's
consolidated state holds the entries PEFT keeps (found by PEFT's own selection), gathered alone, and PEFT
writes from it the same adapter files as from the unsharded model. FSDP2 and a ZeRO-3 engine run here on a
real one-rank gloo group; 2-worker checkpoints and resumes of both are in
tests/integration/test_from_pretrained.py."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from raytrainer import TrainingArguments
from raytrainer.rank_context import RankContext
from raytrainer.saving import peft_saved_keys


def _peft_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    model = get_peft_model(LlamaForCausalLM(config),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                      init_lora_weights="gaussian", modules_to_save=["lm_head"]))
    torch.nn.init.normal_(model.base_model.model.lm_head.modules_to_save["default"].weight)  # != the base
    return model


def _adapter_file(model, state, folder) -> dict[str, torch.Tensor]:
    model.save_pretrained(str(folder), state_dict=state, safe_serialization=True)
    return load_file(str(folder / "adapter_model.safetensors"))


def test_peft_s_own_selection_names_the_adapter_entries_of_a_state(tmp_path):
    model = _peft_model()
    state = model.state_dict()
    keys = peft_saved_keys(model, state)
    assert keys and all(".lora_" in k or ".modules_to_save." in k for k in keys), keys
    assert sum(".lora_A." in k for k in keys) == 4 and sum(".modules_to_save." in k for k in keys) == 1
    expected = _adapter_file(model, None, tmp_path / "whole")
    assert _adapter_file(model, {k: state[k] for k in keys}, tmp_path / "selected").keys() == expected.keys()


class _Counting:
    """Counts the DTensors made whole (a spy around DTensor.full_tensor, which still runs)."""

    def __init__(self, monkeypatch):
        from torch.distributed.tensor import DTensor

        self.gathered: list[tuple] = []
        real = DTensor.full_tensor

        def full_tensor(tensor, *args, **kwargs):
            self.gathered.append(tuple(tensor.shape))
            return real(tensor, *args, **kwargs)

        monkeypatch.setattr(DTensor, "full_tensor", full_tensor)


def test_fsdp_gathers_a_peft_model_s_adapter_alone(tmp_path, gloo_group, monkeypatch):
    from torch.distributed.fsdp import fully_shard

    from raytrainer.strategies.fsdp import FSDPStrategy

    model = _peft_model()
    expected = _adapter_file(model, None, tmp_path / "unsharded")
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", fsdp="full_shard",
                             num_workers=1)
    spy = _Counting(monkeypatch)
    state = FSDPStrategy(RankContext(), args).full_state_dict(model)

    assert state.keys() == set(peft_saved_keys(model, model.state_dict()))
    assert len(spy.gathered) == len(state)  # one gather per adapter entry, none of the base
    base = sum(p.numel() for n, p in model.named_parameters() if not p.requires_grad)
    assert sum(t.numel() for t in state.values()) < base / 4
    written = _adapter_file(model, state, tmp_path / "sharded")
    assert written.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name


@pytest.mark.timeout(120)
def test_zero3_gathers_a_peft_model_s_adapter_alone(tmp_path, gloo_group, monkeypatch):
    import deepspeed

    from raytrainer.strategies.deepspeed import _peft_state

    monkeypatch.setenv("LOCAL_RANK", "0")
    model = _peft_model()
    expected = _adapter_file(model, None, tmp_path / "unpartitioned")
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                     if p.requires_grad], config=config)
    gathered: list[int] = []
    real = deepspeed.zero.GatheredParameters

    def spy(params, *args, **kwargs):
        gathered.extend(p.ds_numel for p in params)
        return real(params, *args, **kwargs)

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", spy)
    state = _peft_state(engine.module)

    adapter = sum(p.ds_numel for p in engine.module.parameters() if p.requires_grad)
    assert sum(gathered) == adapter  # the adapters and lm_head's trained copy; no frozen weight
    assert all(p.numel() == 0 for p in engine.module.parameters())  # partitioned again afterwards
    written = _adapter_file(engine.module, state, tmp_path / "partitioned")
    assert written.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name
