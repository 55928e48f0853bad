"""Sparse information form (INF), Lee et al. (2020), eq. 3-6 and appendix eq. 13-21.

Per layer, with the kept eigenvectors ``U_g = U_G[:, I]`` (m x |I|),
``U_a = U_A[:, J]`` (n x |J|), kept normalised EFB eigenvalues ``Λ_L`` (|I| x |J|,
``Λ/M`` restricted to ``I x J``) and the diagonal correction ``D`` (m x n)::

    P = (U_a ⊗ U_g) diag(vec(N Λ_L)) (U_a ⊗ U_g)^T + diag(vec(N D + τ))

``D = diag/M − (U_g ∘ U_g) Λ_L (U_a ∘ U_a)^T`` is computed after the cut from the
kept part only, so the Fisher diagonal of the approximation is exact (Lemma 2);
negative entries (possible, Lemma 3) are clipped to 0 and counted
(:func:`diagonal_correction`).

Sampler (DESIGN §1; Woodbury, all cubic work in ``L x L``, ``L = |I| |J|``). With
``Dp = N D + τ`` (m x n), ``s = √(N Λ_L)`` and the (mn) x L operator
``V = Dp^{-1/2} (U_a ⊗ U_g) diag(vec s)`` (never formed), ``P = Dp^{1/2} (I + V V^T) Dp^{1/2}``.
With ``V^T V = Q Γ Q^T`` (one ``L x L`` eigh) the symmetric square root gives::

    F = Dp^{-1/2} (I − V Q diag(h(Γ)) Q^T V^T),   h(γ) = (1 − (1 + γ)^{-1/2}) / γ,  h(0) = 1/2

which equals the design's ``Dp^{-1/2} (I − P̃ (I − (I+Γ)^{-1/2}) P̃^T)`` with
``P̃ = V Q Γ^{-1/2}``, written so that directions with ``γ ≈ 0`` need no special case.
``F F^T = Dp^{-1/2} (I + V V^T)^{-1} Dp^{-1/2} = P^{-1}`` exactly. (Eq. 6 as printed, with
Cholesky factors, is not an exact factor; see DESIGN §1.)

``V`` is applied with the vec trick: ``V^T vec(X) = vec(s ∘ (U_g^T (Dp^{-1/2} ∘ X) U_a))`` and
``V vec(Y) = vec(Dp^{-1/2} ∘ (U_g (s ∘ Y) U_a^T))``. Entries of ``V^T V`` are
``s_{ac} s_{bd} Σ_{p,q} U_g[p,a] U_g[p,b] Dp^{-1}[p,q] U_a[q,c] U_a[q,d]``: an ``m x |I|²``
tensor, the ``m x n`` matrix ``Dp^{-1}`` and an ``n x |J|²`` tensor, contracted in the
cheaper order. Nothing of size ``(mn) x L`` is ever formed.
"""
from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch

from .base import LayerPosterior, vec
from .diag import check_hyper, check_input, require_positive

__all__ = ["InfLayer", "diagonal_correction", "MAX_L"]

MAX_L = 20_000
"""Default largest ``L = |I||J|``: the ``L x L`` Gram matrix takes ``8 L²`` bytes (3.2 GB at 20,000)."""


def diagonal_correction(
    fisher_diag: torch.Tensor, U_g: torch.Tensor, U_a: torch.Tensor, lam_L: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """``(D, clipped)``: ``D = fisher_diag − (U_g ∘ U_g) lam_L (U_a ∘ U_a)^T`` (m x n, eq. 3),
    negative entries set to 0; ``clipped`` counts them (Lemma 3).

    ``fisher_diag`` = ``diag/M`` (m x n), ``U_g`` (m x |I|), ``U_a`` (n x |J|), ``lam_L`` (|I| x |J|).
    """
    D = fisher_diag - (U_g * U_g) @ lam_L @ (U_a * U_a).T
    neg = D < 0
    clipped = int(neg.sum())
    if clipped:
        D = D.clamp_min(0.0)
    return D, clipped


def _outer_cols(U: torch.Tensor) -> torch.Tensor:
    """``(r, k)`` -> ``(r, k*k)`` with ``[p, a*k + b] = U[p, a] U[p, b]``."""
    r, k = U.shape
    return (U[:, :, None] * U[:, None, :]).reshape(r, k * k)


def _gram_core(U_g: torch.Tensor, U_a: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``C[a, c, b, d] = Σ_{p,q} U_g[p,a] U_g[p,b] W[p,q] U_a[q,c] U_a[q,d]`` as (L, L), ``L = |I||J|``
    with row index ``a*|J| + c``. Cost ``min(|I|²mn + |I|²|J|²n, |J|²mn + |I|²|J|²m)``."""
    m, nI = U_g.shape
    n, nJ = U_a.shape
    Bg, Ba = _outer_cols(U_g), _outer_cols(U_a)  # (m, I²), (n, J²)
    if nI * nI * m * n + nI * nI * nJ * nJ * n <= nJ * nJ * m * n + nI * nI * nJ * nJ * m:
        Y = (Bg.T @ W) @ Ba  # (I², J²)
    else:
        Y = Bg.T @ (W @ Ba)
    # Y[(a,b),(c,d)] -> C[(a,c),(b,d)]
    return Y.reshape(nI, nI, nJ, nJ).permute(0, 2, 1, 3).reshape(nI * nJ, nI * nJ)


class InfLayer(LayerPosterior):
    """Low rank (Kronecker-structured eigenvectors) plus diagonal precision.

    ``U_g`` (m, |I|), ``U_a`` (n, |J|), ``lam_L`` (|I|, |J|) = kept ``Λ/M`` (>= 0),
    ``D`` (m, n) = clipped diagonal correction (>= 0). ``clipped_D`` is the number of
    entries clipped when ``D`` was computed (kept for the run summary). ``Q``, ``Γ``
    of ``V^T V`` are derived on construction (``O(L³)``), in float64.
    """

    method: ClassVar[str] = "inf"

    def __init__(self, U_g: torch.Tensor, U_a: torch.Tensor, lam_L: torch.Tensor, D: torch.Tensor,
                 n_data: float, prior_precision: float, *, clipped_D: int = 0, max_l: int = MAX_L):
        m, nI = U_g.shape if U_g.dim() == 2 else (-1, -1)
        n, nJ = U_a.shape if U_a.dim() == 2 else (-1, -1)
        if U_g.dim() != 2 or U_a.dim() != 2 or lam_L.shape != (nI, nJ) or D.shape != (m, n):
            raise ValueError(
                f"InfLayer: inconsistent shapes U_g {tuple(U_g.shape)}, U_a {tuple(U_a.shape)}, "
                f"lam_L {tuple(lam_L.shape)}, D {tuple(D.shape)} (expected m x |I|, n x |J|, |I| x |J|, m x n)"
            )
        L = nI * nJ
        if L > max_l:
            raise ValueError(
                f"INF keeps L = |I||J| = {nI}*{nJ} = {L} eigenvalues, above max_l={max_l} "
                f"(the L x L Gram matrix would need {8 * L * L / 2**30:.1f} GiB); pass a smaller rank= (top-K)"
            )
        if bool((lam_L < 0).any()) or bool((D < 0).any()):
            raise ValueError("InfLayer: lam_L and D must be >= 0 (clip D with diagonal_correction)")
        self.n_data, self.prior_precision = check_hyper(n_data, prior_precision)
        # contiguous: identical results before and after a save/load round trip
        self.U_g, self.U_a, self.lam_L, self.D = (t.contiguous() for t in (U_g, U_a, lam_L, D))
        self.clipped_D = int(clipped_D)
        self.max_l = int(max_l)
        Dp = self._diag_precision()
        require_positive(Dp, "INF diagonal N D + tau")
        self.d_isqrt = Dp.rsqrt_()  # Dp^{-1/2}, m x n (the only m x n array kept besides D)
        del Dp
        self.s = torch.sqrt(self.n_data * self.lam_L)  # |I| x |J|
        # V^T V = diag(s) C diag(s), C from Dp^{-1} = d_isqrt²; float64 for the L x L eigh.
        f64 = torch.float64
        s64 = self.s.to(f64).reshape(-1)
        K = _gram_core(self.U_g.to(f64), self.U_a.to(f64), self.d_isqrt.to(f64).square())
        K.mul_(s64[:, None]).mul_(s64[None, :])  # symmetric up to round-off; eigh reads one triangle
        gamma, Q = torch.linalg.eigh(K)
        del K
        gamma = gamma.clamp_min(0.0)
        # h(γ) = (1 − (1+γ)^{-1/2}) / γ, stably; h(0) = 1/2.
        pos = gamma > 0
        h = torch.full_like(gamma, 0.5)
        h[pos] = -torch.expm1(-0.5 * torch.log1p(gamma[pos])) / gamma[pos]
        # Only Q (L x L) is kept: H = Q diag(h) Q^T is applied as two products.
        self.gamma, self.Q, self.h = gamma, Q.to(self.U_g.dtype), h.to(self.U_g.dtype)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_eigen(cls, fisher_diag: torch.Tensor, U_G: torch.Tensor, U_A: torch.Tensor, lam: torch.Tensor,
                   rows: torch.Tensor, cols: torch.Tensor, n_data: float, prior_precision: float,
                   *, max_l: int = MAX_L) -> "InfLayer":
        """Cut the full eigenbasis to rows ``I``/cols ``J`` (Algorithm 1) and recompute ``D``.

        ``fisher_diag`` = ``diag/M`` (m x n), ``U_G`` (m x m), ``U_A`` (n x n), ``lam`` = ``Λ/M`` (m x n).
        """
        nI, nJ = rows.numel(), cols.numel()
        if nI * nJ > max_l:  # fail before any work
            raise ValueError(
                f"INF keeps L = |I||J| = {nI}*{nJ} = {nI * nJ} eigenvalues, above max_l={max_l} "
                f"(the L x L Gram matrix would need {8 * (nI * nJ) ** 2 / 2**30:.1f} GiB); pass a smaller rank= (top-K)"
            )
        U_g, U_a = U_G[:, rows].contiguous(), U_A[:, cols].contiguous()
        lam_L = lam[rows][:, cols].contiguous()
        D, clipped = diagonal_correction(fisher_diag, U_g, U_a, lam_L)
        return cls(U_g, U_a, lam_L, D, n_data, prior_precision, clipped_D=clipped, max_l=max_l)

    def with_hyper(self, n_data: float, prior_precision: float) -> "InfLayer":
        """Same stored pieces under new ``(N, τ)``; redoes only the ``L x L`` eigh."""
        return InfLayer(self.U_g, self.U_a, self.lam_L, self.D, n_data, prior_precision,
                        clipped_D=self.clipped_D, max_l=self.max_l)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.D.shape)

    def _diag_precision(self) -> torch.Tensor:
        """``Dp = N D + τ`` (m x n), a fresh tensor."""
        return self.D * self.n_data + self.prior_precision

    @property
    def rank(self) -> int:
        """``L = |I| |J|``."""
        return self.lam_L.numel()

    # ------------------------------------------------------------------ linear maps
    def _Vt(self, x: torch.Tensor) -> torch.Tensor:
        """``V^T vec(x)`` as ``(..., L)`` for ``x`` (..., m, n)."""
        t = self.s * (self.U_g.T @ (self.d_isqrt * x) @ self.U_a)
        return t.reshape(*t.shape[:-2], -1)

    def _V(self, y: torch.Tensor) -> torch.Tensor:
        """``V y`` as ``(..., m, n)`` for ``y`` (..., L)."""
        Y = self.s * y.reshape(*y.shape[:-1], *self.lam_L.shape)
        return (self.U_g @ Y @ self.U_a.T).mul_(self.d_isqrt)

    def precision_matvec(self, v: torch.Tensor) -> torch.Tensor:
        check_input(v, self.shape)
        out = self.U_g @ ((self.n_data * self.lam_L) * (self.U_g.T @ v @ self.U_a)) @ self.U_a.T
        out.addcmul_(self._diag_precision(), v)
        return out

    def scale_matvec(self, z: torch.Tensor) -> torch.Tensor:
        """``F z = Dp^{-1/2} ∘ (z − V H V^T z)``, ``H = Q diag(h(Γ)) Q^T``; a few m x n temporaries."""
        check_input(z, self.shape)
        t = ((self._Vt(z) @ self.Q) * self.h) @ self.Q.T  # H V^T z, (..., L)
        out = self._V(t)  # Dp^{-1/2} ∘ (U_g (s∘t) U_a^T), fresh
        out.neg_().add_(z).mul_(self.d_isqrt)
        return out

    def covariance_matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``P^{-1} v`` by Woodbury: ``P = Dp^{1/2} (I + V V^T) Dp^{1/2}`` and
        ``(I + V V^T)^{-1} = I − V Q (I + Γ)^{-1} Q^T V^T``, so
        ``P^{-1} v = Dp^{-1/2} ∘ (w − V Q (I+Γ)^{-1} Q^T V^T w)``, ``w = Dp^{-1/2} ∘ v``.
        All cubic work was done at construction (``L x L`` eigh)."""
        check_input(v, self.shape)
        w = self.d_isqrt * v
        inv = (1.0 / (1.0 + self.gamma)).to(self.Q.dtype)
        t = ((self._Vt(w) @ self.Q) * inv) @ self.Q.T  # (..., L)
        out = self._V(t)
        out.neg_().add_(w).mul_(self.d_isqrt)
        return out

    def marginal_variance(self) -> torch.Tensor:
        """``diag(P^{-1}) = Dp^{-1} − Dp^{-2} ∘ S`` with
        ``S[p,q] = Σ U_g[p,a] U_a[q,c] R[(a,c),(b,d)] U_g[p,b] U_a[q,d]``,
        ``R = diag(s) Q (I+Γ)^{-1} Q^T diag(s)`` (Woodbury). Cost ``O(m L² + m n |J|²)``."""
        f64 = torch.float64
        nI, nJ = self.lam_L.shape
        s = self.s.to(f64).reshape(-1)
        Q = self.Q.to(f64)
        R = (Q / (1.0 + self.gamma)) @ Q.T
        R = s[:, None] * R * s[None, :]
        # R[(a,c),(b,d)] -> R'[(a,b),(c,d)]
        R = R.reshape(nI, nJ, nI, nJ).permute(0, 2, 1, 3).reshape(nI * nI, nJ * nJ)
        Bg, Ba = _outer_cols(self.U_g.to(f64)), _outer_cols(self.U_a.to(f64))
        S = (Bg @ R) @ Ba.T
        Dinv = self.d_isqrt.to(f64).square()
        return (Dinv - Dinv * Dinv * S).to(self.D.dtype)

    def to_dense(self) -> torch.Tensor:
        self._check_dense_size()
        U = torch.kron(self.U_a, self.U_g)  # (mn, L), vec order; tests only
        e = vec(self.n_data * self.lam_L)
        return (U * e) @ U.T + torch.diag(vec(self._diag_precision()))

    def num_stored(self) -> int:
        m, n = self.shape
        nI, nJ = self.lam_L.shape
        return nI * m + nJ * n + nI * nJ + m * n

    # ------------------------------------------------------------------ serialisation
    def tensors(self) -> dict[str, torch.Tensor]:
        return {"U_g": self.U_g, "U_a": self.U_a, "lam_L": self.lam_L, "D": self.D}

    def meta(self) -> dict[str, Any]:
        return {"n_data": self.n_data, "prior_precision": self.prior_precision,
                "clipped_D": self.clipped_D, "max_l": self.max_l}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> "InfLayer":
        return cls(tensors["U_g"], tensors["U_a"], tensors["lam_L"], tensors["D"], meta["n_data"],
                   meta["prior_precision"], clipped_D=int(meta.get("clipped_D", 0)), max_l=int(meta.get("max_l", MAX_L)))
