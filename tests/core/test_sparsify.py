"""Algorithm 1 (spectral sparsification) and the diagonal correction after the cut."""
from __future__ import annotations

import itertools

import pytest
import torch

from laplace_core.basis.eigenbasis import eigenbasis
from laplace_core.posteriors.build import build_posterior
from laplace_core.posteriors.sparsify import sparsify
from laplace_core.curvature.statistics import CurvatureStatistics, LayerInfo, LayerStatistics
from laplace_core.posteriors.structures.base import vec
from laplace_core.posteriors.build import with_hyper
from laplace_core.posteriors.structures.inf import DP_FLOOR, diagonal_correction, diagonal_precision

F64 = torch.float64


def _stats(m=4, n=5, M=30, T=2, seed=3) -> CurvatureStatistics:
    """One layer, per-example gradients ``d_k = Σ_t g a^T``; EFB sums in the KFAC basis."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(M, T, n, generator=gen, dtype=F64)
    g = torch.randn(M, T, m, generator=gen, dtype=F64) * torch.linspace(0.2, 2.0, m, dtype=F64)
    d = torch.einsum("ktm,ktn->kmn", g, a)
    ls = LayerStatistics(A=torch.einsum("kti,ktj->ij", a, a) / T, G=torch.einsum("kti,ktj->ij", g, g),
                         diag=(d * d).sum(0))
    stats = CurvatureStatistics(layers={"l": ls}, infos={"l": LayerInfo("l", "linear", m, n, True, (m, n - 1))},
                                count=M)
    b = eigenbasis(stats)["l"]
    return stats.with_efb({"l": ((b.U_G.T @ d @ b.U_A) ** 2).sum(0)}, M)


def test_paper_toy_example():
    """Lee et al. §2.3: S_A with 3 entries, S_G with 2; Λ = S_G S_A^T (2 x 3, our m x n layout).
    Keeping the top 3 eigenvalues needs rows {0, 1} and columns {0, 1}: 4 eigenvalues."""
    S_A = torch.tensor([3.0, 2.0, 1.0], dtype=F64)
    S_G = torch.tensor([2.0, 1.0], dtype=F64)
    lam = S_G[:, None] * S_A[None, :]  # [[6, 4, 2], [3, 2, 1]]
    rows, cols = sparsify(lam, 3)
    assert rows.tolist() == [0, 1] and cols.tolist() == [0, 1]
    kept = lam[rows][:, cols]
    assert kept.numel() == 4
    assert sorted(kept.reshape(-1).tolist(), reverse=True) == [6.0, 4.0, 3.0, 2.0]
    assert rows.dtype == cols.dtype == torch.int64


def test_kept_set_is_cross_product_of_top_k_rows_and_columns():
    gen = torch.Generator().manual_seed(0)
    lam = torch.rand(7, 9, generator=gen, dtype=F64)
    flat = sorted(((float(lam[i, j]), i, j) for i in range(7) for j in range(9)), reverse=True)
    for k in range(1, 7 * 9 + 3):
        rows, cols = sparsify(lam, k)
        top = flat[:k]
        assert rows.tolist() == sorted({i for _, i, _ in top})
        assert cols.tolist() == sorted({j for _, _, j in top})
        L = rows.numel() * cols.numel()
        assert L >= min(k, 63)
        kept = {(i, j) for i, j in itertools.product(rows.tolist(), cols.tolist())}
        assert {(i, j) for _, i, j in top} <= kept


def test_ties_are_deterministic():
    lam = torch.ones(3, 4, dtype=F64)
    rows, cols = sparsify(lam, 2)  # ties broken by (row, column): (0,0), (0,1)
    assert rows.tolist() == [0] and cols.tolist() == [0, 1]
    for _ in range(3):
        r2, c2 = sparsify(lam.clone(), 2)
        assert torch.equal(r2, rows) and torch.equal(c2, cols)


def test_bad_k_and_input():
    lam = torch.rand(3, 3, dtype=F64)
    for k in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="k must be a positive int"):
            sparsify(lam, k)
    with pytest.raises(ValueError, match="m x n"):
        sparsify(torch.rand(9, dtype=F64), 2)
    with pytest.raises(ValueError, match="NaN"):
        sparsify(torch.tensor([[float("nan"), 1.0]], dtype=F64), 1)


@pytest.mark.parametrize("N", [30.0, 3e4])
@pytest.mark.parametrize("k", list(range(1, 21)) + [None])
def test_diagonal_is_exact_after_the_cut(k, N):
    """Lemma 2: with D recomputed from the kept part only, INF's Fisher diagonal equals
    the exact diagonal diag/M wherever ``N D + τ`` stayed above ``DP_FLOOR (N diag/M + τ)``; clipped
    entries only add."""
    stats = _stats()
    tau = 0.5
    post = build_posterior(stats, "inf", rank=k, n_data=N, prior_precision=tau)
    lp = post.layers["l"]
    fisher = (torch.diagonal(lp.to_dense()) - tau) / N  # INF's Fisher diagonal (average scale)
    exact = vec(stats.layers["l"].diag / stats.count)
    # independent recomputation of D from the kept eigenpairs (dense)
    b = eigenbasis(stats)["l"]
    lam = stats.layers["l"].efb / stats.efb_count
    rows, cols = sparsify(lam, k) if k is not None else (torch.arange(4), torch.arange(5))
    U = torch.kron(b.U_A[:, cols], b.U_G[:, rows])
    low = torch.diagonal(U @ torch.diag(vec(lam[rows][:, cols])) @ U.T)
    D_raw = exact - low
    clipped = N * D_raw + tau < DP_FLOOR * (N * exact + tau)
    assert int(clipped.sum()) == lp.clipped_D == post.info["clipped_D"]
    assert torch.allclose(fisher[~clipped], exact[~clipped], rtol=1e-10, atol=1e-12)
    floor = low + (DP_FLOOR * (N * exact + tau) - tau) / N  # N D + τ raised to the floor
    assert torch.allclose(fisher[clipped], floor[clipped], rtol=1e-10, atol=1e-12)
    assert bool((fisher >= exact - 1e-12).all())
    if k is None and N > 1e3:  # full rank: trace D = 0, so negative entries exist and get clipped
        assert lp.clipped_D > 0


def test_diagonal_correction_is_unclipped_and_the_floor_depends_on_n_and_tau():
    U_g = torch.eye(2, dtype=F64)
    U_a = torch.eye(2, dtype=F64)
    lam = torch.tensor([[1.0, 0.0], [0.0, 3.0]], dtype=F64)
    diag = torch.tensor([[2.0, 1.0], [1.0, 1.0]], dtype=F64)
    D = diagonal_correction(diag, U_g, U_a, lam)
    assert D.tolist() == [[1.0, 1.0], [1.0, -2.0]]  # Lemma 2 exact, negative entry kept
    low = diag - D
    Dp, clipped = diagonal_precision(D, low, 0.1, 1.0)  # 0.1 * -2 + 1 = 0.8 > 0.01 * 1.1: kept
    assert not bool(clipped.any()) and float(Dp[1, 1]) == pytest.approx(0.8)
    Dp, clipped = diagonal_precision(D, low, 10.0, 1.0)  # 10 * -2 + 1 < 0: raised to the floor
    assert clipped.tolist() == [[False, False], [False, True]]
    assert float(Dp[1, 1]) == pytest.approx(DP_FLOOR * (10.0 * 1.0 + 1.0)) and float(Dp[0, 0]) == 11.0


def test_clipping_is_recounted_by_with_hyper():
    """The clipped set depends on ``(N, τ)``: a posterior built at small ``N`` (nothing
    clipped, diagonal exact) re-targeted to a large ``N`` clips, and back again."""
    stats = _stats()
    small = build_posterior(stats, "inf", n_data=1e-3, prior_precision=1.0)
    assert small.info["clipped_D"] == 0 and small.info["diag_rel_error"] == 0.0
    big = with_hyper(small, 1e5, 1.0)
    D = big.layers["l"].D
    exact = stats.layers["l"].diag / stats.count
    want = int((1e5 * D + 1.0 < DP_FLOOR * (1e5 * exact + 1.0)).sum())
    assert want > 0 and big.info["clipped_D"] == want == big.layers["l"].clipped_D
    assert big.info["clipped_D_fraction"] == pytest.approx(want / D.numel())
    assert big.info["diag_rel_error"] > 0
    direct = build_posterior(stats, "inf", n_data=1e5, prior_precision=1.0)
    assert direct.info["clipped_D"] == want
    assert direct.info["diag_rel_error"] == pytest.approx(big.info["diag_rel_error"], rel=1e-12)
    back = with_hyper(big, 1e-3, 1.0)
    assert back.info["clipped_D"] == 0 and torch.equal(back.layers["l"].D, D)
