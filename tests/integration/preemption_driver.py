"""Driver script for test_preemption_multinode.py: a 2-worker run (one worker per node) on an existing local
multi-node Ray cluster, slow enough for the test to drain a node mid-run.

    python preemption_driver.py ADDRESS WORKDIR MAX_FAILURES

Every rank writes ``WORKDIR/rank<r>.json`` (its node's id and IP) at its first step; rank 0 appends each
step it finishes, with the worker group's attempt, to ``WORKDIR/steps`` (a step written twice was redone
after a restart). With ``MAX_FAILURES`` 0, a restart after a preemption must not count as a failure.
Prints ``RESULT <json>`` at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time

import cloudpickle
import multinode_driver
from multinode_driver import Regressor, make_data

from raytrainer import Trainer, TrainerCallback, TrainingArguments

cloudpickle.register_pickle_by_value(multinode_driver)  # the workers' nodes do not have this folder

STEPS = 60
STEP_S = 0.25  # each step sleeps this long, so the run outlasts a drain, its notice and a restart


class Record(TrainerCallback):
    def __init__(self, work: str):
        self.work = work
        self.rank = None

    def on_step_end(self, args, state, control, **kwargs):
        import ray
        import ray.train

        time.sleep(STEP_S)
        rank = args.process_index
        if self.rank is None:  # the first step of this attempt
            self.rank = rank
            with open(os.path.join(self.work, f"rank{rank}.json"), "w") as f:
                json.dump({"node_id": ray.get_runtime_context().get_node_id(),
                           "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}, f)
        if rank == 0:
            with open(os.path.join(self.work, "steps"), "a") as f:
                f.write(f"{os.getpid()} {state.global_step}\n")


def main(address: str, work: str, max_failures: int) -> None:
    args = TrainingArguments(
        output_dir=os.path.join(work, "out"), ray_address=address, num_workers=2,
        placement_strategy="STRICT_SPREAD", max_failures=max_failures, max_steps=STEPS,
        per_device_train_batch_size=4,
        save_strategy="steps", save_steps=1000, logging_steps=5, report_to="none", disable_tqdm=True, seed=3)
    trainer = Trainer(model=Regressor(), args=args, train_dataset=make_data(512), callbacks=[Record(work)])
    out = trainer.train()
    from raytrainer.driver.ray_runtime import serves_state_api

    print("RESULT " + json.dumps({"global_step": out.global_step, "state_api": serves_state_api(),
                                  "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}),
          flush=True)
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
