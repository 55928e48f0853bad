"""Subnetwork Laplace (laplace_core.posteriors.subnet, structures/subnet.py) against dense ground truth.

* selection: exactly the top-S diagonal-Laplace marginal variances (ties by position);
  random selection is seeded;
* the subnetwork Fisher equals the selected rows/columns of the exact full Fisher built
  from ``torch.func`` per-example gradients (tests/core/fisher_reference.py), for MC,
  empirical and GGN, classification and regression;
* with S = all weights, subnet Laplace equals full-covariance Laplace (dense);
* F F^T = P_S^{-1}, samples are zero outside the subnetwork, save/load round trips;
* the 1D two-cluster regression of Daxberger et al. §6.1 (in-between uncertainty): subnet
  (random half) > diagonal Laplace is asserted; Wasserstein > random is not reproduced with
  the paper's setup (xfail, with the measured mechanism asserted: dead-unit weights first);
  the opt-in ``wasserstein_live`` rule (same ranking over weights with a live Fisher
  diagonal) selects exactly a brute-force top-S over live weights, fills from the plain rule
  with a warning when too few are live, and on the §6.1 fixture beats random.
"""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from torch import nn

from laplace_core.curvature.collect import collect_statistics
from laplace_core.curvature.likelihoods import sample_targets
from laplace_core.predictive.glm import GLMPredictor, glm_covariance
from laplace_core.posteriors.structures.base import load_posterior
from laplace_core.curvature.keyed_rng import KeyedSampler
from laplace_core.curvature.layers import find_layers
from laplace_core.posteriors.build import build_posterior, with_hyper
from laplace_core.predictive.monte_carlo import MCPredictor
from laplace_core.curvature.statistics import CurvatureStatistics, LayerInfo, LayerStatistics
from laplace_core.posteriors.structures.base import Posterior, unvec, vec
from laplace_core.posteriors.structures.diag import DiagLayer
from laplace_core.posteriors.structures.subnet import SubnetPosterior
from laplace_core.curvature.subnet_fisher import (
    check_subnet_memory,
    collect_subnet_fisher,
    max_subnet_size,
    subnet_size,
)
from laplace_core.posteriors.subnet import (
    LIVE_RTOL,
    SELECTION_RULES,
    build_subnet_posterior,
    live_weights,
    marginal_variances,
    select_subnetwork,
    subnet_laplace,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fisher_reference import per_example_grads  # noqa: E402

F64 = torch.float64
EXACT_TOL = 1e-10  # relative to the largest entry of the reference
MC_TOL = 0.05      # max |Ĉ − C| / max diag C for 20,000 samples


# --------------------------------------------------------------------------- helpers
def _classifier(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).to(F64).eval()


def _conv_classifier(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(inplace=True), nn.Flatten(),
                         nn.Linear(3 * 3 * 3, 3)).to(F64).eval()


def _regressor(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 2)).to(F64).eval()


def _batches(model, in_shape, lik, n=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *in_shape, generator=g, dtype=F64)
    with torch.no_grad():
        out = model(x)
    y = out + torch.randn(out.shape, generator=g, dtype=F64) if lik == "regression" else \
        torch.randint(0, out.shape[1], (n,), generator=g)
    h = n // 2
    return [(x[:h], y[:h]), (x[h:], y[h:])]


def _flat_grads(model, x, targets, lik):
    """Per-example gradients over all curvature layers, ``(..., D)`` in subnetwork order."""
    d = per_example_grads(model, x, targets, lik)
    return torch.cat([vec(d[k]) for k in find_layers(model)[0]], dim=-1)


def _global_index(masks):
    return torch.cat([vec(mk) for mk in masks.values()]).nonzero().flatten()


def _reference_fisher(model, batches, fisher, lik, generator=None, mc_samples=1):
    """Exact full Fisher SUM (D x D) from torch.func per-example gradients."""
    total = 0
    for x, y in batches:
        with torch.no_grad():
            out = model(x)
        if fisher == "ggn":
            C = out.shape[1]
            if lik == "classification":
                tg = torch.arange(C)[:, None].expand(C, len(x))
                v = _flat_grads(model, x, tg, lik)  # (C, M, D): (e_c − p)^T J
                p = torch.softmax(out, 1).T  # (C, M)
                total = total + torch.einsum("cm,cmd,cme->de", p, v, v)
            else:
                tg = out[None] + torch.eye(C, dtype=F64)[:, None, :]  # targets f + e_c: gradient e_c^T J
                v = _flat_grads(model, x, tg, lik)
                total = total + torch.einsum("cmd,cme->de", v, v)
        else:
            tg = sample_targets(out, y, fisher=fisher, mc_samples=mc_samples, generator=generator, likelihood=lik)
            v = _flat_grads(model, x, tg, lik)  # (S, M, D)
            total = total + torch.einsum("smd,sme->de", v, v) / tg.shape[0]
    return total


def _stats(model, batches, lik="classification"):
    return collect_statistics(model, batches, generator=torch.Generator().manual_seed(0), likelihood=lik)


# --------------------------------------------------------------------------- selection
def test_wasserstein_selects_top_marginal_variances():
    model = _conv_classifier()
    stats = _stats(model, _batches(model, (2, 3, 3), "classification"))
    N, tau = 50.0, 0.3
    var = torch.cat([vec(1.0 / (N * ls.diag / stats.count + tau)) for ls in stats.layers.values()])
    for S in (1, 7, 40, var.numel()):
        masks = select_subnetwork(stats, S, prior_precision=tau, n_data=N)
        assert list(masks) == list(stats.layers) and subnet_size(masks) == S
        got = set(_global_index(masks).tolist())
        want = set(torch.topk(var, S).indices.tolist())
        assert got == want, S
        kept = var[list(got)]
        dropped = var[[i for i in range(var.numel()) if i not in got]]
        assert dropped.numel() == 0 or kept.min() >= dropped.max()
    # the same selection from a diag posterior's marginal variances
    post = build_posterior(stats, "diag", n_data=N, prior_precision=tau)
    a = select_subnetwork(post, 9)
    b = select_subnetwork(stats, 9, prior_precision=tau, n_data=N)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_selection_ties_and_random_rule():
    infos = {"a": LayerInfo("a", "linear", 2, 3, True, (2, 2)), "b": LayerInfo("b", "linear", 3, 2, True, (3, 1))}
    layers = {k: LayerStatistics(A=torch.eye(i.shape[1], dtype=F64), G=torch.eye(i.shape[0], dtype=F64),
                                 diag=torch.zeros(i.shape, dtype=F64)) for k, i in infos.items()}
    stats = CurvatureStatistics(layers=layers, infos=infos, count=5)
    masks = select_subnetwork(stats, 4)  # all variances tie: the first 4 positions in vec order
    assert vec(masks["a"]).tolist() == [True, True, True, True, False, False]
    assert not bool(masks["b"].any())
    r1 = select_subnetwork(stats, 5, rule="random", seed=3)
    r2 = select_subnetwork(stats, 5, rule="random", seed=3)
    r3 = select_subnetwork(stats, 5, rule="random", seed=4)
    assert subnet_size(r1) == 5 and all(torch.equal(r1[k], r2[k]) for k in r1)
    assert any(not torch.equal(r1[k], r3[k]) for k in r1)
    with pytest.raises(ValueError, match="unknown subnetwork selection rule"):
        select_subnetwork(stats, 3, rule="magnitude")
    with pytest.raises(ValueError, match=r"S must be an int in \[1, 12\]"):
        select_subnetwork(stats, 13)


def _relu_with_dead_units(seed=0):
    """3-6-4 ReLU classifier whose hidden units 0 and 1 are dead on every input (bias -100):
    exact-zero Fisher for their rows of layer 0 and their columns of layer 2."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 4)).to(F64).eval()
    with torch.no_grad():
        model[0].bias[:2] = -100.0
    return model


def _brute_force_live_top(var, diag, layer_max, S, rtol=LIVE_RTOL):
    """Independent reference: python sort by (not live, -variance, position)."""
    D = len(var)
    live = [diag[i] > rtol * layer_max[i] for i in range(D)]
    return set(sorted(range(D), key=lambda i: (not live[i], -var[i], i))[:S]), sum(live)


def test_wasserstein_live_equals_brute_force_top_S_over_live_weights():
    assert SELECTION_RULES[0] == "wasserstein" and "wasserstein_live" in SELECTION_RULES
    model = _relu_with_dead_units()
    stats = _stats(model, _batches(model, (3,), "classification", n=30))
    N, tau = 60.0, 0.4
    var = torch.cat([vec(1.0 / (N * ls.diag / stats.count + tau)) for ls in stats.layers.values()]).tolist()
    diag = torch.cat([vec(ls.diag) for ls in stats.layers.values()]).tolist()
    layer_max = torch.cat([torch.full((ls.diag.numel(),), float(ls.diag.max()), dtype=F64)
                           for ls in stats.layers.values()]).tolist()
    D = len(var)
    n_zero = sum(d == 0 for d in diag)
    assert n_zero >= 2 * 3 + 2 * 4  # the dead units' rows (3 inputs, no bias) and columns (4 outputs)
    plain = _global_index(select_subnetwork(stats, n_zero, prior_precision=tau, n_data=N))
    assert all(diag[i] == 0 for i in plain.tolist())  # the paper's rule: dead weights first
    _, n_live = _brute_force_live_top(var, diag, layer_max, 1)
    for S in (1, 5, n_live - 1, n_live):
        masks = select_subnetwork(stats, S, rule="wasserstein_live", prior_precision=tau, n_data=N)
        want, _ = _brute_force_live_top(var, diag, layer_max, S)
        assert subnet_size(masks) == S and set(_global_index(masks).tolist()) == want, S
        assert all(diag[i] > 0 for i in want)
    for S in (n_live + 3, D):  # too few live weights: all live kept, the rest filled by the plain rule
        with pytest.warns(UserWarning, match=rf"only {n_live} of {D} weights .* filled the other {S - n_live} "):
            masks = select_subnetwork(stats, S, rule="wasserstein_live", prior_precision=tau, n_data=N)
        want, _ = _brute_force_live_top(var, diag, layer_max, S)
        assert subnet_size(masks) == S and set(_global_index(masks).tolist()) == want, S
    # the same selection from a diag posterior (fisher_diag = diag/M: same liveness)
    post = build_posterior(stats, "diag", n_data=N, prior_precision=tau)
    a = select_subnetwork(post, 11, rule="wasserstein_live")
    b = select_subnetwork(stats, 11, rule="wasserstein_live", prior_precision=tau, n_data=N)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_live_threshold_exact_zero_and_tiny_values():
    """Layer ``a`` (max 1): exact 0, 1e-20 and 5e-13 are dead (<= 1e-12 x max), 2e-12 is live;
    layer ``b`` is all zero (dead, max 0). With ``rtol = 0`` (strict ``diag > 0``) the tiny
    values are live, although 1e-20 has exactly the prior variance in float64."""
    assert LIVE_RTOL == 1e-12
    infos = {"a": LayerInfo("a", "linear", 2, 3, True, (2, 2)), "b": LayerInfo("b", "linear", 3, 2, True, (3, 1))}
    da = unvec(torch.tensor([0.0, 1e-20, 5e-13, 2e-12, 1.0, 0.5], dtype=F64), 2, 3)
    layers = {"a": LayerStatistics(A=torch.eye(3, dtype=F64), G=torch.eye(2, dtype=F64), diag=da),
              "b": LayerStatistics(A=torch.eye(2, dtype=F64), G=torch.eye(3, dtype=F64),
                                   diag=torch.zeros(3, 2, dtype=F64))}
    stats = CurvatureStatistics(layers=layers, infos=infos, count=5)  # N = M: precision diag + 1
    live = live_weights(stats)
    assert vec(live["a"]).tolist() == [False, False, False, True, True, True] and not bool(live["b"].any())
    assert vec(live_weights(stats, rtol=0.0)["a"]).tolist() == [False, True, True, True, True, True]
    var = torch.cat([vec(v) for v in marginal_variances(stats).values()])
    assert float(var[1]) == 1.0  # 1 / (1e-20 + 1): the prior variance to machine precision
    # plain rule: the prior-variance ties first (exact zero, tiny, then layer b), by position
    assert _global_index(select_subnetwork(stats, 3)).tolist() == [0, 1, 6]
    # live rule: 2e-12 (var 1 - 2e-12), then 0.5, then 1.0
    m = select_subnetwork(stats, 3, rule="wasserstein_live")
    assert _global_index(m).tolist() == [3, 4, 5]
    with pytest.warns(UserWarning, match=r"only 3 of 12 weights .*filled the other 2 of S = 5"):
        m = select_subnetwork(stats, 5, rule="wasserstein_live")
    assert _global_index(m).tolist() == [0, 1, 3, 4, 5]  # filled: variance 1.0 (0 and 1e-20), earliest first
    # sources without a Fisher diagonal, bad rtol
    with pytest.raises(ValueError, match="need the Fisher diagonal: .* got dict"):
        select_subnetwork({"a": torch.ones(2, 3, dtype=F64)}, 2, rule="wasserstein_live")
    with pytest.raises(ValueError, match="got a 'kfac' posterior"):
        select_subnetwork(build_posterior(stats, "kfac"), 2, rule="wasserstein_live")
    with pytest.raises(ValueError, match="rtol must be"):
        live_weights(stats, rtol=-1.0)
    with pytest.raises(ValueError, match="valid: wasserstein, wasserstein_live, random"):
        select_subnetwork(stats, 2, rule="live")


# --------------------------------------------------------------------------- Fisher
@pytest.mark.parametrize("fisher", ["mc", "empirical", "ggn"])
@pytest.mark.parametrize("problem", ["classifier", "conv", "regression"])
def test_subnet_fisher_equals_exact_rows_and_columns(problem, fisher):
    make, shape, lik = {
        "classifier": (_classifier, (3,), "classification"),
        "conv": (_conv_classifier, (2, 3, 3), "classification"),
        "regression": (_regressor, (2,), "regression"),
    }[problem]
    model = make()
    batches = _batches(model, shape, lik)
    stats = _stats(model, batches, lik)
    masks = select_subnetwork(stats, 17, rule="random", seed=2)
    F, count = collect_subnet_fisher(model, batches, masks, fisher=fisher, mc_samples=2,
                                     generator=torch.Generator().manual_seed(7), likelihood=lik)
    ref = _reference_fisher(model, batches, fisher, lik, generator=torch.Generator().manual_seed(7), mc_samples=2)
    idx = _global_index(masks)
    want = ref[idx][:, idx]
    assert count == 20 and F.shape == (17, 17)
    assert float((F - want).abs().max() / want.abs().max()) < EXACT_TOL, (problem, fisher)
    # the diagonal of the full-network subnet Fisher (mc) is collect_statistics' exact Fisher diagonal
    if fisher == "mc" and problem == "conv":
        allm = {k: torch.ones(i.shape, dtype=torch.bool) for k, i in stats.infos.items()}
        Fa, _ = collect_subnet_fisher(model, batches, allm, generator=torch.Generator().manual_seed(0))
        diag = torch.cat([vec(ls.diag) for ls in stats.layers.values()])
        assert float((Fa.diagonal() - diag).abs().max() / diag.max()) < EXACT_TOL


@pytest.mark.parametrize("problem", ["conv", "regression"])
def test_keyed_mc_subnet_fisher_uses_the_pass1_labels(problem):
    """With a ``KeyedSampler`` the MC labels come from ``(seed, key, draw)``: the result equals
    the empirical subnet Fisher over those labels drawn separately (1/S per draw), and the
    full-network diagonal equals collect_statistics' keyed exact diagonal (pass 1)."""
    make, shape, lik = {"conv": (_conv_classifier, (2, 3, 3), "classification"),
                        "regression": (_regressor, (2,), "regression")}[problem]
    model = make()
    batches = _batches(model, shape, lik)
    keyed = [(x, y, torch.arange(10 * j, 10 * j + x.shape[0])) for j, (x, y) in enumerate(batches)]
    masks = select_subnetwork(_stats(model, batches, lik), 17, rule="random", seed=2)
    F, count = collect_subnet_fisher(model, keyed, masks, fisher="mc", mc_samples=3, generator=KeyedSampler(11),
                                     likelihood=lik)
    # reference: the same keyed draws made here, each fed as "empirical" labels
    from laplace_core.curvature.likelihoods import likelihood_for
    ref = torch.zeros_like(F)
    for x, y, keys in keyed:
        with torch.no_grad():
            t = likelihood_for(lik).sample_keyed(model(x), 3, 11, keys)
        for s in range(3):
            Fs, _ = collect_subnet_fisher(model, [(x, t[s])], masks, fisher="empirical", likelihood=lik)
            ref += Fs / 3
    assert count == 20
    assert float((F - ref).abs().max() / ref.abs().max()) < EXACT_TOL
    if problem == "conv":
        stats = collect_statistics(model, keyed, fisher="mc", mc_samples=3, generator=KeyedSampler(11))
        allm = {k: torch.ones(i.shape, dtype=torch.bool) for k, i in stats.infos.items()}
        Fa, _ = collect_subnet_fisher(model, keyed, allm, fisher="mc", mc_samples=3, generator=KeyedSampler(11))
        diag = torch.cat([vec(ls.diag) for ls in stats.layers.values()])
        assert float((Fa.diagonal() - diag).abs().max() / diag.max()) < EXACT_TOL
    with pytest.raises(ValueError, match="KeyedSampler needs per-example keys"):
        collect_subnet_fisher(model, batches, masks, fisher="mc", generator=KeyedSampler(11), likelihood=lik)
    with pytest.raises(ValueError, match="3 keys for 10 examples"):
        collect_subnet_fisher(model, [(x, y, keys[:3]) for x, y, keys in keyed], masks, fisher="mc",
                              generator=KeyedSampler(11), likelihood=lik)


def test_out_accumulates_one_call_per_part():
    """``out=``: one call per part of the data (keyed MC labels) adds into the same matrix, which
    equals one call over all of it; ``count`` is each call's own; a wrong ``out`` is a clear error."""
    model = _conv_classifier()
    batches = _batches(model, (2, 3, 3), "classification")
    keyed = [(x, y, torch.arange(10 * j, 10 * j + x.shape[0])) for j, (x, y) in enumerate(batches)]
    masks = select_subnetwork(_stats(model, batches, "classification"), 17, rule="random", seed=2)
    whole, n = collect_subnet_fisher(model, keyed, masks, mc_samples=2, generator=KeyedSampler(5))
    acc = torch.zeros(17, 17, dtype=F64)
    counts = []
    for part in (keyed[:1], keyed[1:]):
        F, c = collect_subnet_fisher(model, part, masks, mc_samples=2, generator=KeyedSampler(5), out=acc)
        assert F is acc
        counts.append(c)
    assert counts == [batches[0][0].shape[0], n - batches[0][0].shape[0]]
    assert float((acc - whole).abs().max() / whole.abs().max()) < EXACT_TOL
    for bad in (torch.zeros(16, 16, dtype=F64), torch.zeros(17, 17, dtype=torch.float32)):
        with pytest.raises(ValueError, match="out must be an 17 x 17 torch.float64 tensor"):
            collect_subnet_fisher(model, keyed, masks, generator=KeyedSampler(5), out=bad)


def test_memory_budget_is_checked_up_front():
    assert max_subnet_size(8 * 100**2) == 100
    with pytest.raises(ValueError, match="largest S that fits is 100"):
        check_subnet_memory(101, 8 * 100**2)
    model = _classifier()
    batches = _batches(model, (3,), "classification")
    masks = select_subnetwork(_stats(model, batches), 30)
    with pytest.raises(ValueError, match="largest S that fits is 20"):
        collect_subnet_fisher(model, batches, masks, memory_budget=8 * 20**2 + 7)


# --------------------------------------------------------------------------- posterior
def _subnet_post(S=12, fisher="mc", n_data=40.0, tau=0.5, model=None):
    model = model or _conv_classifier()
    batches = _batches(model, (2, 3, 3), "classification")
    stats = _stats(model, batches)
    masks = select_subnetwork(stats, S, prior_precision=tau)
    F, count = collect_subnet_fisher(model, batches, masks, fisher=fisher, generator=torch.Generator().manual_seed(1))
    return model, batches, stats, masks, F, count, build_posterior(
        stats, "subnet", n_data=n_data, prior_precision=tau, subnet_fisher=(F, count, masks))


def test_all_weights_equals_full_covariance_laplace():
    model = _classifier()
    batches = _batches(model, (3,), "classification")
    stats = _stats(model, batches)
    D = sum(i.numel for i in stats.infos.values())
    masks = select_subnetwork(stats, D)
    F, count = collect_subnet_fisher(model, batches, masks, fisher="mc", generator=torch.Generator().manual_seed(5))
    post = build_subnet_posterior(F, count, masks, n_data=33.0, prior_precision=0.8)
    assert post.prior_scale == 1.0 and post.size == D
    ref = _reference_fisher(model, batches, "mc", "classification", generator=torch.Generator().manual_seed(5))
    P_full = 33.0 * ref / count + 0.8 * torch.eye(D, dtype=F64)  # full network, cross-layer blocks included
    assert float((post.to_dense() - P_full).abs().max() / P_full.abs().max()) < EXACT_TOL
    # GLM predictive: J P_full^{-1} J^T with the explicit Jacobian
    from test_glm import dense_jacobian

    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2), dtype=F64)
    J = dense_jacobian(model, x, list(post.layers))
    want = J @ torch.linalg.inv(P_full) @ J.transpose(1, 2)
    got = glm_covariance(model, post, x)
    assert float((got - want).abs().max() / want.abs().max()) < EXACT_TOL
    # and the marginals equal the dense inverse's diagonal
    mv = torch.cat([vec(v) for v in post.marginal_variance().values()])
    assert float((mv - torch.linalg.inv(P_full).diagonal()).abs().max() / mv.max()) < EXACT_TOL


def test_scale_factor_samples_and_prior_rescaling():
    model, batches, stats, masks, F, count, post = _subnet_post(S=12)
    assert isinstance(post, SubnetPosterior) and post.method == "subnet"
    D = post.d_total
    assert post.prior_scale == pytest.approx(12 / D) and post.effective_prior_precision == pytest.approx(0.5 * 12 / D)
    P = post.to_dense()
    want_P = 40.0 * F / count + 0.5 * 12 / D * torch.eye(12, dtype=F64)
    assert float((P - want_P).abs().max() / want_P.abs().max()) < EXACT_TOL
    # F F^T = P_S^{-1}: apply scale_matvec to unit vectors placed at the subnetwork positions
    E = torch.eye(12, dtype=F64)
    Fm = post.gather(post.scale_matvec(post.scatter(E))).T  # column i = F e_i
    C = torch.linalg.inv(P)
    assert float((Fm @ Fm.T - C).abs().max() / C.abs().max()) < EXACT_TOL
    Cm = post.gather(post.covariance_matvec(post.scatter(E))).T
    assert float((Cm - C).abs().max() / C.abs().max()) < EXACT_TOL
    Pm = post.gather(post.precision_matvec(post.scatter(E))).T
    assert float((Pm - P).abs().max() / P.abs().max()) < EXACT_TOL
    # samples: zero outside the subnetwork, covariance -> P_S^{-1}
    s = post.sample(20_000, torch.Generator().manual_seed(0))
    for k, mk in masks.items():
        assert bool((s[k][:, ~mk] == 0).all())
    z = post.gather(s)
    err = (z.T @ z / z.shape[0] - C).abs().max() / C.diagonal().max()
    assert float(err) < MC_TOL
    again = post.sample(3, torch.Generator().manual_seed(5))
    assert all(torch.equal(v, post.sample(3, torch.Generator().manual_seed(5))[k]) for k, v in again.items())
    assert post.num_stored() == 12 * 13 // 2 + 12
    # unscaled prior
    flat = build_subnet_posterior(F, count, masks, n_data=40.0, prior_precision=0.5, scale_prior=False)
    assert flat.prior_scale == 1.0


def test_with_hyper_save_load_and_mc_predictor(tmp_path):
    model, batches, stats, masks, F, count, post = _subnet_post(S=10)
    moved = with_hyper(post, 77.0, 0.25)
    fresh = build_subnet_posterior(F, count, masks, n_data=77.0, prior_precision=0.25)
    assert isinstance(moved, SubnetPosterior) and (moved.n_data, moved.prior_precision) == (77.0, 0.25)
    assert torch.allclose(moved.to_dense(), fresh.to_dense(), rtol=1e-13, atol=1e-13)
    uri = str(tmp_path / "posterior" / "subnet")
    post.save(uri)
    back = load_posterior(uri)
    assert isinstance(back, SubnetPosterior)
    assert (back.n_data, back.prior_precision, back.prior_scale, back.info) == \
        (post.n_data, post.prior_precision, post.prior_scale, post.info)
    assert torch.equal(back.fisher, post.fisher) and list(back.layers) == list(post.layers)
    assert all(torch.equal(back.masks()[k], masks[k]) for k in masks)
    a, b = post.sample(2, torch.Generator().manual_seed(1)), back.sample(2, torch.Generator().manual_seed(1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the MC and GLM predictors accept it
    x = batches[0][0]
    p = MCPredictor(model, back, n_samples=3, seed=0).predict(x)
    q = GLMPredictor(model, back, n_samples=3, seed=0).predict(x)
    assert torch.allclose(p.sum(1), torch.ones(len(x), dtype=F64)) and torch.allclose(q.sum(1), torch.ones(len(x), dtype=F64))


def test_subnet_laplace_one_call_equals_the_three_steps():
    model, batches, stats, masks, F, count, post = _subnet_post(S=9, n_data=40.0, tau=0.5)
    one = subnet_laplace(model, batches, stats, 9, generator=torch.Generator().manual_seed(1), prior_precision=0.5)
    want = build_subnet_posterior(F, count, masks, None, 0.5)  # same selection (N = M) and Fisher draws
    assert all(torch.equal(one.masks()[k], masks[k]) for k in masks)
    assert torch.allclose(one.to_dense(), want.to_dense(), rtol=1e-13, atol=1e-13)


def test_bad_inputs_give_clear_errors():
    model, batches, stats, masks, F, count, post = _subnet_post(S=6)
    with pytest.raises(ValueError, match="needs subnet_fisher"):
        build_posterior(stats, "subnet")
    with pytest.raises(ValueError, match="subnet_fisher= applies only"):
        build_posterior(stats, "diag", subnet_fisher=(F, count, masks))
    with pytest.raises(ValueError, match="valid: .*subnet"):
        build_posterior(stats, "subnetwork")
    with pytest.raises(ValueError, match="masks select S = 6 weights but fisher_sum"):
        build_subnet_posterior(F[:5, :5], count, masks)
    with pytest.raises(ValueError, match="not positive definite"):
        build_subnet_posterior(torch.zeros(6, 6, dtype=F64), count, masks, prior_precision=0.0)
    with pytest.raises(ValueError, match="not defined per layer"):
        next(iter(post.layers.values())).scale_matvec(torch.zeros(1))
    with pytest.raises(ValueError, match="model order"):
        collect_subnet_fisher(model, batches, dict(reversed(list(masks.items()))))
    with pytest.raises(ValueError, match="unknown subnet fisher"):
        collect_subnet_fisher(model, batches, masks, fisher="kfac")
    with pytest.raises(ValueError, match="bool tensor of shape"):
        collect_subnet_fisher(model, batches, {k: v.double() for k, v in masks.items()})


# --------------------------------------------------------------------------- Daxberger §6.1
def _two_cluster_problem():
    """1D two-cluster regression (Daxberger et al. §6.1 / Antorán et al. 2020 style): inputs in
    [-4, -2] ∪ [2, 4], ``y = sin(1.5 x) + 0.1 ε``; a 1-30-30-1 ReLU MLP trained with the paper's
    optimiser (SGD, momentum 0.9, weight decay 1e-4), seeded. Returns the model, the data,
    the exact GGN over all weights and the in-between inputs x ∈ [-1, 1]."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(40, 1, generator=g, dtype=F64) * 2 - 4, torch.rand(40, 1, generator=g, dtype=F64) * 2 + 2])
    y = torch.sin(1.5 * x) + 0.1 * torch.randn(80, 1, generator=g, dtype=F64)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 30), nn.ReLU(), nn.Linear(30, 30), nn.ReLU(), nn.Linear(30, 1)).to(F64)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=1e-4)
    for _ in range(1200):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    model.eval()
    allm = {k: torch.ones(i.shape, dtype=torch.bool) for k, i in find_layers(model)[1].items()}
    F, count = collect_subnet_fisher(model, [(x, y)], allm, fisher="ggn", likelihood="regression")
    return model, x, y, allm, F, count, torch.linspace(-1, 1, 21, dtype=F64)[:, None]


def _in_between_std(model, post, xb):
    """Mean GLM predictive standard deviation of the function at the in-between inputs."""
    return float(glm_covariance(model, post, xb)[:, 0, 0].sqrt().mean())


@pytest.fixture(scope="module")
def two_cluster():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny problem: threading only adds overhead on a shared machine
    try:
        t0 = time.time()
        model, x, y, allm, F, count, xb = _two_cluster_problem()
        # N = M / σ² with the data noise σ = 0.1 (the unit-noise likelihood scaled), τ = 3 as in the paper
        N, tau = 100.0 * count, 3.0
        full = build_subnet_posterior(F, count, allm, n_data=N, prior_precision=tau)  # S = D: full covariance
        layers = {k: DiagLayer(unvec(F.diagonal()[lv.offset:lv.offset + lv.size], *lv.shape) / count, N, tau)
                  for k, lv in full.layers.items()}
        diag = Posterior("diag", layers, N, tau)
        yield dict(model=model, x=x, y=y, N=N, tau=tau, full=full, diag=diag, xb=xb, D=full.size, t0=t0)
    finally:
        torch.set_num_threads(threads)


def _subnet_std(p, S, rule, seed=0):
    masks = select_subnetwork(p["diag"], S, rule=rule, seed=seed)
    F, count = collect_subnet_fisher(p["model"], [(p["x"], p["y"])], masks, fisher="ggn", likelihood="regression")
    post = build_subnet_posterior(F, count, masks, n_data=p["N"], prior_precision=p["tau"])  # τ S / D
    return _in_between_std(p["model"], post, p["xb"])


def test_two_cluster_subnet_keeps_in_between_uncertainty(two_cluster):
    p = two_cluster
    diag_std = _in_between_std(p["model"], p["diag"], p["xb"])
    full_std = _in_between_std(p["model"], p["full"], p["xb"])
    half = p["D"] // 2
    rand_std = [_subnet_std(p, half, "random", seed=s) for s in range(3)]
    # full-covariance Laplace keeps far more in-between uncertainty than diagonal Laplace (same prior)
    assert full_std > 2.0 * diag_std, (full_std, diag_std)
    # a subnetwork over half the weights (prior τ S/D) keeps more than diagonal Laplace over all of them
    assert min(rand_std) > 2.0 * diag_std, (rand_std, diag_std)


# --------------------------------------------------------------------------- §6.1 as in the paper
def _matern_two_clusters(seed=4, n=(200, 200), lengthscale=0.5, noise=0.15):
    """The two-cluster toy of Antorán et al. (2020) used by Daxberger §6.1 / appendix D.1 (the
    DUN repository's Matérn data, regenerated): ``x ~ U(-2, -1)`` (200) and ``U(0.5, 2.5)``
    (200), ``y`` one draw of a Matérn-3/2 GP (variance 1, lengthscale 0.5) plus noise 0.15,
    both standardised. Returns ``x (400, 1)``, ``y (400, 1)`` and 27 in-between inputs
    (raw ``x ∈ [-0.9, 0.4]``, strictly inside the gap), standardised the same way."""
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.rand(n[0], generator=g, dtype=F64) - 2,
                   torch.rand(n[1], generator=g, dtype=F64) * 2 + 0.5]).sort().values
    r = (x[:, None] - x[None, :]).abs() * 3**0.5 / lengthscale
    K = (1 + r) * torch.exp(-r) + noise**2 * torch.eye(len(x), dtype=F64)
    y = torch.linalg.cholesky(K) @ torch.randn(len(x), generator=g, dtype=F64)
    xm, xs = x.mean(), x.std()
    gap = (torch.linspace(-0.9, 0.4, 27, dtype=F64) - xm) / xs
    return ((x - xm) / xs)[:, None], ((y - y.mean()) / y.std())[:, None], gap[:, None]


def _daxberger_problem(seed=0, steps=2000):
    """Daxberger et al. §6.1 / appendix D.1: 1-50-50-1 ReLU MLP, Gaussian likelihood whose noise
    variance is learnt jointly (maximum likelihood), weight decay 1e-4, full batch (the paper's
    batch 512 > 400 points). Deviation: Adam (lr 1e-2, 2000 steps; the noise std converges to
    ≈ 0.21 ≈ 0.15 / std(y)) instead of SGD (lr 1e-3, momentum 0.9), which needs > 20,000 steps
    to converge — too slow for a unit test. Returns the model, data, learnt σ² and gap inputs."""
    x, y, gap = _matern_two_clusters()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(1, 50), nn.ReLU(), nn.Linear(50, 50), nn.ReLU(), nn.Linear(50, 1)).to(F64)
    log_var = torch.zeros((), dtype=F64, requires_grad=True)
    opt = torch.optim.Adam([*model.parameters(), log_var], lr=1e-2, weight_decay=1e-4)
    for _ in range(steps):
        opt.zero_grad()
        loss = 0.5 * (((model(x) - y) ** 2) / log_var.exp() + log_var).mean()
        loss.backward()
        opt.step()
    return model.eval(), x, y, float(log_var.detach().exp()), gap


@pytest.fixture(scope="module")
def daxberger_two_cluster():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, x, y, s2, xb = _daxberger_problem()
        allm = {k: torch.ones(i.shape, dtype=torch.bool) for k, i in find_layers(model)[1].items()}
        F, count = collect_subnet_fisher(model, [(x, y)], allm, fisher="ggn", likelihood="regression")
        N, tau = count / s2, 3.0  # GGN of the learnt-noise Gaussian likelihood: J^T J / σ²; λ = 3 (paper)
        full = build_subnet_posterior(F, count, allm, n_data=N, prior_precision=tau)  # full covariance
        layers = {k: DiagLayer(unvec(F.diagonal()[lv.offset:lv.offset + lv.size], *lv.shape) / count, N, tau)
                  for k, lv in full.layers.items()}
        yield dict(model=model, x=x, y=y, N=N, tau=tau, full=full, diag=Posterior("diag", layers, N, tau),
                   exact=full.marginal_variance(), xb=xb, D=full.size, ggn_diag=F.diagonal() / count, sigma=s2**0.5)
    finally:
        torch.set_num_threads(threads)


def _selected_std(p, source, S, rule, seed=0):
    """(in-between std of the subnet posterior, flat mask) for ``S`` weights chosen from ``source``."""
    masks = select_subnetwork(source, S, rule=rule, seed=seed)
    F, count = collect_subnet_fisher(p["model"], [(p["x"], p["y"])], masks, fisher="ggn", likelihood="regression")
    post = build_subnet_posterior(F, count, masks, n_data=p["N"], prior_precision=p["tau"])  # λ S / D
    return _in_between_std(p["model"], post, p["xb"]), torch.cat([vec(mk) for mk in masks.values()])


#: Dead (zero-GGN-diagonal) weights of the trained fixture the measured numbers below come from.
#: Training is chaotic in the last bits: another CPU's kernels (AVX-512 against AVX2, MKL's code
#: paths) train another network from the same seed (measured here: 1375 dead weights on an
#: AVX-512 Xeon, 1631 with AVX2 kernels forced). Claims about that one network are asserted on it
#: and reported as an expected failure, with the values, on any other.
REFERENCE_DEAD_WEIGHTS = 1599


def _unless_reference_fixture(p, claim: str, measured) -> None:
    dead = int((p["ggn_diag"] == 0).sum())
    if dead != REFERENCE_DEAD_WEIGHTS:
        pytest.xfail(f"fixture-specific claim ({claim}) measured on the reference fixture ({REFERENCE_DEAD_WEIGHTS} "
                     f"dead weights); this CPU trained another network ({dead} dead weights), where it measures "
                     f"{measured}")


PAPER_S = (27, 81, 1350)  # 1 %, 3 % and 50 % of the D = 2701 weights (Daxberger Fig. 2; biases included here)


def test_two_cluster_wasserstein_picks_weights_the_data_never_reach(daxberger_two_cluster):
    """Why Daxberger §6.1 is not reproduced (see the xfail below): the eq. 23 rule keeps the
    largest marginal variances, and the largest is the prior's ``1/λ``, reached exactly by the
    weights whose Jacobian is zero on every training input (dead ReLU units: 1599 of the 2701
    weights of this MAP). They outnumber even S = 50 % of D, so for all three S both the exact
    full-covariance marginals (as §6.1 uses) and the diagonal-Laplace ones select only such
    weights; they are (almost) as inert between the clusters. Measured in-between std:
    Wasserstein 0.000 / 0.000 / 0.020 vs random 0.10 / 0.26 / 0.50 (mean of 3 seeds).
    Nor do they act outside the data, where Fig. 2 also plots (up to 0.75 standardised units
    beyond either cluster, raw about ``[-3.1, -2]`` and ``[2.5, 3.6]``): at S = 27 and 81 the
    Wasserstein subnet's std there is 1e-8 (full 0.59; random 0.08 / 0.25, mean of 5 seeds)."""
    p = daxberger_two_cluster
    dead = p["ggn_diag"] == 0
    lo, hi = float(p["x"].min()), float(p["x"].max())
    outside = torch.cat([torch.linspace(lo - 0.75, lo - 0.05, 8, dtype=F64),
                         torch.linspace(hi + 0.05, hi + 0.75, 8, dtype=F64)])[:, None]
    assert int(dead.sum()) > max(PAPER_S), int(dead.sum())
    exact = torch.cat([vec(v) for v in p["exact"].values()])
    assert float((exact[dead] * p["tau"] - 1).abs().max()) < 1e-9  # prior variance, the maximum
    assert float(exact[~dead].max()) < 1 / p["tau"]
    for S in PAPER_S:
        for source in (p["exact"], p["diag"]):
            std, sel = _selected_std(p, source, S, "wasserstein")
            assert bool(dead[sel].all()), (S, int((~dead[sel]).sum()))
            assert std < 0.1 * _in_between_std(p["model"], p["full"], p["xb"]), (S, std)
    for S in PAPER_S[:2]:  # outside the data too
        masks = select_subnetwork(p["exact"], S, rule="wasserstein")
        F, count = collect_subnet_fisher(p["model"], [(p["x"], p["y"])], masks, fisher="ggn", likelihood="regression")
        post = build_subnet_posterior(F, count, masks, n_data=p["N"], prior_precision=p["tau"])
        sub, full = _in_between_std(p["model"], post, outside), _in_between_std(p["model"], p["full"], outside)
        if not sub < 0.01 * full:
            _unless_reference_fixture(p, "dead weights inert outside the data", f"std {sub:.3g} vs full {full:.3g} at S = {S}")
        assert sub < 0.01 * full, S


@pytest.mark.xfail(strict=False, reason=(
    "Daxberger §6.1 (Wasserstein selection keeps more in-between std than random at the same S) is NOT "
    "reproduced with the paper's setup (Matérn two-cluster data, 1-50-50-1 ReLU, learnt noise, GGN, "
    "λ = 3, λ_S = λ S/D, exact marginals for selection): the largest marginal variances are the prior "
    "1/λ of weights with zero Jacobian on all data (dead ReLU units, 1599 of 2701), which are inert "
    "between the clusters too. Measured in-between std: full 0.564, diag 0.295; S = 27: Wasserstein "
    "0.000 vs random 0.10 (3 seeds 0.04-0.20); S = 81: 0.000 vs 0.26 (0.14-0.37); S = 1350: 0.020 vs "
    "0.50 (0.46-0.55). Same with diagonal-Laplace marginals, with biases excluded, for 3 training "
    "seeds, and when trained with the paper's SGD (lr 1e-3, momentum 0.9, 20,000 full-batch steps: "
    "1277 dead weights, Wasserstein 0.000 vs random 0.054 at S = 27); none of the dead weights has a "
    "non-zero Jacobian at the in-between inputs either. See "
    "test_two_cluster_wasserstein_picks_weights_the_data_never_reach."))
def test_two_cluster_wasserstein_beats_random_and_diag(daxberger_two_cluster):
    """Acceptance claim of Daxberger §6.1 at S = 1 % and 3 % of D: Wasserstein subnet > mean of
    3 random subnets, and > diagonal Laplace with the same prior λ."""
    p = daxberger_two_cluster
    diag_std = _in_between_std(p["model"], p["diag"], p["xb"])
    for S in PAPER_S[:2]:
        wass = _selected_std(p, p["exact"], S, "wasserstein")[0]  # exact marginals, as §6.1
        rand = sum(_selected_std(p, p["diag"], S, "random", seed=s)[0] for s in range(3)) / 3
        assert wass > rand and wass > diag_std, (S, wass, rand, diag_std)


LIVE_OVER_RANDOM = 1.25  # measured 2.48 (S = 27) and 1.33 (S = 81)
LIVE_OVER_DIAG = 1.10    # measured 1.16 at S = 81 (at S = 27 it is 0.84: not asserted)


def test_two_cluster_wasserstein_live_beats_random(daxberger_two_cluster):
    """The opt-in ``wasserstein_live`` rule (eq. 23 ranking over weights with a live Fisher
    diagonal; diagonal-Laplace marginals) on the §6.1 fixture. Measured in-between std (diag
    0.295, full 0.564): S = 27: live 0.249 vs random 0.100 (seeds 0-2: 0.04 / 0.06 / 0.20);
    S = 81: live 0.342 vs random 0.258 (0.14 / 0.27 / 0.37) and vs diag 0.295. Over 30 random
    seeds the mean of any 3 consecutive ones stays <= 0.166 (S = 27) and <= 0.258 (S = 81).
    Not asserted, as it does not hold: live > diag at S = 27 (0.249 < 0.295). Fixture-specific:
    with training seed 1 live/random is 2.8 and 1.1, with training seed 2 live loses to random
    (0.000 vs 0.046, 0.008 vs 0.122): the live weights of largest variance have
    ``N diag/M`` of 1e-7 to 1e-2, far below ``λ = 3``, i.e. barely informed by the data too.
    S = 1350 > 1102 live weights: every live weight is kept and 248 are filled (warning)."""
    p = daxberger_two_cluster
    diag_std = _in_between_std(p["model"], p["diag"], p["xb"])
    live = p["ggn_diag"] > 0
    for S in PAPER_S[:2]:
        std, sel = _selected_std(p, p["diag"], S, "wasserstein_live")
        assert bool(live[sel].all()), S
        rand = sum(_selected_std(p, p["diag"], S, "random", seed=s)[0] for s in range(3)) / 3
        assert std > LIVE_OVER_RANDOM * rand, (S, std, rand)
        if S == 81:
            if not std > LIVE_OVER_DIAG * diag_std:
                _unless_reference_fixture(p, "live > 1.1 x diag at S = 81", f"live {std:.3f} vs diag {diag_std:.3f}")
            assert std > LIVE_OVER_DIAG * diag_std, (S, std, diag_std)
    n_live = int(live.sum())
    assert n_live == int(torch.cat([vec(v) for v in live_weights(p["diag"]).values()]).sum())  # no tiny values here
    with pytest.warns(UserWarning, match=rf"only {n_live} of {p['D']} .* filled the other {PAPER_S[2] - n_live} "):
        masks = select_subnetwork(p["diag"], PAPER_S[2], rule="wasserstein_live")
    sel = torch.cat([vec(mk) for mk in masks.values()])
    assert bool(sel[live].all()) and int(sel.sum()) == PAPER_S[2]
