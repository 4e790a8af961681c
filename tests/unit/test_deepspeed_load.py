"""DeepSpeed's checkpoint loader, run under raytrainer's weights-only loading: its own file types load, a
planted pickle payload is refused and never runs. (A real engine's files, every ZeRO stage, are resumed
through the same path in tests/integration/test_deepspeed.py.)"""

from __future__ import annotations

import os

import pytest
import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from raytrainer.checkpoint import CheckpointError
from raytrainer.strategies.deepspeed_load import weights_only_loads


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_deepspeed_s_own_types_load_and_a_payload_never_runs(tmp_path):
    scaler = DynamicLossScaler(init_scale=2.0**8, scale_window=1000, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False)
    states = {"optimizer_state_dict": {"loss_scaler": scaler,
                                       "zero_stage": ZeroStageEnum.optimizer_states,
                                       "fp32": torch.arange(6.0)},
              "param_slice_mappings": [{"w": fragment_address(numel=6, start=0)}],
              "ds_version": "0.19", "shapes": {"w": torch.Size([2, 3])}}
    good = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save(states, good)
    engine = TorchCheckpointEngine()
    with weights_only_loads():
        loaded = engine.load(str(good), map_location="cpu")
    assert loaded["optimizer_state_dict"]["loss_scaler"].cur_scale == 2.0**8
    assert loaded["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.optimizer_states
    assert torch.equal(loaded["optimizer_state_dict"]["fp32"], torch.arange(6.0))
    assert loaded["param_slice_mappings"][0]["w"].numel == 6

    marker = tmp_path / "payload-ran"
    bad = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "client_state": _Payload(str(marker))}, bad)
    with weights_only_loads(), pytest.raises(CheckpointError, match=r"mp_rank_00_model_states\.pt holds "
                                                                    r"objects other than tensors"):
        engine.load(str(bad), map_location="cpu")
    assert not marker.exists()
    assert torch.load is not None and torch.load.__name__ == "load"  # torch's own loader is back
    engine.load(str(bad), map_location="cpu")  # what DeepSpeed alone does: the payload runs
    assert marker.exists()
    os.remove(marker)
