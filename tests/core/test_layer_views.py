"""Layer views (grouped / depthwise convolutions, attention projections) against dense float64 ground truth.

Ground truths, independent of laplace_core.curvature.hooks: hand-written patch loops over each group's
input channels and autograd output gradients (``retain_grad``) of the whole convolution for
``A`` / ``G``; for ``nn.MultiheadAttention`` an explicit per-head attention written here (checked
to reproduce the module's output) whose q/k/v tensor is differentiated by autograd; exact
per-example gradients from ``torch.func`` (tests/core/fisher_reference.py) for the Fisher
diagonal and block (EFB); ``jacrev`` Jacobians and dense inverses for the GLM covariance.
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from laplace_core.curvature.collect import collect_statistics
from laplace_core.curvature.likelihoods import sample_targets
from laplace_core.basis.eigenbasis import eigenbasis
from laplace_core.predictive.glm import glm_covariance, glm_jvp
from laplace_core.curvature.layers import GroupView, InProjView, TapView, find_layers, perturbed
from laplace_core.posteriors.build import build_posterior
from laplace_core.predictive.monte_carlo import MCPredictor, draw_sample
from laplace_core.posteriors.structures.base import unvec, vec
from laplace_core.curvature.subnet_fisher import collect_subnet_fisher
from laplace_core.posteriors.subnet import build_subnet_posterior, select_subnetwork

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fisher_reference import (  # noqa: E402
    dense_covariance, dense_jacobian, exact_fisher_blocks, exact_fisher_diag, hand_patches,
)

F64 = torch.float64
TOL = 1e-10  # relative to the largest entry of the reference
METHODS = ("diag", "kfac", "kfac_exact", "efb", "inf")


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


class ViewNet(nn.Module):
    """Grouped conv (groups 2, stride 2, padding 1, bias) -> depthwise conv (padding 2, dilation 2,
    no bias) -> MultiheadAttention over the 3x3 positions -> Linear."""

    def __init__(self, batch_first: bool = True):
        super().__init__()
        self.c1 = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2, bias=True)
        self.c2 = nn.Conv2d(6, 6, 3, padding=2, dilation=2, groups=6, bias=False)
        self.att = nn.MultiheadAttention(6, 2, batch_first=batch_first)
        self.fc = nn.Linear(6, 3)
        self.batch_first = batch_first

    def forward(self, x, attention=None):
        h = torch.tanh(self.c2(torch.tanh(self.c1(x))))
        seq = h.flatten(2).transpose(1, 2)  # (B, L, E)
        if attention is not None:
            a = attention(seq)
        elif self.batch_first:
            a = self.att(seq, seq, seq, need_weights=False)[0]
        else:
            s = seq.transpose(0, 1)
            a = self.att(s, s, s, need_weights=False)[0].transpose(0, 1)
        return self.fc(torch.tanh(a).mean(1))


def _problem(batch_first=True, seed=0):
    torch.manual_seed(seed)
    model = ViewNet(batch_first).to(F64).eval()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(5, 4, 6, 6, generator=g, dtype=F64)
    y = torch.randint(0, 3, (5,), generator=g)
    return model, x, y


def _explicit_attention(mha: nn.MultiheadAttention, qkv_store: dict):
    """Per-head softmax attention written out; the q/k/v tensor is kept for autograd."""

    def run(seq):  # (B, L, E)
        E, H = mha.embed_dim, mha.num_heads
        d = E // H
        qkv = seq @ mha.in_proj_weight.T + mha.in_proj_bias
        qkv.retain_grad()
        qkv_store["qkv"] = qkv
        heads = []
        for h in range(H):
            q = qkv[..., h * d:(h + 1) * d]
            k = qkv[..., E + h * d:E + (h + 1) * d]
            v = qkv[..., 2 * E + h * d:2 * E + (h + 1) * d]
            w = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d), dim=-1)
            heads.append(w @ v)
        o = torch.cat(heads, -1)
        out = o @ mha.out_proj.weight.T + mha.out_proj.bias
        o.retain_grad()
        out.retain_grad()
        qkv_store["o"], qkv_store["out"] = o, out
        return out

    return run




def _reference_rows(model, x, targets):
    """``name -> (a (B, T, n), [g (B, T, m) per draw])`` without laplace_core.curvature.hooks."""
    ins, outs, store = {}, {}, {}
    # the explicit attention is the module's function
    assert _rel(model(x, attention=_explicit_attention(model.att, {})).detach(), model(x).detach()) < TOL

    def keep(name):
        def hook(mod, args, out):
            ins[name] = args[0].detach()
            out.retain_grad()
            outs[name] = out

        return hook

    hs = [model.c1.register_forward_hook(keep("c1")), model.c2.register_forward_hook(keep("c2"))]
    rows = {}
    try:
        for s in range(targets.shape[0]):
            out = model(x, attention=_explicit_attention(model.att, store))
            torch.log_softmax(out, 1).gather(1, targets[s][:, None]).sum().backward()
            B = x.shape[0]
            for conv in ("c1", "c2"):
                mod = getattr(model, conv)
                gr = outs[conv].grad.reshape(B, mod.out_channels, -1).transpose(1, 2)
                m, c = mod.out_channels // mod.groups, mod.in_channels // mod.groups
                for k in range(mod.groups):
                    a = hand_patches(mod, ins[conv][:, k * c:(k + 1) * c])
                    rows.setdefault(f"{conv}.group{k}", (a, []))[1].append(gr[:, :, k * m:(k + 1) * m])
            seq = store["qkv"].grad.new_ones(B, store["qkv"].shape[1], 1)
            xin = torch.tanh(model.c2(torch.tanh(model.c1(x)))).flatten(2).transpose(1, 2).detach()
            rows.setdefault("att.in_proj", (torch.cat([xin, seq], 2), []))[1].append(store["qkv"].grad)
            rows.setdefault("att.out_proj", (torch.cat([store["o"].detach(), seq], 2), []))[1].append(store["out"].grad)
    finally:
        for h in hs:
            h.remove()
    model.zero_grad(set_to_none=True)
    return rows


def test_find_layers_names_views_and_shapes():
    model, _, _ = _problem()
    mods, infos, excluded = find_layers(model)
    assert list(mods) == ["c1.group0", "c1.group1", *(f"c2.group{k}" for k in range(6)), "att.in_proj", "att.out_proj", "fc"]
    assert isinstance(mods["c1.group1"], GroupView) and isinstance(mods["att.in_proj"], InProjView)
    assert isinstance(mods["att.out_proj"], TapView)
    assert infos["c1.group0"].shape == (3, 2 * 9 + 1) and infos["c2.group3"].shape == (1, 9)
    assert infos["att.in_proj"].shape == (18, 7) and infos["att.out_proj"].shape == (6, 7)
    assert excluded == {}
    # the views' tensors are rows of the module's parameters
    assert torch.equal(mods["c1.group1"].weight, model.c1.weight[3:6])
    assert torch.equal(mods["c1.group1"].bias, model.c1.bias[3:6])
    assert mods["c2.group0"].bias is None
    # every parameter is covered exactly once
    assert sum(i.numel for i in infos.values()) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("fisher,S", [("mc", 2), ("empirical", 1)])
def test_sums_match_hand_written_and_diag_matches_torch_func(batch_first, fisher, S):
    model, x, y = _problem(batch_first)
    stats = collect_statistics(model, [(x, y)], fisher=fisher, mc_samples=S, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        targets = sample_targets(model(x), y, fisher=fisher, mc_samples=S, generator=torch.Generator().manual_seed(3))
    rows = _reference_rows(model, x, targets)
    for name, (a, gs) in rows.items():
        T = a.shape[1]
        A = torch.einsum("bti,btj->ij", a, a) / T
        G = sum(torch.einsum("bti,btj->ij", g, g) for g in gs) / S
        diag = sum(torch.einsum("bti,btj->bij", g, a).square().sum(0) for g in gs) / S
        assert _rel(stats.layers[name].A, A) < TOL, name
        assert _rel(stats.layers[name].G, G) < TOL, name
        assert _rel(stats.layers[name].diag, diag) < TOL, name
    ref = exact_fisher_diag(model, x, targets)
    assert list(ref) == list(stats.layers)
    for name, ls in stats.layers.items():
        assert _rel(ls.diag, ref[name]) < TOL, name


def test_efb_equals_diagonal_of_rotated_exact_block():
    model, x, y = _problem()
    base = collect_statistics(model, [(x, y)], fisher="empirical")
    basis = eigenbasis(base)
    stats = collect_statistics(model, [(x, y)], fisher="empirical", basis=basis)
    blocks = exact_fisher_blocks(model, x, y)
    for name, ls in stats.layers.items():
        V = torch.kron(basis[name].U_A, basis[name].U_G)
        m, n = ls.efb.shape
        lam = torch.diagonal(V.T @ blocks[name] @ V).reshape(n, m).T
        assert _rel(ls.efb / stats.efb_count, lam) < TOL, name


def _posteriors(model, x, y):
    batches = [(x[:3], y[:3]), (x[3:], y[3:])]
    stats = collect_statistics(model, batches, generator=torch.Generator().manual_seed(0))
    basis = eigenbasis(stats)
    stats = collect_statistics(model, batches, generator=torch.Generator().manual_seed(0), basis=basis)
    out = {m: build_posterior(stats, m, rank=4 if m == "inf" else None, n_data=30.0, prior_precision=0.7, basis=basis)
           for m in METHODS}
    D = sum(info.numel for info in stats.infos.values())
    masks = select_subnetwork(stats, D // 3, prior_precision=0.7)
    Fs, count = collect_subnet_fisher(model, batches, masks, fisher="ggn")
    out["subnet"] = build_subnet_posterior(Fs, count, masks, n_data=30.0, prior_precision=0.7)
    return out


@pytest.fixture(scope="module")
def problem():
    model, x, y = _problem()
    return model, x, y, _posteriors(model, x, y)


def test_scale_factor_squares_to_the_covariance(problem):
    _, _, _, posts = problem
    for method in METHODS:
        for name, lp in posts[method].layers.items():
            m, n = lp.shape
            eye = unvec(torch.eye(m * n, dtype=F64), m, n)
            Fm = vec(lp.scale_matvec(eye)).T
            assert _rel(Fm @ Fm.T, torch.linalg.inv(lp.to_dense())) < TOL, (method, name)
    # subnet (whole network): rows of gather(F scatter(I_S)) are the columns of F
    sub = posts["subnet"]
    Ft = sub.gather(sub.scale_matvec(sub.scatter(torch.eye(sub.size, dtype=F64))))
    assert _rel(Ft.T @ Ft, torch.linalg.inv(sub.to_dense())) < TOL


@pytest.mark.parametrize("method", [*METHODS, "subnet"])
def test_glm_covariance_and_jvp_equal_dense(problem, method):
    model, x, _, posts = problem
    post = posts[method]
    J = dense_jacobian(model, x, list(post.layers))
    want = J @ dense_covariance(post) @ J.transpose(1, 2)
    assert _rel(glm_covariance(model, post, x), want) < TOL
    if method == "kfac":
        deltas = post.sample(2, torch.Generator().manual_seed(4))
        flat = torch.cat([vec(deltas[k]) for k in post.layers], dim=1)
        assert _rel(glm_jvp(model, x, deltas), torch.einsum("bcd,kd->kbc", J, flat)) < TOL
        # one group alone: the other groups of its convolution get a zero direction
        off = sum(post.layers[k].shape[0] * post.layers[k].shape[1] for k in ["c1.group0"])
        D1 = post.layers["c1.group1"].shape[0] * post.layers["c1.group1"].shape[1]
        got = glm_jvp(model, x, {"c1.group1": deltas["c1.group1"][0]})
        assert _rel(got, J[:, :, off:off + D1] @ flat[0, off:off + D1]) < TOL


def test_weight_space_draw_is_the_explicit_forward_and_input_space_agrees(problem):
    """A draw added through the views equals the forward with hand-assembled full weights; the
    ``inputs`` sample space (the views' input-space routes) gives the same predictions."""
    model, x, _, posts = problem
    modules = find_layers(model)[0]
    for method in ("kfac", "efb", "diag"):
        post = posts[method]
        delta = draw_sample(post, 0, 1)
        with torch.no_grad(), perturbed(modules, delta):
            got = model(x)
        w1 = model.c1.weight.detach().clone()
        b1 = model.c1.bias.detach().clone()
        for k in range(2):
            d = delta[f"c1.group{k}"]
            w1[3 * k:3 * k + 3] += d[:, :-1].reshape(3, 2, 3, 3)
            b1[3 * k:3 * k + 3] += d[:, -1]
        w2 = model.c2.weight.detach() + torch.cat([delta[f"c2.group{k}"].reshape(1, 1, 3, 3) for k in range(6)])
        mha = model.att
        wi = mha.in_proj_weight.detach() + delta["att.in_proj"][:, :-1]
        bi = mha.in_proj_bias.detach() + delta["att.in_proj"][:, -1]
        wo = mha.out_proj.weight.detach() + delta["att.out_proj"][:, :-1]
        bo = mha.out_proj.bias.detach() + delta["att.out_proj"][:, -1]
        with torch.no_grad():
            h = torch.tanh(F.conv2d(x, w1, b1, stride=2, padding=1, groups=2))
            h = torch.tanh(F.conv2d(h, w2, None, padding=2, dilation=2, groups=6))
            s = h.flatten(2).transpose(1, 2)
            qkv = s @ wi.T + bi
            q, k_, v = qkv.unflatten(-1, (3, 2, 3)).permute(2, 0, 3, 1, 4)
            o = (torch.softmax(q @ k_.transpose(-1, -2) / math.sqrt(3), -1) @ v).permute(0, 2, 1, 3).reshape(5, -1, 6)
            a = o @ wo.T + bo
            fc_d = delta["fc"]
            want = torch.tanh(a).mean(1) @ (model.fc.weight + fc_d[:, :-1]).T + model.fc.bias + fc_d[:, -1]
        assert _rel(got, want) < TOL, method
        p_w = MCPredictor(model, post, n_samples=3, seed=0, sample_space="weights").predict(x)
        pred = MCPredictor(model, post, n_samples=3, seed=0, sample_space="inputs")
        assert _rel(pred.predict(x), p_w) < TOL, method
        if method != "diag":  # factored draws: every layer, views included, takes its input-space route
            assert {k: pred.used[k] for k in modules} == {k: "inputs" for k in modules}
    # MAP restored exactly
    with torch.no_grad():
        assert torch.equal(model.c1.weight, model.c1.weight.detach().clone())


@pytest.mark.parametrize("arch", ["vit", "swin", "convnext"])
def test_torchvision_transformer_shapes_diag_matches_torch_func(arch):
    """Tiny torchvision ViT / Swin / ConvNeXt (their own attention code paths): every parameter
    of an attention projection or grouped conv is covered, and the diagonal is exact."""
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    if arch == "vit":
        model = tv.models.VisionTransformer(image_size=8, patch_size=4, num_layers=1, num_heads=2, hidden_dim=4,
                                            mlp_dim=6, num_classes=3)
    elif arch == "swin":
        model = tv.models.SwinTransformer(patch_size=[2, 2], embed_dim=4, depths=[1, 1], num_heads=[1, 2],
                                          window_size=[2, 2], num_classes=3)
    else:
        from torchvision.models.convnext import CNBlockConfig
        model = tv.models.ConvNeXt([CNBlockConfig(4, 8, 1), CNBlockConfig(8, None, 1)], num_classes=3)
    model = model.to(F64).eval()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=F64)
    y = torch.tensor([0, 2])
    mods, infos, excluded = find_layers(model)
    stats = collect_statistics(model, [(x, y)], fisher="empirical")
    ref = exact_fisher_diag(model, x, y)
    assert list(ref) == list(stats.layers)
    for name, ls in stats.layers.items():
        assert _rel(ls.diag, ref[name]) < 1e-9, name
    kinds = {type(m).__name__ for m in mods.values()}
    assert {"vit": "InProjView", "swin": "TapView", "convnext": "GroupView"}[arch] in kinds
