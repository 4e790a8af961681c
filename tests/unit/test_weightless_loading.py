"""meta_model.weightless_loading: the skeleton a rank that receives rank 0's weights builds from a model_init
that calls ``from_pretrained`` (FSDP's rank-0 way), in one process: the same parameters as the real load
(names, shapes, dtypes as saved, tied weights, buffers, PEFT's adapters), none of them holding storage, and
transformers left as it was afterwards."""

from __future__ import annotations

import pytest
import torch
import transformers.core_model_loading as loading
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from raytrainer.meta_model import is_skeleton, weightless_loading


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(folder))  # dtype="auto" reads bf16
    return str(folder)


def _layout(model):
    return ([(n, p.shape, p.dtype, p.requires_grad) for n, p in model.named_parameters()],
            [(n, b.shape, b.dtype) for n, b in model.named_buffers()])


def test_from_pretrained_builds_the_real_load_s_skeleton(saved):
    with pytest.raises(RuntimeError, match="meta device context manager"), torch.device("meta"):
        AutoModelForCausalLM.from_pretrained(saved)  # what a bare meta context gives
    before = vars(PreTrainedModel)["from_pretrained"], loading._materialize_copy
    with weightless_loading():
        skeleton = AutoModelForCausalLM.from_pretrained(saved, device_map="cpu")  # overridden: meta
    real = AutoModelForCausalLM.from_pretrained(saved)
    assert is_skeleton(skeleton) and all(b.is_meta for b in skeleton.buffers())
    assert _layout(skeleton) == _layout(real)
    assert {p.dtype for p in skeleton.parameters()} == {torch.bfloat16}
    assert skeleton.lm_head.weight is skeleton.model.embed_tokens.weight  # tied, as in the real load
    # transformers is as it was: a real load after the context reads the weights
    assert (vars(PreTrainedModel)["from_pretrained"], loading._materialize_copy) == before
    assert not any(p.is_meta for p in AutoModelForCausalLM.from_pretrained(saved).parameters())


def test_peft_adapters_on_the_skeleton(saved):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    with weightless_loading():
        skeleton = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(saved), lora)
    real = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(saved), lora)
    assert is_skeleton(skeleton)
    assert _layout(skeleton) == _layout(real)
