"""The chaos run (bench/chaos.py): one 2-worker run on a local 3-node Ray cluster of its own takes 20 faults
at random steps from a seed -- a worker SIGKILLed, a node's raylet SIGKILLed, a node drained for
preemption, a SIGTERM to every process of a node, a checkpoint write that fails as a full disk does, the
driver SIGKILLed (the last two: the script run again) -- and ends as an uninterrupted run of the same
script on the same cluster does: the same final weights bit for bit, every checkpoint of the save
schedule committed and whole, and nothing of the run left (actors, placement groups, processes, temporary
files). For raytrainer's Trainer under DDP, FSDP and ZeRO-3, and for TRL's SFTTrainer. About a quarter of
an hour each on 2 cores: the full tier."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import chaos

FAULTS = 20


@pytest.fixture
def _integration():  # overrides the conftest's: the run has a cluster of its own, not the session's instance
    yield


@pytest.mark.timeout(3000)
@pytest.mark.parametrize("host", ["ddp", "fsdp", "zero3", "trl"])
def test_twenty_faults_in_one_run_end_with_the_uninterrupted_weights_and_leave_nothing(host):
    result = chaos.chaos(host, FAULTS, seed=0, ip_start=40, port_base=13000)
    print(chaos.table(result))
    assert chaos.problems(result) == []
    faults = result["faults"]
    assert len(faults) == FAULTS and {f["kind"] for f in faults} == set(chaos.KINDS)
    # every fault was followed by a new worker group that resumed from a committed checkpoint no later than
    # the last step the group it struck finished (a drained node's: the step the ranks agreed on after notice)
    for f in faults:
        assert f["resumed_at"] in result["checkpoints"] and f["resumed_at"] <= f["last"], f
    kills = sum(f["kind"] in ("kill-driver", "storage-full") for f in faults)
    assert result["launches"] == 1 + kills
