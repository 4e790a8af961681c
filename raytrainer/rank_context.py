"""Where this process stands in the run (rank, node, device) and the few collectives the loop needs.

With one process every collective is the identity, so the same loop runs in the driver's own process
(``num_workers=0``) and on Ray Train workers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


@dataclass
class RankContext:
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    on_ray: bool = False  # a Ray Train worker (dataset shards come from ray.train)
    ray_run_root: str | None = None  # the Ray Train run's folder: checkpoints under it are reported to Ray
    #: consecutive ranks that read the same batch: one tensor (x context) parallel group of a
    #: ``parallelism_config`` mesh, whose data-parallel dimensions are the outer ones (parallelism.py)
    model_parallel: int = 1

    def reports_to_ray(self, path: str) -> bool:
        """Whether a checkpoint at ``path`` (a path on the run's filesystem) is reported to Ray Train, which
        takes only checkpoints inside its run folder -- a search trial on a pooled worker group writes in a
        run folder of its own, inside the search's."""
        return self.on_ray and self.ray_run_root is not None and path.startswith(self.ray_run_root + "/")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many different batches each step reads."""
        return self.world_size // self.model_parallel

    @property
    def dp_rank(self) -> int:
        """This rank's place among the data-parallel ranks: the shard of the data it reads."""
        return self.rank // self.model_parallel

    @property
    def is_dp_leader(self) -> bool:
        """The first rank of its model-parallel group: the one whose outputs stand for the group's."""
        return self.rank % self.model_parallel == 0

    @property
    def is_world_zero(self) -> bool:
        return self.rank == 0

    @property
    def is_local_zero(self) -> bool:
        return self.local_rank == 0

    # -- collectives -------------------------------------------------------------------------------
    def barrier(self, group=None) -> None:
        if self.distributed:
            torch.distributed.barrier(group=group)

    def any_flags(self, flags: list[bool]) -> list[bool]:
        """Element-wise OR of boolean flags across ranks: one rank's decision becomes everyone's."""
        if not self.distributed:
            return flags
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def sum(self, values: list[float]) -> list[float]:
        if not self.distributed:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return t.tolist()

    def gather_object(self, obj) -> list | None:
        """Every rank's ``obj`` in rank order on rank 0; None elsewhere."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size if self.is_world_zero else None
        torch.distributed.gather_object(obj, out, dst=0)
        return out

    def all_gather_object(self, obj, group=None) -> list:
        """Every rank's ``obj`` in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj, group=group)
        return out

    def broadcast_object(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]


_side_groups: dict = {}  # key -> (the default group it was made beside, a gloo group over its ranks)


def side_group(key: str):
    """A gloo group over the default group's ranks, one per ``key`` (a collective when made: every rank
    reaches it at the same point): collectives that run on CPU threads beside the training step's group --
    a background save's, the preemption check's -- never pair up with the step's own or with each other's.
    Made again when the default group is a new one."""
    import torch.distributed

    world = torch.distributed.group.WORLD
    made = _side_groups.get(key)
    if made is None or made[0] is not world:
        made = _side_groups[key] = (world, torch.distributed.new_group(backend="gloo"))
    return made[1]


def ray_train_context(use_gpu: bool, run_root: str | None = None) -> RankContext:
    """The context of a Ray Train worker (process group already set up by Ray Train)."""
    import ray.train

    ctx = ray.train.get_context()
    if use_gpu and torch.cuda.is_available():
        import ray.train.torch

        device = ray.train.torch.get_device()
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return RankContext(
        world_size=ctx.get_world_size(),
        rank=ctx.get_world_rank(),
        local_rank=ctx.get_local_rank(),
        local_world_size=ctx.get_local_world_size(),
        node_rank=ctx.get_node_rank(),
        device=device,
        on_ray=True,
        ray_run_root=run_root,
    )


def local_context(args) -> RankContext:
    """The context of the driver's own process (``num_workers=0``): its GPU when it has one and
    ``use_cpu`` is off, as transformers.Trainer places a one-process run."""
    return RankContext(device=local_device(args))


def local_device(args) -> torch.device:
    return _local_device(bool(args.use_cpu))


@functools.cache
def _local_device(use_cpu: bool) -> torch.device:
    # asked at every step (``args.device``, ``n_gpu``); CUDA's presence does not change within a process
    return torch.device("cuda") if not use_cpu and torch.cuda.is_available() else torch.device("cpu")
