"""Loading DeepSpeed's checkpoint files without unpickling code.

DeepSpeed reads its files (``mp_rank_*_model_states.pt``, ``*_optim_states.pt``, the universal folders) with
``torch.load(weights_only=False)`` -- in its checkpoint engine and in ``ds_to_universal`` alike -- so a
crafted file would run code on every rank that resumes from it. While DeepSpeed loads, ``weights_only_loads``
makes every ``torch.load`` in the process a ``weights_only=True`` load that accepts, beyond tensors and plain
containers, only the few DeepSpeed types those files hold (measured on ZeRO 0-3, fp32 and bf16, and universal
checkpoints). A file holding anything else is refused, naming it, and nothing in it runs.
"""

from __future__ import annotations

import contextlib
import pickle

import torch

from raytrainer.checkpoint import CheckpointError


def deepspeed_types() -> list[type]:
    """The non-torch types DeepSpeed pickles into its checkpoint files."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


@contextlib.contextmanager
def weights_only_loads():
    """Meanwhile, ``torch.load`` is ``weights_only=True`` with DeepSpeed's types allow-listed, whatever
    the caller asks. Used around DeepSpeed's loaders only, on the training thread, before training starts."""
    original, allowed = torch.load, deepspeed_types()

    def load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(allowed):
            try:
                return original(f, *args, **kwargs)
            except pickle.UnpicklingError as exc:
                raise CheckpointError(
                    f"{f} holds objects other than tensors, plain containers and DeepSpeed's checkpoint "
                    f"types; raytrainer refuses to unpickle it (nothing in it was run). Details: {exc}"
                ) from exc

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


