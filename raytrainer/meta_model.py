"""The driver's ``model_init`` model, without its weights, when the workers build the real one.

transformers' ``Trainer.__init__`` calls ``model_init()``, and its checks read the model (the forward's
signature, the label names, the config). On Ray (``num_workers > 0``) the workers build their own model
(sharded where the strategy shards), so a real one on the driver is pure cost: at 1.1B parameters 26 s of
CPU initialisation and 4.4 GB on the head node before any worker starts, at 70B 280 GB, which a CPU-only
head node does not have. Above ``DRIVER_META_ABOVE_PARAMS`` the driver therefore keeps the model that
``model_init`` builds under ``torch.device("meta")``: the same modules, shapes and config, no storage. Below
it (any model a driver-side forward check still covers) the driver builds the real model, as transformers.

The skeleton becomes real on first use of the trained weights (``materialise``): ``model_init`` runs again,
for real, and the final weights are loaded into it (``raytrainer.final_weights``). A ``model_init`` that
cannot run under the meta device (``from_pretrained`` refuses to) is simply called for real.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import numpy as np
import torch

logger = logging.getLogger(__name__)

#: Above this many parameters (with num_workers > 0) the driver keeps model_init's model on the meta device.
DRIVER_META_ABOVE_PARAMS = 100_000_000


def is_skeleton(model) -> bool:
    """Every parameter of ``model`` is on the meta device (holds no storage)."""
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    return bool(params) and all(p.is_meta for p in params)


def driver_model(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``build()`` on the meta device when the model is big enough to matter, else for real."""
    model = build_on_meta(build)
    if model is None:
        return build()
    if not is_skeleton(model):
        return model  # it chose its own device: that build is the real one, not repeated
    n = sum(p.numel() for p in model.parameters())
    if n <= DRIVER_META_ABOVE_PARAMS:
        return build()
    logger.info("model_init's %s has %.2fB parameters: the driver keeps it on the meta device (no weights); "
                "the workers build the real one, and trainer.model gets the trained weights after train()",
                type(model).__name__, n / 1e9)
    return model


def materialise(model: torch.nn.Module, build: Callable[[], torch.nn.Module]) -> None:
    """Make the skeleton ``model`` real in place (the same object, which callbacks and ``model_wrapped``
    hold): ``build()`` for real, then take over the built module's state. Its weights are the init's until
    the caller loads the trained ones."""
    real = build()
    if type(real) is not type(model):
        raise TypeError(f"model_init returned a {type(real).__name__} this time, a {type(model).__name__} "
                        "before: it must build the same model on every call.")
    vars(model).clear()
    vars(model).update(vars(real))


def build_on_meta(build) -> torch.nn.Module | None:
    """``build()`` under the meta device (the driver's skeleton; FSDP's per-shard construction on a worker);
    None where it fails there. Unless the model came out real (a
    ``model_init`` that names its device), every random generator's state is put back after, so the real
    build that may follow draws what it would have drawn."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    model = None
    try:
        with torch.device("meta"):
            model = build()
    except Exception as exc:  # any failure only means: build it for real
        logger.debug("model_init cannot run on the meta device (%s: %s); the driver builds it for real",
                     type(exc).__name__, exc)
    finally:
        if model is None or is_skeleton(model):
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])
    return model
