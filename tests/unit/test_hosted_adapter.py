"""A PEFT model's checkpoint under FSDP holds its adapter once (raytrainer/worker/hosted_adapter.py): every
rank resumes from PEFT's ``adapter_model.safetensors``. FSDP2 runs here on a real one-rank gloo group; the
2-worker checkpoints and resumes are tests/integration/test_from_pretrained.py and test_guarantees.py.

Pinned against transformers: where these tests fail, transformers changed how it saves or loads FSDP's
model files, and hosted_adapter.py must follow."""

from __future__ import annotations

import inspect

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

pytestmark = pytest.mark.timeout(120)


def _peft_model(seed: int):
    torch.manual_seed(0)  # the same base for every seed
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    base = LlamaForCausalLM(config)
    torch.manual_seed(seed)  # the adapter's own numbers
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights="gaussian", modules_to_save=["lm_head"]))
    torch.nn.init.normal_(model.base_model.model.lm_head.modules_to_save["default"].weight)
    return model


def test_an_adapter_file_loads_into_a_sharded_peft_model_on_every_rank(tmp_path, gloo_group):
    """PEFT's file of one model loaded into another under FSDP2: its adapter and ``modules_to_save`` equal the
    saved one's, its frozen base is left as it was."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from raytrainer.worker.hosted_adapter import load_adapter

    saved = _peft_model(seed=1)
    saved.save_pretrained(str(tmp_path), safe_serialization=True)
    model = _peft_model(seed=2)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)

    load_adapter(model, str(tmp_path))

    expected = saved.state_dict()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sum(".lora_A." in n for n in trainable) == 4 and any(".modules_to_save." in n for n in trainable)
    for name, param in model.named_parameters():
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        wanted = expected[name] if param.requires_grad else base_before[name]
        assert torch.equal(whole.detach(), wanted), name


def test_an_adapter_file_of_another_model_is_refused_with_what_to_do(tmp_path, gloo_group):
    from safetensors.torch import save_file

    from raytrainer.worker.hosted_adapter import load_adapter

    save_file({"base_model.model.other.lora_A.weight": torch.zeros(2, 2)},
              str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="resume it with the model and LoRA configuration that saved it"):
        load_adapter(_peft_model(seed=1), str(tmp_path))


def test_transformers_saves_and_loads_fsdp_model_files_through_its_module_functions():
    """What hosted_adapter.py relies on: under FSDP, ``_save_optimizer_and_scheduler`` calls
    ``transformers.trainer.save_fsdp_model`` (a module name, looked up when called) after ``save_model``
    wrote the model (PEFT's files under ``FULL_STATE_DICT``); ``_load_from_checkpoint`` reads FSDP's files
    only when the folder holds them, else a PEFT model's adapter; ``_load_best_model`` always calls
    ``load_fsdp_model`` under FSDP."""
    import transformers.trainer as hf_trainer

    trainer = hf_trainer.Trainer
    assert "save_fsdp_model(" in inspect.getsource(trainer._save_optimizer_and_scheduler)
    checkpoint = inspect.getsource(trainer._save_checkpoint)
    assert checkpoint.index("self.save_model(") < checkpoint.index("self._save_optimizer_and_scheduler(")
    load = inspect.getsource(trainer._load_from_checkpoint)
    assert "is_fsdp_ckpt" in load and "model.load_adapter(" in load
    assert "load_fsdp_model(" in inspect.getsource(trainer._load_best_model)
    assert callable(hf_trainer.save_fsdp_model) and callable(hf_trainer.load_fsdp_model)
