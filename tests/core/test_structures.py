"""Posterior structures against dense float64 ground truth (docs/design.md §1).

For every method on small layers: ``F F^T`` (F built by applying ``scale_matvec`` to
the identity's columns) equals the dense inverse of ``to_dense()``; ``precision_matvec``
agrees with ``to_dense()``; ``marginal_variance`` equals ``diag`` of the dense inverse;
sample covariances match; KFAC's dense form equals ``torch.kron`` of its factors.
The INF sampler's memory stays flat on a layer where an (mn) x L matrix would not fit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from laplace_core.basis.eigenbasis import layer_eigenbasis
from laplace_core.posteriors.build import METHODS, Method, build_posterior, with_hyper
from laplace_core.curvature.statistics import CurvatureStatistics, LayerInfo, LayerStatistics
from laplace_core.posteriors.structures.base import unvec, vec
from laplace_core.posteriors.structures.inf import DP_FLOOR, InfLayer
from laplace_core.posteriors.structures.registry import LAYER_CLASSES, layer_class

F64 = torch.float64
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXACT_TOL = 1e-10          # F F^T vs dense inverse, relative to max |C|
MC_TOL = 0.05              # max |C_hat - C| / max diag C for 20,000 samples
MC_SAMPLES = 20_000


def synthetic_stats(shapes=None, M=40, T=3, seed=0, with_efb=True) -> CurvatureStatistics:
    """Statistics of ``M`` examples with conv-like per-example gradients
    ``d_k = Σ_t g_{k,t} a_{k,t}^T`` (T positions), so the Fisher is not Kronecker.
    ``A = Σ a a^T / T``, ``G = Σ g g^T``, ``diag = Σ d∘d``, ``efb = Σ (U_G^T d U_A)^2``."""
    shapes = shapes or {"fc1": (4, 3), "fc2": (3, 5)}
    gen = torch.Generator().manual_seed(seed)
    layers, infos, grads = {}, {}, {}
    for name, (m, n) in shapes.items():
        a = torch.randn(M, T, n, generator=gen, dtype=F64) * torch.linspace(0.3, 2.0, n, dtype=F64)
        g = torch.randn(M, T, m, generator=gen, dtype=F64) * torch.linspace(0.5, 1.5, m, dtype=F64)
        d = torch.einsum("ktm,ktn->kmn", g, a)
        A = torch.einsum("kti,ktj->ij", a, a) / T
        G = torch.einsum("kti,ktj->ij", g, g)
        layers[name] = LayerStatistics(A=A, G=G, diag=(d * d).sum(0))
        infos[name] = LayerInfo(name, "linear", m, n, True, (m, n - 1))
        grads[name] = d
    stats = CurvatureStatistics(layers=layers, infos=infos, count=M)
    if with_efb:
        efb = {}
        for name, ls in layers.items():
            b = layer_eigenbasis(ls.A, ls.G, M, name=name)
            efb[name] = ((b.U_G.T @ grads[name] @ b.U_A) ** 2).sum(0)
        stats = stats.with_efb(efb, M)
    return stats


def dense_scale(lp) -> torch.Tensor:
    """``F`` as an (mn) x (mn) matrix in vec order, from ``scale_matvec`` on the identity."""
    m, n = lp.shape
    eye = torch.eye(m * n, dtype=F64)
    Z = unvec(eye.T, m, n)  # (mn, m, n): column i of the identity, as W~-shaped
    return vec(lp.scale_matvec(Z)).T


CASES = [("diag", None), ("kfac", None), ("kfac_exact", None), ("efb", None),
         ("inf", None), ("inf", 1), ("inf", 3), ("inf", 7)]


@pytest.fixture(scope="module")
def stats():
    return synthetic_stats()


@pytest.mark.parametrize("method,rank", CASES)
def test_scale_factor_is_exact(stats, method, rank):
    post = build_posterior(stats, method, rank=rank, n_data=120.0, prior_precision=0.7)
    for name, lp in post.layers.items():
        P = lp.to_dense()
        C = torch.linalg.inv(P)
        F = dense_scale(lp)
        err = (F @ F.T - C).abs().max() / C.abs().max()
        assert err < EXACT_TOL, (name, float(err))


@pytest.mark.parametrize("method,rank", CASES)
def test_precision_matvec_and_marginal_variance(stats, method, rank):
    post = build_posterior(stats, method, rank=rank, n_data=60.0, prior_precision=0.3)
    gen = torch.Generator().manual_seed(1)
    for name, lp in post.layers.items():
        m, n = lp.shape
        P = lp.to_dense()
        assert torch.allclose(P, P.T, atol=1e-12)
        V = torch.randn(5, m, n, generator=gen, dtype=F64)
        got = vec(lp.precision_matvec(V))
        want = vec(V) @ P.T
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-10 * float(P.abs().max())), name
        # unbatched input gives the same answer as the batch
        assert torch.allclose(lp.precision_matvec(V[0]), lp.precision_matvec(V)[0], rtol=1e-12, atol=1e-12)
        var = lp.marginal_variance()
        assert var.shape == (m, n)
        want_var = unvec(torch.diagonal(torch.linalg.inv(P)), m, n)
        assert torch.allclose(var, want_var, rtol=1e-9, atol=0), name


def test_kfac_dense_is_kron_of_factors(stats):
    N, tau = 80.0, 0.5
    post = build_posterior(stats, "kfac", n_data=N, prior_precision=tau)
    for name, ls in stats.layers.items():
        M = stats.count
        Ap = N ** 0.5 * ls.A / M + tau ** 0.5 * torch.eye(ls.A.shape[0], dtype=F64)
        Gp = N ** 0.5 * ls.G / M + tau ** 0.5 * torch.eye(ls.G.shape[0], dtype=F64)
        assert torch.allclose(post.to_dense(name), torch.kron(Ap, Gp), rtol=1e-10, atol=1e-10)


def test_exact_prior_kfac_and_efb_dense_forms(stats):
    """kfac_exact = N (A/M ⊗ G/M) + τ I; efb = U diag(N efb/M + τ) U^T; diag = N diag/M + τ."""
    N, tau, M = 80.0, 0.5, stats.count
    pk = build_posterior(stats, "kfac_exact", n_data=N, prior_precision=tau)
    pe = build_posterior(stats, "efb", n_data=N, prior_precision=tau)
    pd = build_posterior(stats, "diag", n_data=N, prior_precision=tau)
    for name, ls in stats.layers.items():
        eye = torch.eye(ls.diag.numel(), dtype=F64)
        assert torch.allclose(pk.to_dense(name), N * torch.kron(ls.A / M, ls.G / M) + tau * eye, atol=1e-10)
        b = layer_eigenbasis(ls.A, ls.G, M)
        U = torch.kron(b.U_A, b.U_G)
        want = U @ torch.diag(vec(N * ls.efb / stats.efb_count + tau)) @ U.T
        assert torch.allclose(pe.to_dense(name), want, atol=1e-10)
        assert torch.allclose(pd.to_dense(name), torch.diag(vec(N * ls.diag / M + tau)), atol=1e-12)


def test_inf_full_rank_precision_is_efb_plus_diagonal_correction(stats):
    """Full-rank INF = EFB precision + diag(N D), D = diag/M - diag(EFB/M), with N D + τ
    raised to DP_FLOOR (N diag/M + τ) where it would fall below (at N = 5e4 some entries are)."""
    tau = 0.2
    for N in (50.0, 5e4):
        pe = build_posterior(stats, "efb", n_data=N, prior_precision=tau)
        pi = build_posterior(stats, "inf", n_data=N, prior_precision=tau)
        clipped = 0
        for name, ls in stats.layers.items():
            Pe = pe.to_dense(name)
            D = vec(ls.diag / stats.count) - (torch.diagonal(Pe) - tau) / N
            floor = DP_FLOOR * (N * vec(ls.diag / stats.count) + tau)
            clipped += int((N * D + tau < floor).sum())
            want = Pe - tau * torch.eye(len(D), dtype=Pe.dtype) + torch.diag(torch.maximum(N * D + tau, floor))
            assert torch.allclose(pi.to_dense(name), want, rtol=1e-10, atol=1e-10)
        assert pi.info["clipped_D"] == clipped
        if N > 1e3:
            assert clipped > 0


@pytest.mark.parametrize("method,rank", [("diag", None), ("kfac", None), ("kfac_exact", None), ("efb", None),
                                         ("inf", None), ("inf", 2)])
def test_sample_covariance(stats, method, rank):
    post = build_posterior(stats, method, rank=rank, n_data=40.0, prior_precision=1.0)
    gen = torch.Generator().manual_seed(123)
    draws = post.sample(MC_SAMPLES, gen)
    for name, lp in post.layers.items():
        x = vec(draws[name])  # (S, mn)
        assert x.shape == (MC_SAMPLES, lp.shape[0] * lp.shape[1])
        C_hat = x.T @ x / MC_SAMPLES  # zero-mean by construction
        C = torch.linalg.inv(lp.to_dense())
        err = (C_hat - C).abs().max() / torch.diagonal(C).max()
        assert err < MC_TOL, (name, float(err))
    # same generator state -> same samples
    again = post.sample(3, torch.Generator().manual_seed(5))
    assert all(torch.equal(v, post.sample(3, torch.Generator().manual_seed(5))[k]) for k, v in again.items())


def test_num_stored_table3(stats):
    rank = 3
    for method in METHODS:
        post = build_posterior(stats, method, rank=rank if method == "inf" else None)
        total = 0
        for name, lp in post.layers.items():
            m, n = lp.shape
            if method == "diag":
                want = m * n
            elif method == "kfac":
                want = n * n + m * m
            elif method in ("efb", "kfac_exact"):
                want = n * n + m * m + m * n
            else:
                nI, nJ = lp.lam_L.shape
                assert nI * nJ >= rank
                want = nI * m + nJ * n + nI * nJ + m * n
            assert lp.num_stored() == want, (method, name)
            total += want
        assert post.num_stored() == total


@pytest.mark.parametrize("method,rank", CASES)
def test_to_device_keeps_every_tensor_and_setting(stats, method, rank):
    """``Posterior.to``: same class, hyperparameters and tensors (here CPU -> CPU and float64 kept;
    CUDA in tests/core/test_device.py). The draws from equal generator states are equal."""
    post = build_posterior(stats, method, rank=rank, n_data=10.0, prior_precision=2.0)
    moved = post.to("cpu")
    assert type(moved) is type(post) and moved is not post
    assert (moved.method, moved.n_data, moved.prior_precision, moved.rank) == (method, 10.0, 2.0, rank)
    a, b = post.state_dict()["tensors"], moved.state_dict()["tensors"]
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    da = post.sample(2, torch.Generator().manual_seed(4))
    db = moved.sample(2, torch.Generator().manual_seed(4))
    assert all(torch.equal(da[k], db[k]) for k in da)


@pytest.mark.parametrize("method,rank", CASES)
def test_with_hyper_equals_fresh_build(stats, method, rank):
    base = build_posterior(stats, method, rank=rank, n_data=10.0, prior_precision=2.0)
    moved = with_hyper(base, 77.0, 0.25)
    fresh = build_posterior(stats, method, rank=rank, n_data=77.0, prior_precision=0.25)
    assert (moved.n_data, moved.prior_precision) == (77.0, 0.25)
    for name in fresh.layers:
        assert torch.allclose(moved.to_dense(name), fresh.to_dense(name), rtol=1e-12, atol=1e-12)
        F = dense_scale(moved.layers[name])
        C = torch.linalg.inv(fresh.to_dense(name))
        assert (F @ F.T - C).abs().max() / C.abs().max() < EXACT_TOL


def test_registry_and_method_enum():
    assert set(METHODS) == {m.value for m in Method} == set(LAYER_CLASSES)
    for name, cls in LAYER_CLASSES.items():
        assert cls.method == name and layer_class(name) is cls
    with pytest.raises(ValueError, match="valid: .*inf"):
        layer_class("nope")


def test_bad_inputs_give_clear_errors(stats):
    with pytest.raises(ValueError, match="unknown posterior method"):
        build_posterior(stats, "laplace")
    with pytest.raises(ValueError, match="rank= applies only"):
        build_posterior(stats, "efb", rank=3)
    with pytest.raises(ValueError, match="rank must be a positive int"):
        build_posterior(stats, "inf", rank=0)
    with pytest.raises(ValueError, match="n_data"):
        build_posterior(stats, "diag", n_data=0)
    with pytest.raises(ValueError, match="prior_precision"):
        build_posterior(stats, "diag", prior_precision=-1.0)
    with pytest.raises(ValueError, match="second pass"):
        build_posterior(synthetic_stats(with_efb=False), "inf")
    zero = synthetic_stats(shapes={"z": (3, 2)})
    zero = CurvatureStatistics(
        layers={"z": LayerStatistics(A=zero.layers["z"].A, G=torch.zeros(3, 3, dtype=F64),
                                     diag=torch.zeros(3, 2, dtype=F64), efb=torch.zeros(3, 2, dtype=F64))},
        infos=zero.infos, count=zero.count, efb_count=zero.efb_count)
    for method in METHODS:  # zero curvature and tau = 0: not positive definite
        with pytest.raises(ValueError, match="layer 'z'.*not positive definite"):
            build_posterior(zero, method, prior_precision=0.0)
    with pytest.raises(ValueError, match="layer 'fc1'.*above max_l=10.*pass rank="):
        build_posterior(stats, "inf", max_l=10)  # full rank keeps 4*3 = 12 > 10
    with pytest.raises(ValueError, match="above max_l=10.*pass a smaller rank="):
        build_posterior(stats, "inf", rank=12, max_l=10)
    lp = build_posterior(stats, "diag").layers["fc1"]
    with pytest.raises(ValueError, match="expected a tensor of shape"):
        lp.scale_matvec(torch.zeros(3, 4, dtype=F64))


def test_tau_zero_allowed_when_positive_definite(stats):
    post = build_posterior(stats, "efb", prior_precision=0.0)
    for lp in post.layers.values():
        assert torch.linalg.eigvalsh(lp.to_dense()).min() > 0


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch
    from laplace_core.posteriors.structures.inf import InfLayer

    def peak_kib():
        # VmHWM: this process image's peak RSS. (ru_maxrss survives execve on Linux, so it
        # would report the forking parent's -- pytest's -- RSS instead.)
        try:
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    base = peak_kib()
    m, n, nI, nJ = 2048, 4097, 10, 15
    dt = torch.float32
    g = torch.Generator().manual_seed(0)
    U_g = torch.linalg.qr(torch.randn(m, nI, generator=g, dtype=torch.float64))[0].to(dt)
    U_a = torch.linalg.qr(torch.randn(n, nJ, generator=g, dtype=torch.float64))[0].to(dt)
    lam = torch.rand(nI, nJ, generator=g, dtype=dt)
    D = torch.rand(m, n, generator=g, dtype=dt)
    lp = InfLayer(U_g, U_a, lam, D, 1000.0, 1.0)
    z = torch.randn(m, n, generator=g, dtype=dt)
    x = lp.scale_matvec(z)
    ok = bool(torch.isfinite(x).all())
    json.dump({"peak_kib": peak_kib(), "import_kib": base,
               "finite": ok, "L": lp.rank, "shape": list(x.shape)}, sys.stdout)
""")


def test_inf_sampler_memory_is_flat():
    """A dense (mn) x L float32 operator here would take 2048*4097*150*4 B = 4.7 GiB;
    the vec-trick sampler runs in a process whose peak RSS stays under 1 GiB."""
    m, n, L = 2048, 4097, 150
    assert m * n * L * 4 > 4 * 2**30
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert res["finite"] and res["L"] == L and res["shape"] == [m, n]
    assert res["peak_kib"] * 1024 < 2**30, f"peak RSS {res['peak_kib'] / 1024:.0f} MiB"


def test_inf_layer_rejects_huge_L():
    U_g = torch.zeros(300, 200, dtype=F64)
    U_a = torch.zeros(300, 200, dtype=F64)
    with pytest.raises(ValueError, match="max_l"):
        InfLayer(U_g, U_a, torch.zeros(200, 200, dtype=F64), torch.ones(300, 300, dtype=F64), 1.0, 1.0)
