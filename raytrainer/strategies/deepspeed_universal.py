"""Loading DeepSpeed's universal checkpoint on a rank that holds no parameter of an optimizer group.

ZeRO-1/2 (and DeepSpeed's bf16 optimizer) flatten each optimizer parameter group, pad it to a multiple of
2 x world size numbers and cut it into equal partitions by position. A small group -- at most 2 numbers on
2 ranks, e.g. a model whose only bias (the no-decay group) is a head of 1 or 2 outputs -- leaves the last
ranks' partitions padding only. DeepSpeed 0.19's ``load_hp_checkpoint_state_from_checkpoint_dir``
(``runtime/base_optimizer.py``, what ``load_universal`` runs on every rank) takes the group's optimizer
step from the parameters the rank holds a fragment of, ``steps[0]``, and fails on such a rank with
``IndexError: list index out of range``: a checkpoint of 1 worker does not resume on 2. Training, saving and
loading a checkpoint of the same world size never reach that code.

``load_hp_checkpoint_state`` is DeepSpeed's loop with one change: a group this rank holds nothing of takes
its hyperparameters (learning rate, betas, ...) from the checkpoint and no optimizer state, as that rank's
share of it in an uninterrupted run is padding, which no parameter reads. ``repair`` installs it on a ZeRO
optimizer (not ZeRO-3, which loads through another function).
"""

from __future__ import annotations

import os
import types

import torch


def repair(optimizer) -> None:
    """Make ``optimizer`` (a DeepSpeed ZeRO-1/2 or bf16 optimizer) load universal checkpoints with groups of
    which this rank holds no parameter."""
    if hasattr(optimizer, "load_hp_checkpoint_state_from_checkpoint_dir"):
        optimizer.load_hp_checkpoint_state_from_checkpoint_dir = types.MethodType(load_hp_checkpoint_state,
                                                                                  optimizer)


def load_hp_checkpoint_state(self, lp_groups_name: str, checkpoint_dir: str) -> None:
    """DeepSpeed 0.19.8's ``BaseOptimizer.load_hp_checkpoint_state_from_checkpoint_dir``, with the groups this
    rank holds no fragment of skipped for their state (see the module's docstring)."""
    from deepspeed.runtime.base_optimizer import _get_universal_checkpoint_ep_info
    from deepspeed.runtime.utils import bwc_tensor_model_parallel_rank
    from deepspeed.utils.tensor_fragment import map_to_flat_opt_states

    checkpoint_dir = os.path.join(checkpoint_dir, "zero")
    optim_state_path = os.path.join(checkpoint_dir, "optimizer_state.pt")
    if not os.path.isfile(optim_state_path):
        raise FileNotFoundError(f"{optim_state_path} (the optimizer's global state) is missing")
    optim_sd = torch.load(optim_state_path, weights_only=False)  # weights_only_loads() makes it weights-only
    self._load_global_state(optim_sd)

    tp_rank = bwc_tensor_model_parallel_rank(mpu=self.mpu)
    if self.mpu is None:
        tp_world_size = 1
    else:
        tp_world_size = (self.mpu.get_slice_parallel_world_size()
                         if hasattr(self.mpu, "get_slice_parallel_world_size")
                         else self.mpu.get_tensor_model_parallel_world_size())
    ep_rank, ep_size = _get_universal_checkpoint_ep_info()
    lp_groups = getattr(self, lp_groups_name)
    for i, (param_group, loaded_param_group) in enumerate(zip(self.optimizer.param_groups,
                                                              optim_sd["param_groups"])):
        opt_keys, steps = set(), []
        for lp in lp_groups[i]:
            if lp._hp_mapping is not None:
                folder = os.path.join(checkpoint_dir, self.param_names[lp])
                step = lp.load_hp_checkpoint_state(folder, tp_rank, tp_world_size, ep_rank=ep_rank,
                                                   ep_size=ep_size)
                opt_keys.update(lp._hp_mapping.get_optim_state_keys())
                steps.append(step)
        if steps:  # DeepSpeed: steps[0] unguarded
            hp_param = param_group["params"][0]
            if any(step != steps[0] for step in steps):
                raise RuntimeError(f"parameter group {i}: the checkpoint's steps differ ({steps})")
            if steps[0] is not None:
                self.optimizer.state[hp_param]["step"] = steps[0]
            map_to_flat_opt_states(hp_param, lp_groups[i], self.optimizer.state, opt_keys)
        for key, value in loaded_param_group.items():
            if key != "params":
                param_group[key] = value
