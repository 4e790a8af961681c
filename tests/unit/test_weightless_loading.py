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


def test_sources_name_the_file_and_key_of_each_weight_set_from_one_tensor(saved):
    """What FSDP's ranks read their shards by: every parameter of a plain load has the safetensors file and
    key it came from (the tied head, the embedding's), the rotary buffer (computed, not in the file) none;
    what model_init adds after the load (LoRA adapters, a resized embedding) none either; and reading a
    slice by a FileSlice gives exactly the saved tensor's rows."""
    import os

    from safetensors import safe_open
    from safetensors.torch import load_file

    from raytrainer.meta_model import FileSlice, sources_by_name

    before = vars(PreTrainedModel)["from_pretrained"], loading._materialize_copy, loading.set_param_for_module
    sources: dict = {}
    with weightless_loading(sources):
        skeleton = AutoModelForCausalLM.from_pretrained(saved)
    files = sources_by_name(skeleton, sources)
    weights = os.path.join(saved, "model.safetensors")
    stored = load_file(weights)
    params = dict(skeleton.named_parameters())
    assert sorted(files) == sorted(params)  # buffers: none from the file
    assert all(f == FileSlice(weights, n, tuple(params[n].shape)) for n, f in files.items()), files
    assert set(files) <= set(stored) and "lm_head.weight" not in params  # tied: stored and named once
    with safe_open(weights, framework="pt") as f:
        rows = f.get_slice(files["model.embed_tokens.weight"].key)[16:32]
    assert torch.equal(rows, stored["model.embed_tokens.weight"][16:32])
    assert (vars(PreTrainedModel)["from_pretrained"], loading._materialize_copy,
            loading.set_param_for_module) == before

    sources = {}
    with weightless_loading(sources):
        resized = AutoModelForCausalLM.from_pretrained(saved)
        resized.resize_token_embeddings(48, mean_resizing=False)
    files = sources_by_name(resized, sources)
    assert "model.embed_tokens.weight" not in files and "model.norm.weight" in files

    peft = pytest.importorskip("peft")
    sources = {}
    with weightless_loading(sources):
        adapted = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(saved),
                                      peft.LoraConfig(r=4, target_modules=["q_proj"]))
    files = sources_by_name(adapted, sources)
    missing = sorted(n for n, _ in adapted.named_parameters() if n not in files)
    assert missing and all(".lora_" in n for n in missing), missing
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in files


def test_sources_of_a_sharded_checkpoint_name_each_weight_s_own_file(saved, tmp_path):
    """A checkpoint saved in several safetensors files with an index: each weight's FileSlice names the file
    the index puts it in."""
    import json
    import os

    from raytrainer.meta_model import sources_by_name

    AutoModelForCausalLM.from_pretrained(saved).save_pretrained(str(tmp_path), max_shard_size="8KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2
    sources: dict = {}
    with weightless_loading(sources):
        skeleton = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    files = sources_by_name(skeleton, sources)
    assert sorted(files) == sorted(n for n, _ in skeleton.named_parameters())
    assert {n: os.path.basename(f.path) for n, f in files.items()} == {n: index[n] for n in files}


@pytest.mark.parametrize("lora", [None, True, "gaussian", "dora"])
def test_a_skeleton_filled_from_the_files_is_the_real_load(saved, lora):
    """FSDP's per-rank path in one process, unsharded: the skeleton allocated (``to_empty``) and filled by
    ``file_shards.files_initialiser`` equals a real ``from_pretrained`` (+ ``get_peft_model``): the weights
    read from the files, the rotary buffer from transformers' initialisation, LoRA's B zero and A drawn by
    PEFT's own initialisation. DoRA's magnitudes come from the base weights: refused (None), so the
    rank-0 way builds it for real."""
    from raytrainer.meta_model import sources_by_name
    from raytrainer.strategies.file_shards import files_initialiser
    from raytrainer.strategies.fsdp import model_initialiser

    def build():
        model = AutoModelForCausalLM.from_pretrained(saved)
        if lora is not None:
            peft = pytest.importorskip("peft")
            init = {"init_lora_weights": lora} if lora != "dora" else {"use_dora": True}
            config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **init)
            model = peft.get_peft_model(model, config)
        return model

    sources: dict = {}
    with weightless_loading(sources):
        skeleton = build()
    initialise = files_initialiser(skeleton, sources_by_name(skeleton, sources), model_initialiser(skeleton))
    if lora == "dora":
        assert initialise is None
        return
    # swapped in place, so tied weights stay one tensor (meta -> cpu would otherwise make a new Parameter
    # per module; under FSDP the DTensors keep their identity)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        skeleton.to_empty(device="cpu")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    with torch.no_grad():
        initialise()
    real = build()
    got, want = skeleton.state_dict(), real.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        if ".lora_A." in name:
            assert value.shape == got[name].shape and got[name].abs().max() > 0, name  # drawn, per rank
        else:
            assert torch.equal(got[name], value), name  # from the files, B zero, the rotary table
    assert dict(skeleton.named_buffers()).keys() == dict(real.named_buffers()).keys()
    for name, buffer in real.named_buffers():
        assert torch.equal(dict(skeleton.named_buffers())[name], buffer), name
