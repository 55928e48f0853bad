"""GLM predictive (laplace_core.predictive.glm) against dense float64 ground truth.

Dense reference: the explicit Jacobian ``J`` (``torch.func.jacrev`` over the weights,
rearranged into ``vec(W~)`` order per layer, independent of the hooks) and the dense
covariance (block-diagonal inverse of ``to_dense()`` per layer; subnet: the ``S x S``
inverse embedded at the selected positions). Checked for every structure on a
regression MLP, a classifier MLP and a small conv classifier:

* ``glm_covariance`` (closed forms and the generic route) == ``J Σ J^T`` (1e-10);
* Banerjee eq. 15 (``kfac_glm_covariance``) == dense;
* ``covariance_matvec`` == dense inverse; ``glm_jvp`` == ``J δ``;
* MC-GLM with 20,000 samples converges to ``J Σ J^T`` (scale-normalised tolerance);
* the finite-difference variant converges as ε → 0.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from laplace_core.curvature.collect import collect_statistics
from laplace_core.basis.eigenbasis import eigenbasis
from laplace_core.predictive.glm import (
    GLMPredictor, glm_covariance, glm_fd, glm_jvp, kfac_glm_covariance,
    probit_pairwise, probit_pi8,
)
from laplace_core.curvature.layers import find_layers
from laplace_core.posteriors.build import build_posterior
from laplace_core.predictive.monte_carlo import draw_sample
from laplace_core.posteriors.structures.base import unvec, vec
from laplace_core.curvature.subnet_fisher import collect_subnet_fisher
from laplace_core.posteriors.subnet import build_subnet_posterior, select_subnetwork

F64 = torch.float64
EXACT_TOL = 1e-10      # relative to max |J Σ J^T|
MC_TOL = 0.05          # max |Ĉ − C| / max diag C, 20,000 MC-GLM samples (std. error ≈ sqrt(2/K) ≈ 0.01)
MC_SAMPLES = 20_000
METHODS = ("diag", "kfac", "kfac_exact", "efb", "inf", "subnet")


# --------------------------------------------------------------------------- problems
def _mlp(d_in, h, d_out, seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, h), nn.Tanh(), nn.Linear(h, h - 1), nn.Tanh(), nn.Linear(h - 1, d_out)).to(F64).eval()


def _conv(seed):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 2, 2, stride=2), nn.Tanh(), nn.Flatten(),
        nn.Linear(2 * 2 * 2, 3),
    ).to(F64).eval()


PROBLEMS = {
    # name: (model factory, input shape, likelihood)
    "regression": (lambda: _mlp(2, 5, 2, 0), (2,), "regression"),
    "classifier": (lambda: _mlp(3, 5, 4, 1), (3,), "classification"),
    "conv": (lambda: _conv(2), (2, 4, 4), "classification"),
}


def _data(shape, n, seed, likelihood, model):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g, dtype=F64)
    with torch.no_grad():
        out = model(x)
    if likelihood == "regression":
        y = out + torch.randn(out.shape, generator=g, dtype=F64)
    else:
        y = torch.randint(0, out.shape[1], (n,), generator=g)
    return x, y


def _posterior(problem, method):
    make, shape, lik = PROBLEMS[problem]
    model = make()
    x, y = _data(shape, 24, 10, lik, model)
    batches = [(x[:12], y[:12]), (x[12:], y[12:])]
    if method == "subnet":
        stats = collect_statistics(model, batches, generator=torch.Generator().manual_seed(0), likelihood=lik)
        D = sum(info.numel for info in stats.infos.values())
        masks = select_subnetwork(stats, D // 2, prior_precision=0.7)
        F, count = collect_subnet_fisher(model, batches, masks, fisher="ggn", likelihood=lik)
        post = build_subnet_posterior(F, count, masks, n_data=30.0, prior_precision=0.7)
    else:
        stats = collect_statistics(model, batches, generator=torch.Generator().manual_seed(0), likelihood=lik)
        if method in ("efb", "inf"):
            stats = collect_statistics(model, batches, generator=torch.Generator().manual_seed(0), likelihood=lik,
                                       basis=eigenbasis(stats))
        post = build_posterior(stats, method, rank=3 if method == "inf" else None, n_data=30.0, prior_precision=0.7)
    xt, _ = _data(shape, 5, 99, lik, model)
    return model, post, xt


def dense_jacobian(model, x, names):
    """``J`` as ``[B, C, D]`` with layers in ``names`` order, each in vec(W~) order (jacrev)."""
    modules = find_layers(model)[0]
    params = {k: v.detach() for k, v in model.named_parameters()}
    jac = jacrev(lambda p: functional_call(model, p, (x,)))(params)
    blocks = []
    for name in names:
        mod = modules[name]
        B, C = jac[f"{name}.weight"].shape[:2]
        w = jac[f"{name}.weight"].reshape(B, C, mod.weight.shape[0], -1)
        if mod.bias is not None:
            w = torch.cat([w, jac[f"{name}.bias"].reshape(B, C, -1, 1)], dim=3)
        blocks.append(vec(w))
    return torch.cat(blocks, dim=2)


def dense_covariance(post):
    """``Σ`` (D x D) in the same layer / vec order as :func:`dense_jacobian`."""
    if post.method == "subnet":
        D = post.d_total
        idx = torch.cat([lp.index + off for lp, off in zip(post.layers.values(), _offsets(post))])
        full = torch.zeros(D, D, dtype=F64)
        full[idx[:, None], idx[None, :]] = torch.linalg.inv(post.to_dense())
        return full
    return torch.block_diag(*[torch.linalg.inv(lp.to_dense()) for lp in post.layers.values()])


def _offsets(post):
    out, o = [], 0
    for lp in post.layers.values():
        out.append(o)
        o += lp.shape[0] * lp.shape[1]
    return out


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


# --------------------------------------------------------------------------- exact
@pytest.mark.parametrize("problem", list(PROBLEMS))
@pytest.mark.parametrize("method", METHODS)
def test_glm_covariance_equals_dense(problem, method):
    model, post, x = _posterior(problem, method)
    J = dense_jacobian(model, x, list(post.layers))
    want = J @ dense_covariance(post) @ J.transpose(1, 2)
    got = glm_covariance(model, post, x)
    generic = glm_covariance(model, post, x, closed_form=False)
    assert got.shape == want.shape
    assert _rel(got, want) < EXACT_TOL, (problem, method, _rel(got, want))
    assert _rel(generic, want) < EXACT_TOL, (problem, method)
    # small chunks give the same numbers
    assert _rel(glm_covariance(model, post, x, max_elements=1), want) < EXACT_TOL


@pytest.mark.parametrize("problem", ["regression", "classifier"])
def test_kfac_closed_form_eq15_equals_dense(problem):
    model, post, x = _posterior(problem, "kfac")
    J = dense_jacobian(model, x, list(post.layers))
    want = J @ dense_covariance(post) @ J.transpose(1, 2)
    assert _rel(kfac_glm_covariance(model, post, x), want) < EXACT_TOL
    conv_model, conv_post, cx = _posterior("conv", "kfac")
    with pytest.raises(ValueError, match="eq. 15 needs"):
        kfac_glm_covariance(conv_model, conv_post, cx)


@pytest.mark.parametrize("method", ["diag", "kfac", "kfac_exact", "efb", "inf"])
def test_covariance_matvec_equals_dense_inverse(method):
    _, post, _ = _posterior("conv", method)
    for name, lp in post.layers.items():
        m, n = lp.shape
        eye = torch.eye(m * n, dtype=F64)
        cols = lp.covariance_matvec(unvec(eye, m, n))  # (mn, m, n): column i = Σ e_i
        C = vec(cols).T
        want = torch.linalg.inv(lp.to_dense())
        assert _rel(C, want) < EXACT_TOL, (method, name)
        # consistent with the sampler's factor: Σ = F F^T
        F = vec(lp.scale_matvec(unvec(eye, m, n))).T
        assert _rel(F @ F.T, C) < EXACT_TOL
        # the base-class dense default agrees
        from laplace_core.posteriors.structures.base import LayerPosterior
        assert _rel(vec(LayerPosterior.covariance_matvec(lp, unvec(eye, m, n))).T, want) < EXACT_TOL


@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_glm_jvp_equals_dense_jacobian_product(problem):
    model, post, x = _posterior(problem, "kfac")
    J = dense_jacobian(model, x, list(post.layers))
    deltas = post.sample(3, torch.Generator().manual_seed(4))
    flat = torch.cat([vec(deltas[k]) for k in post.layers], dim=1)  # (3, D)
    want = torch.einsum("bcd,kd->kbc", J, flat)
    out, got = glm_jvp(model, x, deltas, return_output=True)
    assert _rel(got, want) < EXACT_TOL
    one = glm_jvp(model, x, {k: v[1] for k, v in deltas.items()})
    assert _rel(one, want[1]) < EXACT_TOL
    with torch.no_grad():
        assert torch.equal(out, model(x))
    # a subset of layers: the others get a zero direction
    first = next(iter(post.layers))
    D0 = post.layers[first].shape[0] * post.layers[first].shape[1]
    part = glm_jvp(model, x, {first: deltas[first][0]})
    assert _rel(part, J[:, :, :D0] @ flat[0, :D0]) < EXACT_TOL


# --------------------------------------------------------------------------- Monte Carlo
@pytest.mark.parametrize("method", METHODS)
def test_mc_glm_converges_to_exact(method):
    """Alg. 4 estimator ``(1/K) Σ_t (J η_t)(J η_t)^T`` with ``η_t`` from the posterior's own
    sampler, drawn in one call here (the predictor's keyed draws are the same map, checked in
    :func:`test_mc_directions_are_keyed_samples`; 20,000 keyed draws would take ~20 s)."""
    model, post, x = _posterior("classifier", method)
    exact = glm_covariance(model, post, x)
    eta = post.sample(MC_SAMPLES, torch.Generator().manual_seed(3))
    mean, jv = glm_jvp(model, x, eta, return_output=True)  # (K, B, C)
    cov = torch.einsum("kbc,kbd->bcd", jv, jv) / MC_SAMPLES
    scale = torch.diagonal(exact, dim1=1, dim2=2).max()
    err = float((cov - exact).abs().max() / scale)
    assert err < MC_TOL, (method, err)
    # the sample mean of the linearised logits is the MAP output (up to MC error)
    assert float(jv.mean(0).abs().max() / scale.sqrt()) < 5 / math.sqrt(MC_SAMPLES)  # 5 standard errors
    with torch.no_grad():
        assert torch.equal(mean, model(x))
    # the predictor's MC variance uses the same estimator
    pred = GLMPredictor(model, post, n_samples=200, seed=3, chunk=100)
    m2, c2 = pred.logit_moments(x)
    _, jv2 = pred.logit_directions(x)
    assert _rel(c2, torch.einsum("kbc,kbd->bcd", jv2, jv2) / 200) < 1e-12 and torch.equal(m2, mean)


def test_mc_directions_are_keyed_samples():
    """``η_t`` is ``draw_sample(posterior, seed, t)``: the same weights MCPredictor uses."""
    model, post, x = _posterior("classifier", "inf")
    pred = GLMPredictor(model, post, n_samples=3, seed=8, chunk=2)
    _, jv = pred.logit_directions(x)
    for t in range(3):
        assert _rel(jv[t], glm_jvp(model, x, draw_sample(post, 8, t))) < EXACT_TOL
    # batch composition does not matter
    p_all = pred.predict(x)
    p_parts = pred.predict_batches([x[:2], x[2:]])
    assert _rel(torch.cat(p_parts), p_all) < 1e-12


def test_finite_difference_variant_converges():
    model, post, x = _posterior("classifier", "kfac")
    eta = draw_sample(post, 0, 0)
    exact = glm_jvp(model, x, eta)
    errs = [float((glm_fd(model, x, eta, eps) - exact).abs().max() / exact.abs().max()) for eps in (1e-1, 1e-2, 1e-3)]
    assert errs[0] > errs[1] > errs[2], errs
    assert errs[2] < 1e-2, errs
    # through the predictor: FD directions with a small step match the JVP ones
    jvp_pred = GLMPredictor(model, post, n_samples=4, seed=1)
    fd_pred = GLMPredictor(model, post, n_samples=4, seed=1, fd_eps=1e-4)
    _, a = jvp_pred.logit_directions(x)
    _, b = fd_pred.logit_directions(x)
    assert _rel(b, a) < 1e-3


# --------------------------------------------------------------------------- links
def test_probit_links():
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(6, 2, generator=g, dtype=F64)
    A = torch.randn(6, 2, 2, generator=g, dtype=F64)
    cov = A @ A.transpose(1, 2)
    p = probit_pairwise(mean, cov)
    v = cov[:, 0, 0] + cov[:, 1, 1] - 2 * cov[:, 0, 1]
    want1 = torch.sigmoid((mean[:, 1] - mean[:, 0]) / torch.sqrt(1 + math.pi / 8 * v))
    assert torch.allclose(p[:, 1], want1, atol=1e-14) and torch.allclose(p.sum(1), torch.ones(6, dtype=F64))
    # binary probit approximation vs Gauss-Hermite quadrature of E[sigmoid(z)]: within its known error
    t, w = _gauss_hermite(80)
    mu, sd = (mean[:, 1] - mean[:, 0]), v.sqrt()
    quad = (torch.sigmoid(mu[:, None] + math.sqrt(2) * sd[:, None] * t[None]) * w[None]).sum(1) / math.sqrt(math.pi)
    assert float((p[:, 1] - quad).abs().max()) < 0.02
    # probit_pi8 formula; zero variance gives the MAP softmax for both links
    var = torch.rand(6, 2, generator=g, dtype=F64)
    assert torch.allclose(probit_pi8(mean, var), torch.softmax(mean / torch.sqrt(1 + math.pi / 8 * var), -1))
    zero = torch.zeros(6, 2, 2, dtype=F64)
    assert torch.allclose(probit_pairwise(mean, zero), torch.softmax(mean, -1), atol=1e-14)
    assert torch.allclose(probit_pi8(mean, torch.zeros(6, 2, dtype=F64)), torch.softmax(mean, -1))


def _gauss_hermite(n):
    import numpy as np

    t, w = np.polynomial.hermite.hermgauss(n)
    return torch.from_numpy(t), torch.from_numpy(w)


@pytest.mark.parametrize("link", ["probit", "probit_pi8"])
def test_probit_predictor_close_to_mc_glm(link):
    model, post, x = _posterior("classifier", "kfac")
    mc = GLMPredictor(model, post, n_samples=1000, seed=0, link="mc", chunk=500).predict(x)
    exact = GLMPredictor(model, post, link=link, variance="exact").predict(x)
    mcvar = GLMPredictor(model, post, n_samples=1000, seed=0, link=link, variance="mc", chunk=500).predict(x)
    assert torch.allclose(exact.sum(1), torch.ones(len(x), dtype=F64))
    assert float((exact - mc).abs().max()) < 0.05, link      # approximation error of the probit links
    assert float((mcvar - exact).abs().max()) < 0.02, link   # MC variance estimate vs exact


def test_regression_mean_and_variance():
    model, post, x = _posterior("regression", "efb")
    pred = GLMPredictor(model, post, likelihood="regression", variance="exact")
    mean, var = pred.predict_mean_var(x)
    with torch.no_grad():
        assert torch.equal(pred.predict(x), model(x)) and torch.equal(mean, model(x))
    exact = glm_covariance(model, post, x)
    assert torch.allclose(var, torch.diagonal(exact, dim1=1, dim2=2))


def test_bad_arguments():
    model, post, x = _posterior("classifier", "diag")
    with pytest.raises(ValueError, match="unknown GLM link"):
        GLMPredictor(model, post, link="bridge")
    with pytest.raises(ValueError, match="unknown GLM variance"):
        GLMPredictor(model, post, variance="laplace")
    with pytest.raises(ValueError, match="needs variance='mc'"):
        GLMPredictor(model, post, link="mc", variance="exact")
    with pytest.raises(ValueError, match="fd_eps"):
        GLMPredictor(model, post, fd_eps=0.0)
    with pytest.raises(ValueError, match="delta for unknown layer"):
        glm_jvp(model, x, {"nope": torch.zeros(2, 2, dtype=F64)})
    name = next(iter(post.layers))
    with pytest.raises(ValueError, match="delta must be"):
        glm_jvp(model, x, {name: torch.zeros(2, 2, dtype=F64)})
    other = _mlp(3, 6, 4, 0)
    with pytest.raises(ValueError, match="shape"):
        GLMPredictor(other, post)
    with pytest.raises(ValueError, match="posterior layers not found"):
        glm_covariance(nn.Sequential(nn.Linear(3, 4)).to(F64), post, x)


def test_the_first_jvp_of_a_process_writes_no_torch_warning():
    """A job that searches the GLM predictive logs no torch FutureWarning (``torch.jit.script`` is
    deprecated, raised by the first ``torch.func.jvp`` of a process): a fresh interpreter, warnings
    as errors. The same call without the guard does warn there, so the check can fail."""
    import subprocess
    import sys

    code = ("import torch; from torch import nn; from laplace_core.predictive.glm import glm_jvp; "
            "net = nn.Sequential(nn.Flatten(), nn.Linear(12, 3)); "
            "print(tuple(glm_jvp(net, torch.randn(2, 3, 2, 2), {'1': torch.randn(3, 13)}).shape))")
    res = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "(2, 3)", res.stderr[-2000:]
    bare = code.replace("glm_jvp(net, torch.randn(2, 3, 2, 2), {'1': torch.randn(3, 13)})",
                        "torch.func.jvp(lambda x: net(x), (torch.randn(2, 3, 2, 2),), (torch.randn(2, 3, 2, 2),))[1]")
    res = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-c", bare], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode != 0 and "torch.jit.script" in res.stderr, (res.stdout, res.stderr[-1000:])
