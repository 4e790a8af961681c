"""GaLore optimizers (``optim="galore_*"``, from the ``galore-torch`` package), set up as HF does.

The weights of the ``nn.Linear`` modules that ``optim_target_modules`` names (names, regexes, or
"all-linear") form a group with GaLore's projection settings, read from ``optim_args`` (``rank`` 128,
``update_proj_gap`` 200, ``scale`` 0.25, ``proj_type`` "std"); every other parameter is a plain group.
Their optimizer state lives in the projected, low-rank space.

The ``*_layerwise`` forms step each parameter inside backward, the moment its gradient is complete
(``register_post_accumulate_grad_hook``), with one optimizer -- and one scheduler -- per parameter, so the
whole model's gradients never exist at once. The loop then sees a ``LayerWiseOptimizer`` whose step does
nothing. That cannot work with gradient accumulation or with DDP's all-reduce of gradients (refused when
the arguments are made).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn


def _galore_classes() -> dict[str, type]:
    try:
        from galore_torch import GaLoreAdafactor, GaLoreAdamW, GaLoreAdamW8bit
    except ImportError:
        raise ImportError("optim=galore_*: the galore-torch package is not installed; "
                          "pip install galore-torch (in the workers' environment too)") from None
    return {"galore_adamw": GaLoreAdamW, "galore_adamw_8bit": GaLoreAdamW8bit,
            "galore_adafactor": GaLoreAdafactor}


def _targets(model: nn.Module, modules) -> list[str]:
    all_linear = isinstance(modules, str) and modules.replace("_", "-") == "all-linear"
    patterns = [modules] if isinstance(modules, str) else list(modules)
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if all_linear or any(re.fullmatch(p, name) or name.split(".")[-1] == p or p in name.split(".")
                             for p in patterns):
            names.append(f"{name}.weight")
    if not names:
        raise ValueError(f"optim_target_modules={modules!r}: matches no nn.Linear module of the model; "
                         "name layers the model has (e.g. 'attn', 'mlp') or pass 'all-linear'")
    return names


class LayerWiseOptimizer(torch.optim.Optimizer):
    """What the loop steps when each parameter is stepped in its backward hook: nothing."""

    def __init__(self, optimizers: dict, lr: float):
        self.optimizers = optimizers
        super().__init__([torch.zeros(1)], {"lr": lr})

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict:
        return {"per_parameter": [opt.state_dict() for opt in self.optimizers.values()]}

    def load_state_dict(self, state: dict) -> None:
        for opt, saved in zip(self.optimizers.values(), state["per_parameter"]):
            opt.load_state_dict(saved)


def create_galore_optimizer(model: nn.Module, args, base_kwargs: dict[str, Any], extra: dict[str, Any]):
    name = getattr(args.optim, "value", args.optim)
    layerwise = name.endswith("_layerwise")
    cls = _galore_classes()[name.removesuffix("_layerwise")]
    extra = dict(extra)
    galore = {"rank": int(extra.pop("rank", 128)), "update_proj_gap": int(extra.pop("update_proj_gap", 200)),
              "scale": float(extra.pop("scale", 0.25)), "proj_type": extra.pop("proj_type", "std")}
    kwargs = {**base_kwargs, **extra}
    if cls.__name__ == "GaLoreAdafactor":
        kwargs = {"lr": kwargs["lr"], "scale_parameter": False, "relative_step": False, **extra}
    targets = set(_targets(model, args.optim_target_modules))
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    target_params = [p for n, p in params if n in targets]
    others = [p for n, p in params if n not in targets]
    if not layerwise:
        return cls([{"params": others}, {"params": target_params, **galore}], **kwargs)
    if args.gradient_accumulation_steps != 1:
        raise ValueError(f"optim={name}: layer-wise GaLore steps in backward, so gradient_accumulation_steps "
                         "must be 1")
    optimizers = {p: cls([{"params": [p]}], **kwargs) for p in others}
    optimizers.update({p: cls([{"params": [p], **galore}], **kwargs) for p in target_params})

    def step_now(param):
        if param.grad is not None:
            optimizers[param].step()
            optimizers[param].zero_grad()

    for param in optimizers:
        param.register_post_accumulate_grad_hook(step_now)
    return LayerWiseOptimizer(optimizers, kwargs["lr"])


class LayerWiseScheduler(torch.optim.lr_scheduler.LRScheduler):
    """One scheduler per parameter's optimizer, each stepped in that parameter's backward hook."""

    def __init__(self, optimizer: LayerWiseOptimizer, build):
        self.schedulers = {p: build(opt) for p, opt in optimizer.optimizers.items()}
        for param, scheduler in self.schedulers.items():
            param.register_post_accumulate_grad_hook(lambda _p, s=scheduler: s.step())
        super().__init__(optimizer)

    def get_lr(self):
        first = next(iter(self.schedulers.values()), None)
        return first.get_last_lr() if first is not None else [g["lr"] for g in self.optimizer.param_groups]

    def step(self, epoch=None):
        if hasattr(self, "schedulers"):  # __init__'s own first step runs before they exist
            self._last_lr = self.get_lr()

    def state_dict(self) -> dict:
        return {"per_parameter": [s.state_dict() for s in self.schedulers.values()]}

    def load_state_dict(self, state: dict) -> None:
        for scheduler, saved in zip(self.schedulers.values(), state["per_parameter"]):
            scheduler.load_state_dict(saved)
