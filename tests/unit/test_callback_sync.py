"""What rank 0's worker-side callbacks recorded reaches the driver's own instances after a call
(raytrainer.worker.rank.callback_states / absorb_callback_states); the 2-worker run is in
tests/integration/test_warm_workers.py."""

from __future__ import annotations

import threading

import torch

from raytrainer import EarlyStoppingCallback, TrainerCallback
from raytrainer.worker.rank import MAX_CALLBACK_ATTRIBUTE_BYTES, absorb_callback_states, callback_states


class Counter(TrainerCallback):
    def __init__(self, name):
        self.name, self.count = name, 0


class OnDriver(TrainerCallback):
    on_driver = True

    def __init__(self):
        self.seen = 0


def test_worker_callbacks_state_reaches_the_driver_instances_in_order():
    driver = [Counter("first"), OnDriver(), Counter("second"),
              EarlyStoppingCallback(early_stopping_patience=3)]
    worker = [Counter("first"), Counter("second"), EarlyStoppingCallback(early_stopping_patience=3)]
    worker[0].count, worker[1].count, worker[2].early_stopping_patience_counter = 4, 7, 2
    extra = Counter("relay")  # a callback the workers add (raytrainer's relay): no driver instance to update
    states = callback_states([*worker, OnDriver(), extra])
    assert [name for name, _ in states] == ["Counter", "Counter", "EarlyStoppingCallback", "Counter"]

    absorb_callback_states(driver, states)
    assert (driver[0].name, driver[0].count) == ("first", 4)
    assert (driver[2].name, driver[2].count) == ("second", 7)
    assert driver[3].early_stopping_patience_counter == 2
    assert driver[1].seen == 0  # a driver-side callback is the driver's own


def test_what_cannot_or_should_not_travel_stays_on_the_worker():
    cb = Counter("x")
    cb.lock = threading.Lock()  # cannot be pickled
    cb.module = torch.nn.Linear(2, 2)  # weights never go through the channel
    cb.big = b"x" * (MAX_CALLBACK_ATTRIBUTE_BYTES + 1)
    cb.losses = [torch.tensor(1.5), torch.tensor(0.5)]  # small tensors travel
    ((_, attributes),) = callback_states([cb])
    assert set(attributes) == {"name", "count", "losses"}
    assert [float(t) for t in attributes["losses"]] == [1.5, 0.5]


def test_raytrainer_s_rank_side_callbacks_are_not_pickled_back(monkeypatch):
    """The preemption callback holds the rank's session (its strategy, its model): callback_states must not
    pickle it to find out what it weighs."""
    import cloudpickle

    from raytrainer.rank_context import RankContext
    from raytrainer.worker.preemption import PreemptionCallback
    from raytrainer.worker.session import RankSession

    pickled = []
    real = cloudpickle.dumps

    def dumps(obj, *args, **kwargs):  # a spy: cloudpickle still pickles
        pickled.append(obj)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(cloudpickle, "dumps", dumps)
    states = callback_states([PreemptionCallback(RankSession(RankContext())), Counter("kept")])
    assert [name for name, _ in states] == ["Counter"]
    assert pickled == ["kept", 0]  # only the other callback's attributes were pickled
