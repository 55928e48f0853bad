"""Normalisation layers under ``norm_layers="diag"`` against dense float64 ground truth.

BatchNorm2d (eval mode, non-trivial running statistics), GroupNorm, LayerNorm over the last
dimension (with and without a bias), and a tiny torchvision ConvNeXt (``LayerNorm2d``, the
blocks' layer scale): the Fisher diagonal equals hand-written sums over positions
(``Σ_t g x̂``, ``Σ_t g`` from autograd output gradients) and ``torch.func`` per-example
gradients; every method gives these layers a diagonal block with ``F F^T = P^{-1}``; the GLM
covariance equals ``J Σ J^T`` from ``jacrev``; draws added through the layers equal the
explicit forward; ``norm_layers="map"`` (the default) leaves them excluded.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from laplace_core.curvature.collect import collect_statistics
from laplace_core.curvature.likelihoods import sample_targets
from laplace_core.basis.eigenbasis import eigenbasis
from laplace_core.predictive.glm import glm_covariance
from laplace_core.curvature.layers import ScaleView, find_layers, perturbed
from laplace_core.posteriors.build import build_posterior
from laplace_core.predictive.monte_carlo import MCPredictor, draw_sample
from laplace_core.posteriors.sizes import model_sizes
from laplace_core.posteriors.structures.base import unvec, vec
from laplace_core.posteriors.structures.diag import DiagLayer
from laplace_core.curvature.subnet_fisher import collect_subnet_fisher
from laplace_core.posteriors.subnet import build_subnet_posterior, select_subnetwork

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fisher_reference import dense_covariance, dense_jacobian, exact_fisher_diag  # noqa: E402

F64 = torch.float64
TOL = 1e-10
METHODS = ("diag", "kfac", "kfac_exact", "efb", "inf")
NORMS = ["bn", "gn", "ln", "ln_nobias"]


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


class NormNet(nn.Module):
    """Conv -> BatchNorm2d -> GroupNorm -> (positions as a sequence) LayerNorm (bias) ->
    Linear -> LayerNorm (no bias) -> mean over positions -> Linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.ln = nn.LayerNorm(4)
        self.lin = nn.Linear(4, 3)
        self.ln_nobias = nn.LayerNorm(3, bias=False)
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        h = torch.tanh(self.gn(torch.tanh(self.bn(self.conv(x)))))
        s = self.ln(h.flatten(2).transpose(1, 2))
        s = self.ln_nobias(torch.tanh(self.lin(s)))
        return self.fc(torch.tanh(s).mean(1))


def _problem(seed=0):
    torch.manual_seed(seed)
    model = NormNet().to(F64)
    with torch.no_grad():  # non-trivial running statistics and affine parameters
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
        for mod in (model.bn, model.gn, model.ln, model.ln_nobias):
            mod.weight.uniform_(0.5, 1.5)
            if mod.bias is not None:
                mod.bias.uniform_(-0.3, 0.3)
    model.eval()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(5, 2, 4, 4, generator=g, dtype=F64)
    y = torch.randint(0, 3, (5,), generator=g)
    return model, x, y


def test_find_layers_map_excludes_and_diag_includes_norm_layers():
    model, _, _ = _problem()
    mods, infos, excluded = find_layers(model)
    assert set(excluded) == set(NORMS) and "bn" not in mods
    mods, infos, excluded = find_layers(model, norm_layers="diag")
    assert excluded == {}
    assert [k for k, i in infos.items() if i.kind == "norm"] == NORMS
    assert infos["bn"].shape == (4, 2) and infos["ln_nobias"].shape == (3, 1)
    with pytest.raises(ValueError, match="unknown norm_layers 'full'; valid: map, diag"):
        find_layers(model, norm_layers="full")
    # batch statistics in eval mode: no per-example Fisher, excluded with the reason
    net = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2, track_running_stats=False))
    assert "running statistics" in find_layers(net, norm_layers="diag")[2]["1"]


@pytest.mark.parametrize("fisher,S", [("mc", 2), ("empirical", 1)])
def test_diagonal_matches_hand_written_sums_and_torch_func(fisher, S):
    model, x, y = _problem()
    stats = collect_statistics(model, [(x[:2], y[:2]), (x[2:], y[2:])], fisher=fisher, mc_samples=S,
                               generator=torch.Generator().manual_seed(3), norm_layers="diag")
    assert all(stats.layers[k].A is None and stats.layers[k].G is None for k in NORMS)
    # hand-written: x̂ from the module's definition, output gradients from autograd
    ins, outs = {}, {}

    def keep(name):
        def hook(mod, args, out):
            if out.requires_grad:  # not the label-sampling forward under no_grad
                ins[name] = args[0].detach()
                out.retain_grad()
                outs[name] = out

        return hook

    hs = [getattr(model, k).register_forward_hook(keep(k)) for k in NORMS]
    want = {k: 0 for k in NORMS}
    try:
        g2 = torch.Generator().manual_seed(3)
        for xb, yb in ((x[:2], y[:2]), (x[2:], y[2:])):
            with torch.no_grad():
                targets = sample_targets(model(xb), yb, fisher=fisher, mc_samples=S, generator=g2)
            for s in range(S):
                out = model(xb)
                torch.log_softmax(out, 1).gather(1, targets[s][:, None]).sum().backward()
                for k in NORMS:
                    mod, xi, g = getattr(model, k), ins[k], outs[k].grad
                    if k == "bn":
                        xh = (xi - mod.running_mean[:, None, None]) / torch.sqrt(mod.running_var[:, None, None] + mod.eps)
                        d = torch.stack([(g * xh).sum((2, 3)), g.sum((2, 3))], -1)
                    elif k == "gn":
                        xg = xi.reshape(xi.shape[0], 2, -1)
                        xh = ((xg - xg.mean(-1, keepdim=True)) / torch.sqrt(xg.var(-1, unbiased=False, keepdim=True) + mod.eps)).reshape(xi.shape)
                        d = torch.stack([(g * xh).sum((2, 3)), g.sum((2, 3))], -1)
                    else:
                        xh = (xi - xi.mean(-1, keepdim=True)) / torch.sqrt(xi.var(-1, unbiased=False, keepdim=True) + mod.eps)
                        cols = [(g * xh).sum(1)] + ([g.sum(1)] if mod.bias is not None else [])
                        d = torch.stack(cols, -1)
                    want[k] = want[k] + d.square().sum(0) / S
                model.zero_grad(set_to_none=True)
    finally:
        for h in hs:
            h.remove()
    for k in NORMS:
        assert _rel(stats.layers[k].diag, want[k]) < TOL, k
    with torch.no_grad():
        targets = sample_targets(model(x), y, fisher="empirical")
    ref = exact_fisher_diag(model, x, targets, norm_layers="diag")
    emp = collect_statistics(model, [(x, y)], fisher="empirical", norm_layers="diag")
    assert list(ref) == list(emp.layers)
    for k, ls in emp.layers.items():
        assert _rel(ls.diag, ref[k]) < TOL, k


def test_convnext_layer_norm_2d_and_layer_scale_match_torch_func():
    tv = pytest.importorskip("torchvision")
    from torchvision.models.convnext import CNBlockConfig

    torch.manual_seed(0)
    model = tv.models.ConvNeXt([CNBlockConfig(4, 8, 1), CNBlockConfig(8, None, 1)], num_classes=3,
                               layer_scale=0.5).to(F64).eval()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=F64)
    y = torch.tensor([0, 2])
    mods, infos, excluded = find_layers(model, norm_layers="diag")
    assert excluded == {}
    assert sum(isinstance(m, ScaleView) for m in mods.values()) == 2
    assert sum(i.numel for i in infos.values()) == sum(p.numel() for p in model.parameters())
    stats = collect_statistics(model, [(x, y)], fisher="empirical", norm_layers="diag")
    ref = exact_fisher_diag(model, x, y, norm_layers="diag")
    assert list(ref) == list(stats.layers)
    for k, ls in stats.layers.items():
        assert _rel(ls.diag, ref[k]) < 1e-9, k


@pytest.fixture(scope="module")
def problem():
    model, x, y = _problem()
    batches = [(x[:3], y[:3]), (x[3:], y[3:])]
    stats = collect_statistics(model, batches, generator=torch.Generator().manual_seed(0), norm_layers="diag")
    basis = eigenbasis(stats)
    assert not any(k in basis for k in NORMS)
    stats = collect_statistics(model, batches, generator=torch.Generator().manual_seed(0), basis=basis,
                               norm_layers="diag")
    assert stats.has_efb and all(stats.layers[k].efb is None for k in NORMS)
    posts = {m: build_posterior(stats, m, rank=3 if m == "inf" else None, n_data=30.0, prior_precision=0.7, basis=basis)
             for m in METHODS}
    D = sum(info.numel for info in stats.infos.values())
    masks = select_subnetwork(stats, D // 3, prior_precision=0.7)
    Fs, count = collect_subnet_fisher(model, batches, masks, fisher="ggn")
    posts["subnet"] = build_subnet_posterior(Fs, count, masks, n_data=30.0, prior_precision=0.7)
    return model, x, stats, posts


def test_every_method_has_a_diagonal_block_for_norm_layers(problem):
    _, _, stats, posts = problem
    for method in METHODS:
        post = posts[method]
        assert list(post.layers) == list(stats.layers)
        for k in NORMS:
            lp = post.layers[k]
            assert isinstance(lp, DiagLayer), (method, k)
            assert _rel(lp.precision, 30.0 * stats.layers[k].diag / stats.count + 0.7) < TOL
        for k, lp in post.layers.items():
            m, n = lp.shape
            eye = unvec(torch.eye(m * n, dtype=F64), m, n)
            Fm = vec(lp.scale_matvec(eye)).T
            assert _rel(Fm @ Fm.T, torch.linalg.inv(lp.to_dense())) < TOL, (method, k)
    assert posts["kfac"].info["diag_norm_layers"] == len(NORMS)
    # subnet (whole network): rows of gather(F scatter(I_S)) are the columns of F
    sub = posts["subnet"]
    Ft = sub.gather(sub.scale_matvec(sub.scatter(torch.eye(sub.size, dtype=F64))))
    assert _rel(Ft.T @ Ft, torch.linalg.inv(sub.to_dense())) < TOL


@pytest.mark.parametrize("method", [*METHODS, "subnet"])
def test_glm_covariance_equals_dense(problem, method):
    model, x, _, posts = problem
    post = posts[method]
    J = dense_jacobian(model, x, list(post.layers), norm_layers="diag")
    want = J @ dense_covariance(post) @ J.transpose(1, 2)
    assert _rel(glm_covariance(model, post, x), want) < TOL


def test_draws_through_norm_layers_are_the_explicit_forward(problem):
    model, x, _, posts = problem
    modules = find_layers(model, norm_layers="diag")[0]
    post = posts["kfac"]
    delta = draw_sample(post, 0, 2)
    with torch.no_grad(), perturbed(modules, delta):
        got = model(x)

    def p(name, col):
        mod = getattr(model, name)
        return (mod.weight if col == 0 else mod.bias).detach() + delta[name][:, col]

    with torch.no_grad():
        h = F.conv2d(x, *(model.conv.weight.detach() + delta["conv"][:, :-1].reshape(4, 2, 3, 3),
                          model.conv.bias.detach() + delta["conv"][:, -1]), padding=1)
        h = torch.tanh(F.batch_norm(h, model.bn.running_mean, model.bn.running_var, p("bn", 0), p("bn", 1),
                                    False, 0.0, model.bn.eps))
        h = torch.tanh(F.group_norm(h, 2, p("gn", 0), p("gn", 1), model.gn.eps))
        s = F.layer_norm(h.flatten(2).transpose(1, 2), (4,), p("ln", 0), p("ln", 1), model.ln.eps)
        s = torch.tanh(s @ (model.lin.weight + delta["lin"][:, :-1]).T + model.lin.bias + delta["lin"][:, -1])
        s = F.layer_norm(s, (3,), p("ln_nobias", 0), None, model.ln_nobias.eps)
        want = torch.tanh(s).mean(1) @ (model.fc.weight + delta["fc"][:, :-1]).T + model.fc.bias + delta["fc"][:, -1]
    assert _rel(got, want) < TOL
    # the MC predictive finds the norm layers by itself; input space agrees with weight space
    p_w = MCPredictor(model, post, n_samples=3, seed=0, sample_space="weights").predict(x)
    assert _rel(MCPredictor(model, post, n_samples=3, seed=0, sample_space="inputs").predict(x), p_w) < TOL


def test_sizes_count_norm_layers_as_diagonal_under_every_method():
    model, _, _ = _problem()
    base = model_sizes(model)
    rep = model_sizes(model, norm_layers="diag", rank=2)
    extra = 4 * 2 + 4 * 2 + 4 * 2 + 3 * 1
    for meth in ("diag", "kfac", "kfac_exact", "efb"):
        assert rep.totals[meth] == base.totals[meth] + extra
    assert rep.num_weights == base.num_weights + extra == sum(p.numel() for p in model.parameters())
    cov = rep.coverage
    assert cov["fraction"] == 1.0 and cov["weights_at_map"] == 0 and cov["at_map_by_type"] == {}
    bc = base.coverage
    assert bc["weights_at_map"] == extra and bc["at_map_by_type"] == {"BatchNorm2d": 8, "GroupNorm": 8, "LayerNorm": 11}
