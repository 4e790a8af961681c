"""Driver script for test_multinode.py: trains on an existing (local multi-node) Ray cluster.

    python multinode_driver.py ADDRESS WORKDIR

Run 1 (log_on_each_node=True, save_on_each_node=True, report_to tensorboard, pushes to a file:// hub with
a hub token); run 2 (log_on_each_node=False); run 3 (HSDP on 4 workers: parallelism_config); run 4 saves,
evaluates and fails on rank 1 (the user's callback raises). Every rank
logs one INFO line naming its ranks; log_level is info for main processes and warning for replicas, so
which lines reach this driver's output shows the log_on_each_node behaviour. Prints ``RESULT <json>`` at
the end.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch

from raytrainer import Trainer, TrainerCallback, TrainingArguments

TOKEN = "hf_multinode_secret_7c1d"


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    def forward(self, x, labels=None):
        logits = self.net(x)
        if labels is None:
            return (logits,)
        return torch.nn.functional.cross_entropy(logits, labels), logits


def make_data(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return [{"x": x[i], "labels": int(y[i])} for i in range(n)]


class RankReport(TrainerCallback):
    """On every rank: one INFO log line and a JSON file with the rank's place in the cluster."""

    def __init__(self, out_dir: str, tag: str):
        self.out_dir, self.tag = out_dir, tag

    def on_train_begin(self, args, state, control, **kwargs):
        import ray
        import ray.train

        ctx = ray.train.get_context()
        info = {"rank": ctx.get_world_rank(), "local_rank": ctx.get_local_rank(),
                "node_rank": ctx.get_node_rank(), "ip": ray.util.get_node_ip_address()}
        logging.getLogger("multinode").info("RANKINFO %s %s", self.tag, json.dumps(info, sort_keys=True))
        with open(os.path.join(self.out_dir, f"{self.tag}-rank{info['rank']}.json"), "w") as f:
            json.dump(info, f)


class MeshReport(TrainerCallback):
    """On every rank of a ``parallelism_config`` run: the ranks of its dp_replicate and dp_shard groups, read
    from the mesh its parameters are sharded over, and the node of every rank, in a JSON file."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        import ray
        import torch.distributed as dist

        mesh = next(model.parameters()).device_mesh
        ips = [None] * dist.get_world_size()
        dist.all_gather_object(ips, ray.util.get_node_ip_address())
        info = {"rank": dist.get_rank(), "dims": list(mesh.mesh_dim_names), "ips": ips,
                **{dim: dist.get_process_group_ranks(mesh.get_group(dim)) for dim in mesh.mesh_dim_names}}
        with open(os.path.join(self.out_dir, f"mesh-rank{info['rank']}.json"), "w") as f:
            json.dump(info, f)


class FailOnRank1(TrainerCallback):
    """The user's code failing on a worker: ``ValueError`` on rank 1 as step 3 ends."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3 and args.process_index == 1:
            raise ValueError("the user's callback failed on rank 1 at step 3")


def run(address: str, work: str, tag: str, extra_callbacks=(), **overrides) -> Trainer:
    values = {"num_workers": 2, "placement_strategy": "STRICT_SPREAD", "max_steps": 6,
              "per_device_train_batch_size": 8, "learning_rate": 0.05, "logging_steps": 2,
              "save_strategy": "steps", "save_steps": 6, "log_level": "info", "log_level_replica": "warning",
              "disable_tqdm": True}
    values.update(overrides)
    args = TrainingArguments(output_dir=os.path.join(work, tag), ray_address=address, **values)
    callbacks = [RankReport(work, tag)] + ([MeshReport(work)] if args.parallelism_config is not None else [])
    trainer = Trainer(model=Regressor(), args=args, train_dataset=make_data(96), eval_dataset=make_data(16),
                      callbacks=callbacks + list(extra_callbacks))
    trainer.train()
    return trainer


def main() -> None:
    address, work = sys.argv[1], sys.argv[2]
    os.environ["TENSORBOARD_LOGGING_DIR"] = os.path.join(work, "tb")  # transformers 5's setting
    first = run(address, work, "each-node", log_on_each_node=True, save_on_each_node=True,
                report_to="tensorboard", push_to_hub=True,
                hub_model_id=f"file://{work}/hub", hub_strategy="every_save", hub_token=TOKEN)
    run(address, work, "main-only", log_on_each_node=False)
    # HSDP over both nodes' 4 workers (2 each): replicas across the nodes, shards within one
    run(address, work, "hsdp", num_workers=4, placement_strategy="PACK", per_device_train_batch_size=4,
        parallelism_config={"dp_replicate_size": 2, "dp_shard_size": 2})
    # saves, evaluates, then the user's code fails on rank 1: raised here, the console says it once
    try:
        run(address, work, "fails", save_steps=2, eval_strategy="steps", eval_steps=2, log_level="passive",
            extra_callbacks=[FailOnRank1()])
        failed = None
    except ValueError as exc:
        failed = str(exc)
    from safetensors.torch import load_file

    pushed = load_file(os.path.join(work, "hub", "main", "model.safetensors"))
    same = all(torch.equal(pushed[k], v) for k, v in first.model.state_dict().items())
    losses = [e["loss"] for e in first.state.log_history if "loss" in e]
    from raytrainer.driver.ray_runtime import serves_state_api

    print("RESULT " + json.dumps({"global_step": first.state.global_step, "pushed_is_final": same,
                                  "logged_losses": losses, "state_api": serves_state_api(),
                                  "failed": failed}), flush=True)


if __name__ == "__main__":
    main()
