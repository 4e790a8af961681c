"""The worker group's torch process group, set up as Ray Train's ``TorchConfig`` does, without importing torch
in Ray Train's controller.

Ray Train's controller runs its backend's ``on_start``, which sets the group's rendezvous address and calls
``init_process_group`` on every worker. Ray's ``TorchConfig`` lives in a module that imports torch, and the
controller unpickles it: ~150 MiB PSS and ~2 s of a 2-core machine's CPU, on the path to the first step,
spent in a process that never touches a tensor. ``ProcessGroupConfig`` runs the same steps with Ray's own
worker-side functions (``_set_torch_distributed_env_vars``, ``_setup_torch_process_group``,
``_shutdown_torch``, the CUDA device context), imported on the workers only. Not carried over: Ray's TPU
multislice set-up and ``init_method="tcp"`` (raytrainer uses neither).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import ray
from ray.train.backend import Backend, BackendConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ProcessGroupConfig(BackendConfig):
    backend: str | None = None  # None: nccl where the workers have GPUs, else gloo (as Ray decides)
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return _ProcessGroupBackend

    @property
    def train_func_context(self):
        return _DeviceContext

    @property
    def framework(self):
        from ray.train.v2._internal.util import TrainingFramework

        return TrainingFramework.TORCH


class _ProcessGroupBackend(Backend):
    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group, backend_config: ProcessGroupConfig):
        from ray.train._internal.utils import get_address_and_port

        backend = backend_config.backend
        if backend is None:
            backend = "nccl" if worker_group.get_resources_per_worker().get("GPU", 0) > 0 else "gloo"
        address, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(_set_env, address=address, port=port)
        size = len(worker_group)
        ray.get([worker_group.execute_single_async(rank, _init_process_group, backend=backend,
                                                   world_rank=rank, world_size=size,
                                                   timeout_s=backend_config.timeout_s)
                 for rank in range(size)])

    def on_shutdown(self, worker_group, backend_config):
        from ray.train.constants import (
            DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
            TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
        )

        timeout = float(os.environ.get(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
                                       DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S))
        try:
            ray.get(worker_group.execute_async(_shutdown, destroy_process_group=len(worker_group) > 1),
                    timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            logger.warning("the torch process group's shutdown timed out after %.0f s", timeout)


# -- on the workers ---------------------------------------------------------------------------------------
def _set_env(address: str, port: int) -> None:
    from ray.train.torch.config import _set_torch_distributed_env_vars

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    _set_torch_distributed_env_vars()  # RANK, LOCAL_RANK, WORLD_SIZE, ... as torchrun sets them
    if not ray.get_gpu_ids():
        # DeepSpeed's own name for a worker without a GPU: what its detection would settle on anyway, without
        # the "Setting accelerator to CPU" warning it prints when it first loads (transformers' first save
        # imports it through accelerate, DeepSpeed or not)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _init_process_group(**kwargs) -> None:
    from ray.train.torch.config import _setup_torch_process_group

    _setup_torch_process_group(init_method="env://", **kwargs)


def _shutdown(destroy_process_group: bool) -> None:
    from ray.train.torch.config import _shutdown_torch

    _shutdown_torch(destroy_process_group=destroy_process_group)


class _DeviceContext:
    """Ray's ``TorchConfigContextManager`` (the CUDA device of the worker's GPU), imported on the worker."""

    def __enter__(self):
        from ray.train.torch.config import TorchConfigContextManager

        TorchConfigContextManager().__enter__()

    def __exit__(self, *exc_info):
        return False
