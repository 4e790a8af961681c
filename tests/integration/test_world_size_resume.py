"""DDP and FSDP checkpoints resume on another number of workers, both ways (2 -> 1 and 1 -> 2), with the same
global batch: training goes on along the uninterrupted run's loss curve (the weights and optimizer state
carried over; dropout masks differ, another RNG layout). ZeRO's both ways are in test_deepspeed.py."""

from __future__ import annotations

import pytest
from models import DropoutRegressor, make_data
from test_deepspeed import _assert_curve_goes_on
from test_fsdp import _args as _fsdp_args

from raytrainer import Trainer


def _args(out, strategy: str, workers: int, **kw):
    sharding = {} if strategy == "fsdp" else {"fsdp": "", "fsdp_config": None}
    # the same global batch of 8 on 1 or 2 workers: the step sequence is the same
    return _fsdp_args(out, num_workers=workers, per_device_train_batch_size=8 // workers, **sharding, **kw)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_checkpoint_resumes_on_another_number_of_workers_both_ways(tmp_path, strategy):
    data = make_data(48)  # 6 updates per epoch at a global batch of 8, 18 steps in all
    full = Trainer(model=DropoutRegressor(), args=_args(tmp_path / "full", strategy, 2), train_dataset=data)
    assert full.train().global_step == 18

    one = Trainer(model=DropoutRegressor(), args=_args(tmp_path / "one", strategy, 1), train_dataset=data)
    assert one.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-10")).global_step == 18
    _assert_curve_goes_on(one, full, after=10)

    two = Trainer(model=DropoutRegressor(), args=_args(tmp_path / "two", strategy, 2), train_dataset=data)
    assert two.train(resume_from_checkpoint=str(tmp_path / "one" / "checkpoint-15")).global_step == 18
    _assert_curve_goes_on(two, full, after=15)
