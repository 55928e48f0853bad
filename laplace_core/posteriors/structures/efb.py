"""Posteriors diagonal in a Kronecker-factored eigenbasis (docs/design.md §1).

``P = (U_A ⊗ U_G) diag(vec(N Λ + τ)) (U_A ⊗ U_G)^T`` with ``Λ`` an ``m x n`` matrix
of (normalised) eigenvalues, entry ``[i, j]`` belonging to ``(U_G[:, i], U_A[:, j])``:

* ``"efb"`` (George et al. 2018): ``Λ = efb / efb_count``, the per-example second
  moments of the gradients in the KFAC eigenbasis.
* ``"kfac_exact"`` (Lee et al. 2020, F.3.2, "OKF" exact prior): ``Λ = S_G S_A^T``,
  i.e. ``P = N (A/M ⊗ G/M) + τ I``.

With the vec trick ``(U_A ⊗ U_G) vec(X) = vec(U_G X U_A^T)``:

* ``P V = U_G [(N Λ + τ) ∘ (U_G^T V U_A)] U_A^T``
* ``F Z = U_G [(N Λ + τ)^{-1/2} ∘ Z] U_A^T`` (``F F^T = P^{-1}``)
* ``diag(P^{-1}) = (U_G ∘ U_G) (N Λ + τ)^{-1} (U_A ∘ U_A)^T``
"""
from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch

from .base import LayerPosterior, ScaleFactors
from .diag import check_hyper, check_input, require_positive

__all__ = ["EigenDiagLayer", "EFBLayer", "KronExactLayer"]


class EigenDiagLayer(LayerPosterior):
    """Diagonal precision ``N Λ + τ`` (``m x n``) in the eigenbasis ``U_A ⊗ U_G``.

    ``U_A`` (n, n), ``U_G`` (m, m), ``lam`` (m, n) = ``Λ/M``. Use the concrete
    subclasses :class:`EFBLayer` (``"efb"``) and :class:`KronExactLayer` (``"kfac_exact"``).
    """

    method: ClassVar[str] = "efb"

    def __init__(self, U_A: torch.Tensor, U_G: torch.Tensor, lam: torch.Tensor, n_data: float, prior_precision: float):
        m, n = lam.shape if lam.dim() == 2 else (-1, -1)
        if lam.dim() != 2 or U_A.shape != (n, n) or U_G.shape != (m, m):
            raise ValueError(
                f"{type(self).__name__}: inconsistent shapes U_A {tuple(U_A.shape)}, U_G {tuple(U_G.shape)}, "
                f"lam {tuple(lam.shape)} (expected n x n, m x m, m x n)"
            )
        self.n_data, self.prior_precision = check_hyper(n_data, prior_precision)
        # contiguous: identical results before and after a save/load round trip
        self.U_A, self.U_G, self.lam = U_A.contiguous(), U_G.contiguous(), lam.contiguous()
        self.eig = self.n_data * lam + self.prior_precision  # eigenvalues of P, m x n
        require_positive(self.eig, f"{self.method} precision N Λ/M + tau")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.lam.shape)

    def with_hyper(self, n_data: float, prior_precision: float) -> "EigenDiagLayer":
        return type(self)(self.U_A, self.U_G, self.lam, n_data, prior_precision)

    def precision_matvec(self, v: torch.Tensor) -> torch.Tensor:
        check_input(v, self.shape)
        return self.U_G @ (self.eig * (self.U_G.T @ v @ self.U_A)) @ self.U_A.T

    def scale_matvec(self, z: torch.Tensor) -> torch.Tensor:
        return self.scale_factors(z).matrix()

    def scale_factors(self, z: torch.Tensor) -> ScaleFactors:
        """``F z = U_G [(N Λ + τ)^{-1/2} ∘ z] U_A^T``: ``(U_G, (N Λ + τ)^{-1/2} ∘ z, U_A)``."""
        check_input(z, self.shape)
        return ScaleFactors(self.U_G, torch.rsqrt(self.eig) * z, self.U_A)

    def covariance_matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``P^{-1} V = U_G [(U_G^T V U_A) / (N Λ + τ)] U_A^T``."""
        check_input(v, self.shape)
        return self.U_G @ ((self.U_G.T @ v @ self.U_A) / self.eig) @ self.U_A.T

    def marginal_variance(self) -> torch.Tensor:
        return (self.U_G * self.U_G) @ (1.0 / self.eig) @ (self.U_A * self.U_A).T

    def to_dense(self) -> torch.Tensor:
        self._check_dense_size()
        U = torch.kron(self.U_A, self.U_G)
        e = self.eig.transpose(0, 1).reshape(-1)  # vec order
        return (U * e) @ U.T

    def num_stored(self) -> int:
        m, n = self.shape
        return n * n + m * m + m * n

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"U_A": self.U_A, "U_G": self.U_G, "lam": self.lam}

    def meta(self) -> dict[str, Any]:
        return {"n_data": self.n_data, "prior_precision": self.prior_precision}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> "EigenDiagLayer":
        return cls(tensors["U_A"], tensors["U_G"], tensors["lam"], meta["n_data"], meta["prior_precision"])


class EFBLayer(EigenDiagLayer):
    """EFB (George et al. 2018): ``lam = efb / efb_count``."""

    method: ClassVar[str] = "efb"


class KronExactLayer(EigenDiagLayer):
    """KFAC with the exact prior ``N (A/M ⊗ G/M) + τ I``: ``lam = S_G S_A^T``."""

    method: ClassVar[str] = "kfac_exact"

    @classmethod
    def from_factors(cls, U_A, S_A, U_G, S_G, n_data: float, prior_precision: float) -> "KronExactLayer":
        return cls(U_A, U_G, S_G[:, None] * S_A[None, :], n_data, prior_precision)
