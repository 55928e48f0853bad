"""laplace_core.basis.eigenbasis: reconstruction, clamping, and clear errors."""
from __future__ import annotations

import pytest
import torch

from laplace_core.basis.eigenbasis import Eigenbasis, eigenbasis, factor_eigh, layer_eigenbasis
from laplace_core.curvature.statistics import CurvatureStatistics, LayerInfo, LayerStatistics

F64 = torch.float64
TOL = 1e-12


def _psd(n, rank=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, rank or n + 3, generator=g, dtype=F64)
    return X @ X.T


def _stats(M=7):
    A1, G1 = _psd(4, seed=1), _psd(3, seed=2)
    A2, G2 = _psd(5, rank=2, seed=3), _psd(2, seed=4)  # A2 is rank deficient
    layers = {
        "fc1": LayerStatistics(A=A1, G=G1, diag=torch.ones(3, 4, dtype=F64)),
        "fc2": LayerStatistics(A=A2, G=G2, diag=torch.ones(2, 5, dtype=F64)),
    }
    infos = {
        "fc1": LayerInfo("fc1", "linear", 3, 4, True, (3, 3)),
        "fc2": LayerInfo("fc2", "linear", 2, 5, True, (2, 4)),
    }
    return CurvatureStatistics(layers=layers, infos=infos, count=M)


def test_reconstruction_of_averaged_factors():
    stats = _stats(M=7)
    basis = eigenbasis(stats)
    assert isinstance(basis, Eigenbasis) and list(basis) == ["fc1", "fc2"]
    for name, ls in stats.layers.items():
        b = basis[name]
        assert b.U_A.dtype == F64 and b.S_A.dtype == F64
        torch.testing.assert_close(b.U_A @ torch.diag(b.S_A) @ b.U_A.T, ls.A / 7, atol=TOL * float(ls.A.abs().max()), rtol=0)
        torch.testing.assert_close(b.U_G @ torch.diag(b.S_G) @ b.U_G.T, ls.G / 7, atol=TOL * float(ls.G.abs().max()), rtol=0)
        torch.testing.assert_close(b.U_A.T @ b.U_A, torch.eye(b.U_A.shape[0], dtype=F64), atol=1e-12, rtol=0)
        assert (b.S_A >= 0).all() and (b.S_G >= 0).all()
        assert torch.all(b.S_A[1:] >= b.S_A[:-1])  # ascending


def test_float32_factors_are_decomposed_in_float64():
    A = _psd(4).float()
    U, S, _ = factor_eigh(A)
    assert U.dtype == F64 and S.dtype == F64


def test_asymmetric_input_is_symmetrised():
    A = _psd(4)
    skew = torch.triu(torch.ones(4, 4, dtype=F64), 1) * 1e-3
    U, S, _ = factor_eigh(A + skew - skew.T)  # skew-symmetric part is dropped
    torch.testing.assert_close(U @ torch.diag(S) @ U.T, A, atol=1e-12 * float(A.abs().max()), rtol=0)


def test_tiny_negative_eigenvalues_are_clamped_and_counted():
    g = torch.Generator().manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(5, 5, generator=g, dtype=F64))
    S_true = torch.tensor([-1e-9, -1e-10, 0.5, 1.0, 2.0], dtype=F64)  # two round-off negatives
    A = Q @ torch.diag(S_true) @ Q.T
    U, S, clamped = factor_eigh(A, name="layer.A")
    assert clamped == 2
    assert (S >= 0).all() and S[0] == 0 and S[1] == 0
    lb = layer_eigenbasis(A * 3, _psd(2) * 3, 3, name="conv1")
    assert lb.clamped == 2


def test_eigenbasis_total_clamped_is_the_sum_over_layers():
    stats = _stats()
    g = torch.Generator().manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(4, 4, generator=g, dtype=F64))
    A_bad = Q @ torch.diag(torch.tensor([-1e-10, 1.0, 2.0, 3.0], dtype=F64)) @ Q.T * stats.count
    layers = dict(stats.layers)
    layers["fc1"] = LayerStatistics(A=A_bad, G=layers["fc1"].G, diag=layers["fc1"].diag)
    basis = eigenbasis(CurvatureStatistics(layers=layers, infos=stats.infos, count=stats.count))
    assert basis.clamped["fc1"] == 1 and basis.total_clamped() == 1 + basis.clamped["fc2"]


def test_nan_factor_raises_with_layer_name():
    stats = _stats()
    A = stats.layers["fc2"].A.clone()
    A[1, 1] = float("nan")
    layers = dict(stats.layers)
    layers["fc2"] = LayerStatistics(A=A, G=layers["fc2"].G, diag=layers["fc2"].diag)
    with pytest.raises(ValueError, match=r"fc2\.A: Kronecker factor contains NaN or Inf"):
        eigenbasis(CurvatureStatistics(layers=layers, infos=stats.infos, count=stats.count))


def test_clearly_non_psd_factor_raises():
    G = torch.diag(torch.tensor([1.0, -0.5, 2.0], dtype=F64))
    with pytest.raises(ValueError, match=r"conv3\.G: Kronecker factor is not positive semi-definite"):
        layer_eigenbasis(_psd(4), G, 1, name="conv3")


def test_zero_count_raises():
    with pytest.raises(ValueError, match="zero examples"):
        layer_eigenbasis(_psd(3), _psd(2), 0, name="fc")


def test_flat_round_trip():
    basis = eigenbasis(_stats())
    back = Eigenbasis.from_flat(basis.flat_tensors(), list(basis), basis.clamped)
    for k in basis:
        for f in ("U_A", "S_A", "U_G", "S_G"):
            assert torch.equal(getattr(back[k], f), getattr(basis[k], f))


def test_eigh_that_fails_to_converge_is_retried_with_a_tiny_shift(monkeypatch):
    """LAPACK can fail on rank-deficient factors with many repeated zero eigenvalues; the
    retry on A + δI gives the eigenvectors and δ-corrected eigenvalues of A."""
    import importlib

    eb = importlib.import_module("laplace_core.basis.eigenbasis")

    g = torch.Generator().manual_seed(0)
    X = torch.randn(3, 6, generator=g, dtype=torch.float64)
    A = X.T @ X  # rank 3 of 6
    real = torch.linalg.eigh
    calls = []

    def flaky(mat, *a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
        return real(mat, *a, **k)

    monkeypatch.setattr(eb.torch.linalg, "eigh", flaky)
    U, S, _ = eb.factor_eigh(A, name="conv1.A")
    assert len(calls) == 2
    assert torch.allclose(U @ torch.diag(S) @ U.T, A, atol=1e-9)

    def broken(mat, *a, **k):
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")

    monkeypatch.setattr(eb.torch.linalg, "eigh", broken)
    with pytest.raises(ValueError, match="conv1.A: eigendecomposition failed to converge"):
        eb.factor_eigh(A, name="conv1.A")
