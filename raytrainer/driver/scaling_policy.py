"""The scaling policies raytrainer gives Ray Train's controller in place of its own.

**A fixed group on the local instance raytrainer starts** (``FixedWithoutAutoscaler``): Ray Train's
``FixedScalingPolicy`` without its resource requests. Ray Train sends them, at the start and every few
seconds, to an autoscaling coordinator actor it starts once per Ray instance (a process of ~120 MiB PSS),
which hands them to the cluster's autoscaler; a local instance has none.

**An elastic run** (``GrowAtCheckpoints``): Ray Train's own (``ElasticScalingPolicy``), except that a group
grows only at a checkpoint boundary.

Ray Train's policy, in its controller, checks the cluster every ``elastic_resize_monitor_interval_s`` and
restarts a running group bigger as soon as more workers fit: the steps since the last checkpoint would be
trained again. Here, when more workers fit and a ``train`` call is in flight, the policy asks the ranks for
a checkpoint first (through the group's channel actor: rank 0 polls it at the preemption check's cadence,
worker/preemption.py); the ranks agree on the step, commit the checkpoint and wait; then the policy
restarts the group at the bigger size, which resumes from that checkpoint: no step is trained twice. A
group between calls grows at once. Shrinking is Ray Train's: a lost node's worker fails, the group restarts
on what is left (within ``max_failures``).

Both are built on the driver and pickled to the controller actor, where they run; the elastic one holds the
channel's actor handle and asks it one short question per check while a growth is pending.
"""

from __future__ import annotations

import logging

import ray
from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision
from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy
from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy

logger = logging.getLogger(__name__)


class FixedWithoutAutoscaler(FixedScalingPolicy):
    def after_controller_start(self, train_run_context):
        self._requester_id = f"train-{train_run_context.run_id}"  # no coordinator client: nothing to cancel

    def _maybe_send_resource_request(self):
        pass

    def _send_resource_request(self):
        pass


class GrowAtCheckpoints(ElasticScalingPolicy):
    def __init__(self, scaling_config, channel):
        super().__init__(scaling_config)
        self.channel = channel  # the group's channel actor

    def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
        decision = super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)
        if not isinstance(decision, ResizeDecision) or decision.num_workers <= worker_group_state.num_workers:
            return decision
        try:
            ready = ray.get(self.channel.grow_when_ready.remote(), timeout=10)
        except Exception as exc:  # the channel is gone or slow: no growth this time
            logger.warning("could not ask the run's channel whether the group may grow: %s", exc)
            ready = False
        if ready:
            return decision
        self._latest_monitor_time = float("-inf")  # check again at the controller's next poll
        return NoopDecision()
