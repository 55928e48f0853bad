"""Diagonal Laplace posterior for one layer (docs/design.md §1).

``P = N diag/M + τ`` elementwise on the ``m x n`` grid of ``W~``; ``diag/M`` is the
exact Fisher diagonal. ``F z = P^{-1/2} ∘ z``.

Also holds the small input checks shared by every structure
(:func:`check_hyper`, :func:`check_input`).
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, Mapping

import torch

from .base import LayerPosterior, vec

__all__ = ["DiagLayer", "check_hyper", "check_input", "require_positive"]


def check_hyper(n_data: float, prior_precision: float) -> tuple[float, float]:
    """Validate ``N > 0`` and ``τ >= 0`` (finite); returns them as floats."""
    try:
        N, tau = float(n_data), float(prior_precision)
    except (TypeError, ValueError):
        raise ValueError(f"n_data and prior_precision must be numbers, got {n_data!r}, {prior_precision!r}") from None
    if not (math.isfinite(N) and N > 0):
        raise ValueError(f"n_data (N) must be a finite number > 0, got {n_data!r}")
    if not (math.isfinite(tau) and tau >= 0):
        raise ValueError(f"prior_precision (tau) must be a finite number >= 0, got {prior_precision!r}")
    return N, tau


def require_positive(x: torch.Tensor, what: str) -> None:
    """Raise a one-line error when a precision entry / factor eigenvalue is not > 0."""
    bad = ~(x > 0)
    if bool(bad.any()):
        raise ValueError(
            f"{what} is not positive definite ({int(bad.sum())} of {x.numel()} entries <= 0 or NaN); "
            "use prior_precision > 0"
        )


def check_input(x: torch.Tensor, shape: tuple[int, int]) -> None:
    """``x`` must be ``(m, n)`` or batched ``(k, m, n)``."""
    if x.dim() not in (2, 3) or tuple(x.shape[-2:]) != tuple(shape):
        raise ValueError(f"expected a tensor of shape {tuple(shape)} or (k, {shape[0]}, {shape[1]}), got {tuple(x.shape)}")


class DiagLayer(LayerPosterior):
    """``P = N * fisher_diag + τ`` with ``fisher_diag = diag/M`` (``m x n``)."""

    method: ClassVar[str] = "diag"

    def __init__(self, fisher_diag: torch.Tensor, n_data: float, prior_precision: float):
        if fisher_diag.dim() != 2:
            raise ValueError(f"fisher_diag must be m x n, got shape {tuple(fisher_diag.shape)}")
        self.n_data, self.prior_precision = check_hyper(n_data, prior_precision)
        self.fisher_diag = fisher_diag.contiguous()
        self.precision = self.n_data * fisher_diag + self.prior_precision
        require_positive(self.precision, "diagonal precision N diag/M + tau")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.fisher_diag.shape)

    def with_hyper(self, n_data: float, prior_precision: float) -> "DiagLayer":
        return DiagLayer(self.fisher_diag, n_data, prior_precision)

    def precision_matvec(self, v: torch.Tensor) -> torch.Tensor:
        check_input(v, self.shape)
        return self.precision * v

    def scale_matvec(self, z: torch.Tensor) -> torch.Tensor:
        check_input(z, self.shape)
        return torch.rsqrt(self.precision) * z

    def covariance_matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``P^{-1} v = v / (N diag/M + τ)`` elementwise."""
        check_input(v, self.shape)
        return v / self.precision

    def marginal_variance(self) -> torch.Tensor:
        return 1.0 / self.precision

    def to_dense(self) -> torch.Tensor:
        self._check_dense_size()
        return torch.diag(vec(self.precision))

    def num_stored(self) -> int:
        return self.fisher_diag.numel()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"fisher_diag": self.fisher_diag}

    def meta(self) -> dict[str, Any]:
        return {"n_data": self.n_data, "prior_precision": self.prior_precision}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> "DiagLayer":
        return cls(tensors["fisher_diag"], meta["n_data"], meta["prior_precision"])

