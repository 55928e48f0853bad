"""Shared fixtures for the cross-checks against curvlinops, laplace-torch, BackPACK and nngeometry.

Everything is float64 on a tiny CNN (two Conv2d, one with and one without bias, and a Linear),
8x8 inputs, 10 classes, ``M = 6`` examples, empirical Fisher (true labels), so every library
sees exactly the same per-example gradients. Our statistics are sums (docs/design.md §1):
``A = Σ_{k,t} a a^T / T``, ``G = Σ_{k,t} g g^T``, ``diag = Σ_k d_k∘d_k``, count ``M``.
Scale conventions of the peers: ``docs/conventions.md``.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_core.curvature.collect import collect_statistics

DTYPE = torch.float64
M = 6
C = 10
RTOL = 1e-8  # relative, after the documented rescaling


class TinyCNN(nn.Module):
    """conv1: 3->4, 3x3, pad 1, bias (T = 64); conv2: 4->5, 3x3, stride 2, no bias (T = 9);
    fc: 45 -> 10 with bias. ReLUs are not in place."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 5, 3, stride=2, bias=False)
        self.act2 = nn.Tanh()
        self.flat = nn.Flatten()
        self.fc = nn.Linear(45, C)

    def forward(self, x):
        return self.fc(self.flat(self.act2(self.conv2(self.act1(self.conv1(x))))))


# positions per layer for this model at 8x8
POSITIONS = {"conv1": 64, "conv2": 9, "fc": 1}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` (Frobenius), the tolerance measure of every cross-check."""
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyCNN().to(DTYPE).eval()


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(M, 3, 8, 8, generator=g, dtype=DTYPE)
    y = torch.randint(0, C, (M,), generator=g)
    return X, y


@pytest.fixture(scope="module")
def ours(model, data):
    """Our empirical-Fisher sums on the single batch ``data``."""
    return collect_statistics(model, [data], fisher="empirical")


def split_w_b(mat_mn: torch.Tensor, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An ``m x n`` matrix in the shape of ``W~ = [W, b]`` -> (weight-shaped tensor, bias or None)."""
    w = mat_mn[:, : module.weight[0].numel()].reshape(module.weight.shape)
    b = mat_mn[:, -1] if module.bias is not None else None
    return w, b


def torch_order_permutation(model: nn.Module, names: list[str]) -> torch.Tensor:
    """Index map from our vec order to PyTorch's parameter order.

    Our per-layer vec is column stacking of ``W~`` (entry ``[i, j]`` at ``j m + i``), layers in
    ``names`` order; PyTorch's flattening (``model.parameters()`` order, weight row-major, then
    bias) puts ``W[i, j]`` at ``w_off + i n_w + j`` and ``b[i]`` at ``b_off + i``. Returns
    ``perm`` with ``dense_torch[perm][:, perm] == dense_ours`` (i.e. ``perm[ours] = torch index``).
    """
    offsets, off = {}, 0
    for p in model.parameters():
        offsets[id(p)] = off
        off += p.numel()
    perm = []
    for name in names:
        mod = model.get_submodule(name)
        m = mod.weight.shape[0]
        n_w = mod.weight[0].numel()
        n = n_w + (mod.bias is not None)
        for j in range(n):
            for i in range(m):
                if j < n_w:
                    perm.append(offsets[id(mod.weight)] + i * n_w + j)
                else:
                    perm.append(offsets[id(mod.bias)] + i)
    return torch.tensor(perm)
