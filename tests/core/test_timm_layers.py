"""timm's own layers against dense float64 ground truth (issue 40): its ``Attention`` (fused ``qkv``
Linear, ``F.scaled_dot_product_attention``) in a tiny ViT, Swin's window attention (``qkv`` / ``proj``
called on ``(B·windows, N, C)``) in a tiny Swin, and the norm + activation layers of
``timm.layers.norm_act`` (``BatchNormAct2d``, ``GroupNormAct``, ``LayerNormAct2d``: normalise, then an
in-place activation inside the module) under ``norm_layers="diag"``.

Ground truths, independent of laplace_core.curvature.hooks: exact per-example gradients from
``torch.func`` (tests/core/fisher_reference.py) for the Fisher diagonal; ``jacrev`` Jacobians and the
posterior's dense covariance for the GLM predictive; the weights of a deep copy overwritten with
``W + δ`` for the sampling predictive.
"""
from __future__ import annotations

import copy
import os
import sys
import warnings

import pytest
import torch
from torch import nn

from laplace_core.basis.eigenbasis import eigenbasis
from laplace_core.curvature.collect import collect_statistics
from laplace_core.curvature.layers import find_layers, owner_params
from laplace_core.posteriors.build import build_posterior
from laplace_core.predictive.glm import glm_covariance
from laplace_core.predictive.monte_carlo import MCPredictor, draw_sample

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fisher_reference import dense_covariance, dense_jacobian, exact_fisher_diag, tiny_images as _data  # noqa: E402

timm = pytest.importorskip("timm")
F64 = torch.float64
TOL = 1e-9  # relative to the largest entry of the reference


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _norm_act_net() -> nn.Module:
    from timm.layers.norm_act import BatchNormAct2d, GroupNormAct, LayerNormAct2d

    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), BatchNormAct2d(4, act_layer=nn.SiLU, inplace=True),
                        nn.Conv2d(4, 4, 3, padding=1, groups=2), GroupNormAct(4, 2, act_layer=nn.ReLU, inplace=True),
                        nn.Conv2d(4, 4, 1), LayerNormAct2d(4, act_layer=nn.GELU),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    with torch.no_grad():  # running statistics that are not the identity
        net[1].running_mean.uniform_(-0.5, 0.5)
        net[1].running_var.uniform_(0.5, 2.0)
        for m in (net[1], net[3], net[5]):
            m.weight.uniform_(0.5, 1.5)
            m.bias.uniform_(-0.5, 0.5)
    return net


def _model(arch: str) -> nn.Module:
    torch.manual_seed(0)
    if arch == "vit":
        from timm.models.vision_transformer import VisionTransformer
        model = VisionTransformer(img_size=8, patch_size=4, embed_dim=4, depth=1, num_heads=2, mlp_ratio=1.5,
                                  num_classes=3)
    elif arch == "swin":  # stage 1: 4x4 tokens in 4 windows of 2x2 (shifted in block 2); stage 2: one window
        from timm.models.swin_transformer import SwinTransformer
        model = SwinTransformer(img_size=8, patch_size=2, window_size=2, embed_dim=4, depths=(2, 1), num_heads=(1, 2),
                                num_classes=3)
    else:
        model = _norm_act_net()
    return model.to(F64).eval()


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # vmap's fallback for the SDPA kernel: slow, not wrong
        yield


@pytest.mark.parametrize("norm", ["map", "diag"])
@pytest.mark.parametrize("arch", ["vit", "swin", "norm_act"])
def test_fisher_diagonal_of_timm_layers_is_exact(arch, norm):
    model = _model(arch)
    x, y = _data()
    mods, _, excluded = find_layers(model, norm_layers=norm)
    stats = collect_statistics(model, [(x[:2], y[:2]), (x[2:], y[2:])], fisher="empirical", norm_layers=norm)
    ref = exact_fisher_diag(model, x, y, norm_layers=norm)
    assert list(ref) == list(stats.layers)
    for name, ls in stats.layers.items():
        assert _rel(ls.diag, ref[name]) < TOL, name
    kinds = {type(m).__name__ for m in mods.values()}
    if arch == "norm_act" and norm == "diag":
        assert {"BatchNormAct2d", "GroupNormAct", "LayerNormAct2d"} <= kinds and not excluded
    elif arch == "norm_act":
        assert set(excluded) == {"1", "3", "5"}
    else:  # the attention projections are plain modules, seen through their module hooks
        assert any(k.endswith("attn.qkv") for k in mods) and any(k.endswith("attn.proj") for k in mods)


def test_a_norm_subclass_with_modules_of_its_own_stays_at_map():
    class NormThenAct(nn.BatchNorm2d):  # not timm's: where its affine output is, is not known
        def __init__(self):
            super().__init__(4)
            self.act = nn.ReLU()

        def forward(self, x):
            return self.act(super().forward(x))

    _, _, excluded = find_layers(nn.Sequential(nn.Conv2d(3, 4, 1), NormThenAct()), norm_layers="diag")
    assert "calls modules of its own after normalising" in excluded["1"]


def _posteriors(model, x, y, methods):
    batches = [(x[:2], y[:2]), (x[2:], y[2:])]
    stats = collect_statistics(model, batches, generator=torch.Generator().manual_seed(0), norm_layers="diag")
    basis = eigenbasis(stats)
    stats = collect_statistics(model, batches, generator=torch.Generator().manual_seed(0), basis=basis,
                               norm_layers="diag")
    return {m: build_posterior(stats, m, rank=4 if m == "inf" else None, n_data=30.0, prior_precision=0.7,
                               basis=basis) for m in methods}


@pytest.fixture(scope="module", params=["vit", "swin"])
def attention_problem(request):
    model = _model(request.param)
    x, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return model, x, _posteriors(model, x, y, ("diag", "kfac", "efb", "inf"))


@pytest.mark.parametrize("method", ["diag", "kfac", "efb", "inf"])
def test_glm_covariance_of_timm_attention_equals_dense(attention_problem, method):
    model, x, posts = attention_problem
    post = posts[method]
    J = dense_jacobian(model, x, list(post.layers), norm_layers="diag")
    want = J @ dense_covariance(post) @ J.transpose(1, 2)
    assert _rel(glm_covariance(model, post, x), want) < TOL


@pytest.mark.parametrize("method", ["diag", "kfac"])
def test_sampling_predictive_of_timm_attention_is_the_forward_with_perturbed_weights(attention_problem, method):
    """Each draw's logits equal a deep copy's forward with ``W + δ`` written into its parameters;
    the ``inputs`` sample space gives the same predictions as ``weights``."""
    model, x, posts = attention_problem
    post = posts[method]
    mods = find_layers(model, norm_layers="diag")[0]
    probs = []
    for t in range(2):
        delta = draw_sample(post, 0, t)
        twin = copy.deepcopy(model)
        tmods = find_layers(twin, norm_layers="diag")[0]
        with torch.no_grad():
            for k, d in delta.items():
                owner, _, wa, ba, rows = owner_params(tmods[k], k)
                w = getattr(owner, wa)
                w[rows] += d[:, :w[rows][0].numel()].reshape(w[rows].shape)
                if ba is not None:
                    getattr(owner, ba)[rows] += d[:, -1]
            probs.append(torch.softmax(twin(x), -1))
    want = torch.stack(probs).mean(0)
    got = MCPredictor(model, post, n_samples=2, seed=0, sample_space="weights").predict(x)
    assert _rel(got, want) < TOL
    assert set(post.layers) <= set(mods)
    if method == "kfac":
        pred = MCPredictor(model, post, n_samples=2, seed=0, sample_space="inputs")
        assert _rel(pred.predict(x), got) < TOL
