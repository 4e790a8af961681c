"""``raytrainer consolidate``: DCP shards (FSDP's layout) into safetensors files that from_pretrained loads,
one output file's tensors in memory at a time; a folder without a sharded model is refused, naming what it
holds. (2 FSDP workers' real shards are consolidated in tests/integration/test_fsdp.py.)"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from raytrainer.cli import main
from raytrainer.consolidate import consolidate


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))


def test_dcp_shards_become_safetensors_with_an_index_that_from_pretrained_loads(tmp_path, capsys):
    from transformers import GPT2LMHeadModel

    model = _gpt2()
    folder = tmp_path / "final-model"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder), no_dist=True)
    model.config.save_pretrained(folder)  # what from_pretrained reads beside the weights
    out = tmp_path / "consolidated"

    assert main(["consolidate", str(folder), str(out), "--max-shard-size", "20KB"]) == 0
    printed = capsys.readouterr().out.split()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all(f.startswith("model-0000") for f in files)
    assert sorted(os.path.basename(p) for p in printed) == sorted([*files, "model.safetensors.index.json"])
    on_disk = {}
    for name in files:
        part = load_file(out / name)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 20_000 or len(part) == 1
        on_disk.update(part)
    expected = model.state_dict()
    assert set(on_disk) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(on_disk[key], tensor), key
    loaded = GPT2LMHeadModel.from_pretrained(out)
    for key, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[key]), key

    # one file when it fits: model.safetensors, no index; written into the folder itself by default
    assert consolidate(str(folder)) == ["model.safetensors"]
    assert not (folder / "model.safetensors.index.json").exists()
    single = load_file(folder / "model.safetensors")
    assert all(torch.equal(single[k], v) for k, v in expected.items())


def test_a_folder_without_a_sharded_model_is_refused_naming_what_it_holds(tmp_path, capsys):
    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    save_file({"w": torch.zeros(2)}, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"holds no sharded model .*it holds model.safetensors \(already "
                                         r"consolidated\)"):
        consolidate(str(folder))
    assert main(["consolidate", str(folder)]) == 2
    assert "raytrainer: error: consolidate" in capsys.readouterr().err
    with pytest.raises(ValueError, match="give an output folder"):
        consolidate("s3://bucket/run/checkpoint-4")
