"""A PEFT model under FSDP2 saves its adapter without gathering the frozen base (saving.peft_state_gathered,
what its checkpoints and ``save_model`` write): the entries PEFT keeps (found by PEFT's own selection),
gathered alone, from which PEFT writes the same adapter files as from the unsharded model. FSDP2 runs here on
a real one-rank gloo group; 2-worker checkpoints and resumes under FSDP and ZeRO-3 are in
tests/integration/test_from_pretrained.py and test_guarantees.py."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

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

    from raytrainer.saving import peft_state_gathered

    model = _peft_model()
    expected = _adapter_file(model, None, tmp_path / "unsharded")
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    spy = _Counting(monkeypatch)
    state = peft_state_gathered(model)

    assert state.keys() == set(peft_saved_keys(model, model.state_dict()))
    assert len(spy.gathered) == len(state)  # one gather per adapter entry, none of the base
    base = sum(p.numel() for n, p in model.named_parameters() if not p.requires_grad)
    assert sum(t.numel() for t in state.values()) < base / 4
    written = _adapter_file(model, state, tmp_path / "sharded")
    assert written.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name
