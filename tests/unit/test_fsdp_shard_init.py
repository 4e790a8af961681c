"""How FSDP initialises each rank's shard of a model built on the meta device (strategies/fsdp.py
``model_initialiser``), for a plain torch model with no root ``reset_parameters()``: each module's own."""

from __future__ import annotations

import logging
import math

import torch

from raytrainer.strategies.fsdp import model_initialiser


class Scaled(torch.nn.Module):
    """A module that holds a parameter and has no reset_parameters(): nothing can initialise a shard of it."""

    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.gain


def _on_meta(build):
    with torch.device("meta"):
        return build()


def test_each_modules_own_reset_parameters_initialises_a_plain_model():
    model = _on_meta(lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8),
                                                 torch.nn.Linear(8, 2), torch.nn.BatchNorm1d(2)))
    initialise = model_initialiser(model)
    assert initialise is not None
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))  # what to_empty may leave
    torch.manual_seed(0)
    initialise()
    first, norm, second, batch_norm = model
    for linear in (first, second):
        bound = 1 / math.sqrt(linear.in_features)
        assert linear.weight.abs().max() <= bound and linear.bias.abs().max() <= bound
        assert linear.weight.std() > 0.2 * bound  # drawn, not a constant
    assert torch.equal(norm.weight, torch.ones(8)) and torch.equal(norm.bias, torch.zeros(8))
    assert torch.equal(batch_norm.running_var, torch.ones(2)) and int(batch_norm.num_batches_tracked) == 0


def test_a_parameter_no_module_initialises_means_rank_0_builds_and_the_warning_names_it(caplog):
    model = _on_meta(lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), Scaled()))
    with caplog.at_level(logging.WARNING, logger="raytrainer.strategies.fsdp"):
        assert model_initialiser(model) is None
    assert "1.gain" in caplog.text and "reset_parameters()" in caplog.text
