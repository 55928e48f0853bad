"""Kronecker-factored eigenbasis of the KFAC factors (docs/design.md §1).

``A/M = U_A diag(S_A) U_A^T`` (n x n) and ``G/M = U_G diag(S_G) U_G^T`` (m x m), from
``torch.linalg.eigh`` in float64 on symmetrised matrices. Eigenvalues below zero
(round-off: the factors are sums of outer products, hence PSD) are clamped to 0
and counted; a factor containing NaN/Inf raises with the layer's name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

from ..curvature.statistics import CurvatureStatistics

__all__ = ["LayerBasis", "Eigenbasis", "factor_eigh", "layer_eigenbasis", "eigenbasis"]


@dataclass(frozen=True)
class LayerBasis:
    """Eigenvectors/values of one layer's averaged factors.

    ``U_A`` (n, n), ``S_A`` (n,), ``U_G`` (m, m), ``S_G`` (m,); all float64.
    ``clamped`` counts negative eigenvalues set to zero.
    """

    U_A: torch.Tensor
    S_A: torch.Tensor
    U_G: torch.Tensor
    S_G: torch.Tensor
    clamped: int = 0

    def to(self, dtype=None, device=None) -> "LayerBasis":
        return LayerBasis(
            *(t.to(dtype=dtype, device=device) for t in (self.U_A, self.S_A, self.U_G, self.S_G)),
            clamped=self.clamped,
        )


@dataclass(frozen=True)
class Eigenbasis:
    """``name -> LayerBasis`` in model order, plus the total clamp count."""

    layers: dict[str, LayerBasis]
    clamped: dict[str, int] = field(default_factory=dict)

    def __getitem__(self, name: str) -> LayerBasis:
        return self.layers[name]

    def __contains__(self, name: str) -> bool:
        return name in self.layers

    def __iter__(self):
        return iter(self.layers)

    def total_clamped(self) -> int:
        return int(sum(self.clamped.values()))

    def flat_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for k, b in self.layers.items():
            out[f"{k}/U_A"] = b.U_A.contiguous()
            out[f"{k}/S_A"] = b.S_A.contiguous()
            out[f"{k}/U_G"] = b.U_G.contiguous()
            out[f"{k}/S_G"] = b.S_G.contiguous()
        return out

    @classmethod
    def from_flat(cls, tensors: Mapping[str, torch.Tensor], names: list[str], clamped: Mapping[str, int]) -> "Eigenbasis":
        layers = {
            k: LayerBasis(tensors[f"{k}/U_A"], tensors[f"{k}/S_A"], tensors[f"{k}/U_G"], tensors[f"{k}/S_G"], int(clamped.get(k, 0)))
            for k in names
        }
        return cls(layers=layers, clamped={k: int(clamped.get(k, 0)) for k in names})


def _eigh_with_retry(sym: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh``; when LAPACK fails to converge (seen on heavily rank-deficient
    factors with many repeated zero eigenvalues), retry on ``sym + δI`` with growing tiny
    shifts ``δ`` and subtract ``δ`` from the eigenvalues (same eigenvectors)."""
    try:
        return torch.linalg.eigh(sym)
    except torch.linalg.LinAlgError as first:
        n = sym.shape[-1]
        scale = float(sym.diagonal().abs().max()) if n else 0.0
        scale = scale if scale > 0 else 1.0
        eye = torch.eye(n, dtype=sym.dtype, device=sym.device)
        for rel in (1e-12, 1e-10, 1e-8):
            delta = rel * scale
            try:
                S, U = torch.linalg.eigh(sym + delta * eye)
            except torch.linalg.LinAlgError:
                continue
            return S - delta, U
        raise ValueError(f"{name}: eigendecomposition failed to converge, also with a diagonal shift ({first})") from None


def factor_eigh(mat: torch.Tensor, *, name: str = "factor") -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(U, S, clamped)`` of a symmetric PSD matrix, float64, ``S`` ascending.

    Round-off negatives (above ``-1e-6`` of the largest magnitude) are clamped to 0
    and counted; anything more negative means the input is not a valid factor and
    raises a one-line ``ValueError`` naming the layer.
    """
    if not torch.isfinite(mat).all():
        raise ValueError(f"{name}: Kronecker factor contains NaN or Inf; cannot eigendecompose")
    m64 = mat.to(torch.float64)
    sym = 0.5 * (m64 + m64.transpose(-1, -2))
    S, U = _eigh_with_retry(sym, name)
    scale = float(S.abs().max()) if S.numel() else 0.0
    if scale > 0 and float(S.min()) < -1e-6 * scale:
        raise ValueError(
            f"{name}: Kronecker factor is not positive semi-definite "
            f"(eigenvalue {float(S.min()):.3e} against largest {scale:.3e})"
        )
    neg = S < 0
    clamped = int(neg.sum())
    if clamped:
        S = S.clamp_min(0.0)
    return U, S, clamped


def layer_eigenbasis(A_sum: torch.Tensor, G_sum: torch.Tensor, count: int, *, name: str = "layer") -> LayerBasis:
    """Eigenbasis of ``A_sum/count`` and ``G_sum/count`` for one layer."""
    if count <= 0:
        raise ValueError(f"{name}: cannot build an eigenbasis from zero examples")
    U_A, S_A, ca = factor_eigh(A_sum / count, name=f"{name}.A")
    U_G, S_G, cg = factor_eigh(G_sum / count, name=f"{name}.G")
    return LayerBasis(U_A=U_A, S_A=S_A, U_G=U_G, S_G=S_G, clamped=ca + cg)


def eigenbasis(stats: CurvatureStatistics) -> Eigenbasis:
    """Eigenbasis for every layer of ``stats`` (single process; the Ray pipeline
    spreads the same :func:`layer_eigenbasis` calls over workers). Normalisation layers
    (diagonal only, no factors) have none."""
    layers = {k: layer_eigenbasis(v.A, v.G, stats.count, name=k) for k, v in stats.layers.items()
              if not stats.infos[k].diag_only}
    return Eigenbasis(layers=layers, clamped={k: b.clamped for k, b in layers.items()})
