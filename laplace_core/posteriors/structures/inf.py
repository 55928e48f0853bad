"""Sparse information form (INF), Lee et al. (2020), eq. 3-6 and appendix eq. 13-21.

Per layer, with the kept eigenvectors ``U_g = U_G[:, I]`` (m x |I|),
``U_a = U_A[:, J]`` (n x |J|), kept normalised EFB eigenvalues ``Λ_L`` (|I| x |J|,
``Λ/M`` restricted to ``I x J``) and the diagonal correction ``D`` (m x n)::

    P = (U_a ⊗ U_g) diag(vec(N Λ_L)) (U_a ⊗ U_g)^T + diag(vec(N D + τ))

``D = diag/M − (U_g ∘ U_g) Λ_L (U_a ∘ U_a)^T`` is computed after the cut from the
kept part only, so the Fisher diagonal of the approximation is exact (Lemma 2). ``D`` is
stored as computed; negative entries are possible (at full rank ``trace D = 0``). Lemma 3's
condition ``D >= 0`` is sufficient, not necessary: what must be positive is the diagonal
precision ``N D + τ``. Only where it would fall below a small share of the entry's precision
is it raised to that floor, ``Dp = max(N D + τ, DP_FLOOR (N diag/M + τ))`` (``DP_FLOOR`` says
why relative to the entry); the clipped entries depend on ``(N, τ)`` and are
recounted by :meth:`InfLayer.with_hyper`. Everywhere else the diagonal stays exact; the
precision stays positive definite (``Dp > 0`` plus a PSD low-rank part) and the sampler
below exact for it. ``clipped_D`` counts the clipped entries, ``diag_rel_error`` is
``||diag(F_INF) − diag/M||_F / ||diag/M||_F`` after clipping (0 when nothing is clipped).

Sampler (docs/design.md §1; Woodbury, all cubic work in ``L x L``, ``L = |I| |J|``). With
``Dp = N D + τ`` (m x n), ``s = √(N Λ_L)`` and the (mn) x L operator
``V = Dp^{-1/2} (U_a ⊗ U_g) diag(vec s)`` (never formed), ``P = Dp^{1/2} (I + V V^T) Dp^{1/2}``.
With ``V^T V = Q Γ Q^T`` (one ``L x L`` eigh) the symmetric square root gives::

    F = Dp^{-1/2} (I − V Q diag(h(Γ)) Q^T V^T),   h(γ) = (1 − (1 + γ)^{-1/2}) / γ,  h(0) = 1/2

which equals the design's ``Dp^{-1/2} (I − P̃ (I − (I+Γ)^{-1/2}) P̃^T)`` with
``P̃ = V Q Γ^{-1/2}``, written so that directions with ``γ ≈ 0`` need no special case.
``F F^T = Dp^{-1/2} (I + V V^T)^{-1} Dp^{-1/2} = P^{-1}`` exactly. (Eq. 6 as printed, with
Cholesky factors, is not an exact factor; see docs/design.md §1.)

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

__all__ = ["InfLayer", "diagonal_correction", "low_rank_diagonal", "diagonal_precision", "MAX_L", "DP_FLOOR"]

MAX_L = 20_000
"""Default largest ``L = |I||J|``: the ``L x L`` Gram matrix takes ``8 L²`` bytes (3.2 GB at 20,000)."""

DP_FLOOR = 1e-2
"""Relative floor of the diagonal precision: ``Dp = max(N D + τ, DP_FLOOR (N diag/M + τ))``, i.e.
the diagonal part keeps at least 1% of the entry's precision ``N diag/M + τ``. The sampler and
the marginal variances work with ``Dp^{-1}`` against the low-rank part; their round-off grows
with ``(N diag/M + τ) / Dp``. Floors relative to ``τ`` alone were measured on the structure
tests' layers: ``F F^T`` against the dense ``P^{-1}`` off by 7e-8 at ``1e-6 τ``, 2e-11 at
``1e-2 τ`` (marginal variances off by up to 3e-7 relative), against 1e-14 with this floor."""


def diagonal_correction(
    fisher_diag: torch.Tensor, U_g: torch.Tensor, U_a: torch.Tensor, lam_L: torch.Tensor
) -> torch.Tensor:
    """``D = fisher_diag − (U_g ∘ U_g) lam_L (U_a ∘ U_a)^T`` (m x n, eq. 3), unclipped (Lemma 2:
    the diagonal of the approximation is then exactly ``fisher_diag``).

    ``fisher_diag`` = ``diag/M`` (m x n), ``U_g`` (m x |I|), ``U_a`` (n x |J|), ``lam_L`` (|I| x |J|).
    """
    return fisher_diag - low_rank_diagonal(U_g, U_a, lam_L)


def low_rank_diagonal(U_g: torch.Tensor, U_a: torch.Tensor, lam_L: torch.Tensor) -> torch.Tensor:
    """``diag((U_a ⊗ U_g) diag(vec lam_L) (U_a ⊗ U_g)^T)`` as m x n: ``(U_g ∘ U_g) lam_L (U_a ∘ U_a)^T``."""
    return (U_g * U_g) @ lam_L @ (U_a * U_a).T


def diagonal_precision(D: torch.Tensor, low: torch.Tensor, n_data: float,
                       prior_precision: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Dp, clipped)``: ``Dp = max(N D + τ, DP_FLOOR (N (low + D) + τ))`` (m x n; ``low + D`` is
    the exact diagonal ``diag/M``, ``low`` from :func:`low_rank_diagonal`) and the boolean mask
    of the entries where the floor applied."""
    Dp = D * n_data + prior_precision
    floor = ((low + D).clamp_min(0.0) * n_data + prior_precision).mul_(DP_FLOOR)
    clipped = Dp < floor
    if bool(clipped.any()):
        Dp = torch.where(clipped, floor, Dp)
    return Dp, clipped


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
    ``D`` (m, n) = diagonal correction as computed (any sign). On construction, for the
    given ``(N, τ)``: ``clipped_D`` (entries where ``N D + τ`` was raised to ``DP_FLOOR τ``),
    ``diag_rel_error`` (relative Frobenius error of the Fisher diagonal that this clipping
    causes) and ``Q``, ``Γ`` of ``V^T V`` (``O(L³)``, in float64).
    """

    method: ClassVar[str] = "inf"

    def __init__(self, U_g: torch.Tensor, U_a: torch.Tensor, lam_L: torch.Tensor, D: torch.Tensor,
                 n_data: float, prior_precision: float, *, max_l: int = MAX_L):
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
        if bool((lam_L < 0).any()):
            raise ValueError("InfLayer: lam_L must be >= 0")
        if not bool(torch.isfinite(D).all()):
            raise ValueError("InfLayer: D has non-finite entries")
        self.n_data, self.prior_precision = check_hyper(n_data, prior_precision)
        # contiguous: identical results before and after a save/load round trip
        self.U_g, self.U_a, self.lam_L, self.D = (t.contiguous() for t in (U_g, U_a, lam_L, D))
        self.max_l = int(max_l)
        low = low_rank_diagonal(self.U_g, self.U_a, self.lam_L)
        Dp, clipped = diagonal_precision(self.D, low, self.n_data, self.prior_precision)
        self.clipped_D = int(clipped.sum())
        self.diag_sq_norm, self.diag_sq_error = self._diag_error(low, Dp, clipped)
        del low
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
        D = diagonal_correction(fisher_diag, U_g, U_a, lam_L)
        return cls(U_g, U_a, lam_L, D, n_data, prior_precision, max_l=max_l)

    def with_hyper(self, n_data: float, prior_precision: float) -> "InfLayer":
        """Same stored pieces under new ``(N, τ)``; recounts the clipped entries of
        ``N D + τ`` and redoes the ``L x L`` eigh."""
        return InfLayer(self.U_g, self.U_a, self.lam_L, self.D, n_data, prior_precision, max_l=self.max_l)

    def _diag_error(self, low: torch.Tensor, Dp: torch.Tensor, clipped: torch.Tensor) -> tuple[float, float]:
        """``(||diag/M||², ||diag(F_INF) − diag/M||²)`` with ``diag/M = low + D`` and
        ``diag(F_INF) = low + (Dp − τ)/N``; the error lives on the clipped entries only."""
        f64 = torch.float64
        norm = float((low.to(f64) + self.D.to(f64)).square().sum())
        if not bool(clipped.any()):
            return norm, 0.0
        got = (Dp[clipped].to(f64) - self.prior_precision) / self.n_data
        return norm, float((got - self.D[clipped].to(f64)).square().sum())

    @property
    def diag_rel_error(self) -> float:
        """``||diag(F_INF) − diag/M||_F / ||diag/M||_F`` at this ``(N, τ)`` (0: nothing clipped)."""
        return (self.diag_sq_error / self.diag_sq_norm) ** 0.5 if self.diag_sq_norm > 0 else 0.0

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.D.shape)

    def _diag_precision(self) -> torch.Tensor:
        """``Dp`` (m x n, after the floor), a fresh tensor, from the stored ``Dp^{-1/2}``."""
        return self.d_isqrt.square().reciprocal_()

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
                "clipped_D": self.clipped_D, "diag_rel_error": self.diag_rel_error, "max_l": self.max_l}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> "InfLayer":
        return cls(tensors["U_g"], tensors["U_a"], tensors["lam_L"], tensors["D"], meta["n_data"],
                   meta["prior_precision"], max_l=int(meta.get("max_l", MAX_L)))
