"""KFAC Laplace posterior with Ritter et al.'s prior convention (2018, eq. 9).

Per layer ``P = A' ⊗ G'`` with ``A' = √N A/M + √τ I`` (n x n) and
``G' = √N G/M + √τ I`` (m x m). Stored through the eigendecompositions
``A/M = U_A diag(S_A) U_A^T``, ``G/M = U_G diag(S_G) U_G^T`` (from the
:class:`~laplace_core.basis.eigenbasis.Eigenbasis`), so ``A' = U_A diag(a) U_A^T`` with
``a = √N S_A + √τ`` and likewise ``g``.

* ``P vec(V) = vec(G' V A')`` (``(A ⊗ G) vec(X) = vec(G X A^T)``).
* Matrix-normal sampling: ``F = F_A ⊗ F_G`` with ``F_A = U_A diag(a^{-1/2})``,
  ``F_G = U_G diag(g^{-1/2})`` (``F_A F_A^T = A'^{-1}``), so
  ``F vec(Z) = vec(F_G Z F_A^T)``.
* ``diag(P^{-1}) = diag(G'^{-1}) diag(A'^{-1})^T`` as an ``m x n`` outer product.

The Kronecker product is never formed except in :meth:`KronLayer.to_dense` (tests).
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, Mapping

import torch

from .base import LayerPosterior, ScaleFactors
from .diag import check_hyper, check_input, require_positive

__all__ = ["KronLayer"]


class KronLayer(LayerPosterior):
    """``P = (√N A/M + √τ I) ⊗ (√N G/M + √τ I)`` through the factors' eigenbases.

    ``U_A`` (n, n), ``S_A`` (n,), ``U_G`` (m, m), ``S_G`` (m,).
    """

    method: ClassVar[str] = "kfac"

    def __init__(self, U_A: torch.Tensor, S_A: torch.Tensor, U_G: torch.Tensor, S_G: torch.Tensor,
                 n_data: float, prior_precision: float):
        n, m = S_A.shape[0], S_G.shape[0]
        if U_A.shape != (n, n) or U_G.shape != (m, m) or S_A.dim() != 1 or S_G.dim() != 1:
            raise ValueError(
                f"KronLayer: inconsistent factor shapes U_A {tuple(U_A.shape)}, S_A {tuple(S_A.shape)}, "
                f"U_G {tuple(U_G.shape)}, S_G {tuple(S_G.shape)}"
            )
        self.n_data, self.prior_precision = check_hyper(n_data, prior_precision)
        # contiguous copies: the same numbers give the same BLAS results after a save/load round trip
        self.U_A, self.S_A, self.U_G, self.S_G = (t.contiguous() for t in (U_A, S_A, U_G, S_G))
        sN, st = math.sqrt(self.n_data), math.sqrt(self.prior_precision)
        self.a = sN * S_A + st
        self.g = sN * S_G + st
        require_positive(self.a, "KFAC input factor sqrt(N) A/M + sqrt(tau) I")
        require_positive(self.g, "KFAC output factor sqrt(N) G/M + sqrt(tau) I")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.S_G.shape[0], self.S_A.shape[0])

    def with_hyper(self, n_data: float, prior_precision: float) -> "KronLayer":
        return KronLayer(self.U_A, self.S_A, self.U_G, self.S_G, n_data, prior_precision)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense ``(A', G')`` (n x n, m x m)."""
        A = (self.U_A * self.a) @ self.U_A.T
        G = (self.U_G * self.g) @ self.U_G.T
        return A, G

    def precision_matvec(self, v: torch.Tensor) -> torch.Tensor:
        check_input(v, self.shape)
        x = self.U_G.T @ v @ self.U_A
        x = self.g[:, None] * x * self.a[None, :]
        return self.U_G @ x @ self.U_A.T

    def scale_matvec(self, z: torch.Tensor) -> torch.Tensor:
        return self.scale_factors(z).matrix()

    def scale_factors(self, z: torch.Tensor) -> ScaleFactors:
        """``F z = U_G [g^{-1/2} z a^{-1/2}] U_A^T``: ``(U_G, g^{-1/2} z a^{-1/2}, U_A)``."""
        check_input(z, self.shape)
        return ScaleFactors(self.U_G, torch.rsqrt(self.g)[:, None] * z * torch.rsqrt(self.a)[None, :], self.U_A)

    def covariance_matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``P^{-1} vec(V) = vec(G'^{-1} V A'^{-1})`` through the eigenbases."""
        check_input(v, self.shape)
        x = self.U_G.T @ v @ self.U_A
        x = x / (self.g[:, None] * self.a[None, :])
        return self.U_G @ x @ self.U_A.T

    def marginal_variance(self) -> torch.Tensor:
        var_g = (self.U_G * self.U_G) @ (1.0 / self.g)  # diag(G'^{-1}), (m,)
        var_a = (self.U_A * self.U_A) @ (1.0 / self.a)  # diag(A'^{-1}), (n,)
        return var_g[:, None] * var_a[None, :]

    def to_dense(self) -> torch.Tensor:
        self._check_dense_size()
        A, G = self.factors()
        return torch.kron(A, G)

    def num_stored(self) -> int:
        m, n = self.shape
        return n * n + m * m

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"U_A": self.U_A, "S_A": self.S_A, "U_G": self.U_G, "S_G": self.S_G}

    def meta(self) -> dict[str, Any]:
        return {"n_data": self.n_data, "prior_precision": self.prior_precision}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> "KronLayer":
        return cls(tensors["U_A"], tensors["S_A"], tensors["U_G"], tensors["S_G"], meta["n_data"], meta["prior_precision"])
