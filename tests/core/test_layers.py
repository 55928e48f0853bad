"""laplace_core.curvature.layers.perturbed: W~ + δ inside, the MAP restored bit for bit outside."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_core.curvature.layers import find_layers, get_matrix, perturbed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 4, bias=False)).double()


def test_perturbed_adds_delta_to_w_tilde_and_restores_exactly():
    model = _model()
    modules, infos, _ = find_layers(model)
    before = {k: get_matrix(m).clone() for k, m in modules.items()}
    g = torch.Generator().manual_seed(1)
    deltas = {k: torch.randn(info.shape, generator=g, dtype=torch.float64) for k, info in infos.items()}
    with perturbed(modules, deltas):
        for k, m in modules.items():
            assert torch.equal(get_matrix(m), before[k] + deltas[k]), k  # bias column included for the conv
    for k, m in modules.items():
        assert torch.equal(get_matrix(m), before[k]), k


def test_perturbed_restores_after_an_error():
    model = _model()
    modules, infos, _ = find_layers(model)
    before = {k: get_matrix(m).clone() for k, m in modules.items()}
    deltas = {k: torch.ones(info.shape, dtype=torch.float64) for k, info in infos.items()}
    with pytest.raises(RuntimeError):
        with perturbed(modules, deltas):
            raise RuntimeError("boom")
    for k, m in modules.items():
        assert torch.equal(get_matrix(m), before[k]), k
