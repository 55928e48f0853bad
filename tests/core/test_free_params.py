"""Free parameters under ``norm_layers="diag"`` (issue 40): parameters of no Linear / Conv / norm module
(timm ViT's ``pos_embed`` / ``cls_token``, ``LayerScale.gamma``, timm ConvNeXt blocks' ``gamma``) get the
exact Fisher diagonal and a diagonal posterior block, against dense float64 ground truth.

Ground truths, independent of laplace_core (no ``torch.func``): per-example gradients from a plain loop of
``backward()`` calls, one example and label at a time; ``jacrev``'s Jacobian and the posterior's dense
covariance for the GLM; a deep copy's forward with ``p + δ`` written into the parameters for the draws.
The posteriors here cover the free parameters alone, so a predictive that ignored them would return the
MAP's output (each test also checks that it does not).
"""
from __future__ import annotations

import copy
import os
import sys
import warnings

import pytest
import torch

from laplace_core.curvature.collect import collect_statistics
from laplace_core.curvature.layers import FreeView, find_layers
from laplace_core.curvature.likelihoods import sample_targets
from laplace_core.curvature.subnet_fisher import collect_subnet_fisher
from laplace_core.posteriors.build import build_posterior
from laplace_core.posteriors.sizes import model_sizes
from laplace_core.predictive.glm import GLMPredictor, glm_covariance
from laplace_core.predictive.monte_carlo import MCPredictor, draw_sample

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fisher_reference import dense_covariance, dense_jacobian, tiny_images as _data, vec  # noqa: E402

timm = pytest.importorskip("timm")
F64 = torch.float64
TOL = 1e-10  # relative to the largest entry of the reference
FREE = {"vit": ["cls_token", "pos_embed", "blocks.0.ls1.gamma", "blocks.0.ls2.gamma"],
        "convnext": ["1.gamma", "2.gamma"]}


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _model(arch: str):
    torch.manual_seed(0)
    if arch == "vit":
        from timm.models.vision_transformer import VisionTransformer
        model = VisionTransformer(img_size=8, patch_size=4, embed_dim=4, depth=1, num_heads=2, mlp_ratio=1.5,
                                  num_classes=3, init_values=0.5)
    else:  # timm's ConvNeXt blocks, channels-last MLP (gamma on NHWC) and conv MLP (gamma on NCHW)
        from timm.models.convnext import ConvNeXtBlock
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 2, stride=2),
                                    ConvNeXtBlock(4, kernel_size=3, ls_init_value=0.5, mlp_ratio=1.5),
                                    ConvNeXtBlock(4, kernel_size=3, ls_init_value=0.5, mlp_ratio=1.5, conv_mlp=True),
                                    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3))
    model = model.to(F64).eval()
    with torch.no_grad():  # free parameters far from their (tiny or constant) initial values
        for name in FREE[arch]:
            p = model.get_parameter(name)
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name.endswith("gamma") else 0.0))
    return model


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # vmap's fallback for the SDPA kernel: slow, not wrong
        yield


def _loop_grads(model, x, targets, names):
    """``{name: (S, B, *shape)}``: ``∂ log p(targets[s, k] | x_k) / ∂ p`` by one backward per example."""
    params = {n: model.get_parameter(n) for n in names}
    out = {n: torch.zeros(targets.shape[0], x.shape[0], *p.shape, dtype=F64) for n, p in params.items()}
    for s in range(targets.shape[0]):
        for k in range(x.shape[0]):
            logp = torch.log_softmax(model(x[k:k + 1]), -1)[0, targets[s, k]]
            for n, g in zip(names, torch.autograd.grad(logp, list(params.values()))):
                out[n][s, k] = g
    return out


@pytest.mark.parametrize("arch", ["vit", "convnext"])
def test_free_parameters_get_the_exact_fisher_diagonal(arch):
    """MC Fisher with two label draws: ``Σ_k (1/S) Σ_s d∘d`` equals the backward loop's; the free
    parameters are layers of their own (``FreeView``) only under ``norm_layers="diag"``."""
    model = _model(arch)
    x, _ = _data()
    mods, _, excluded = find_layers(model, norm_layers="diag")
    assert [k for k, m in mods.items() if isinstance(m, FreeView)] == FREE[arch] and not excluded
    assert not any(isinstance(m, FreeView) for m in find_layers(model, norm_layers="map")[0].values())
    stats = collect_statistics(model, [(x, None)], mc_samples=2, generator=torch.Generator().manual_seed(5),
                               norm_layers="diag")
    with torch.no_grad():
        targets = sample_targets(model(x), None, mc_samples=2, generator=torch.Generator().manual_seed(5))
    ref = _loop_grads(model, x, targets, FREE[arch])
    for name in FREE[arch]:
        want = ref[name].square().sum(1).mean(0)
        assert stats.layers[name].diag.shape == stats.infos[name].shape
        assert _rel(stats.layers[name].diag, want.reshape(stats.infos[name].shape)) < TOL, name
    assert stats.layers[FREE[arch][0]].A is None  # diagonal only


@pytest.fixture(scope="module", params=["vit", "convnext"])
def free_posterior(request):
    """A diagonal posterior over the free parameters alone (``layers=`` their names)."""
    model = _model(request.param)
    x, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        stats = collect_statistics(model, [(x[:2], y[:2]), (x[2:], y[2:])], fisher="empirical", norm_layers="diag",
                                   layers=FREE[request.param])
    post = build_posterior(stats, "kfac", n_data=30.0, prior_precision=0.7)  # free layers: diagonal blocks
    assert list(post.layers) == FREE[request.param]
    return request.param, model, x, y, post


def test_glm_covariance_and_jvp_linearise_the_free_parameters(free_posterior):
    arch, model, x, _, post = free_posterior
    J = dense_jacobian(model, x, list(post.layers), norm_layers="diag")
    want = J @ dense_covariance(post) @ J.transpose(1, 2)
    got = glm_covariance(model, post, x)
    assert _rel(got, want) < TOL and float(want.diagonal(dim1=1, dim2=2).min()) > 1e-6
    pred = GLMPredictor(model, post, n_samples=2, seed=3)
    _, jv = pred.logit_directions(x)  # J η_t by forward-mode AD
    for t in range(2):
        eta = torch.cat([vec(d) for d in draw_sample(post, 3, t).values()])
        assert _rel(jv[t], J @ eta) < TOL


def test_sampling_predictive_perturbs_the_free_parameters(free_posterior):
    arch, model, x, _, post = free_posterior
    probs = []
    for t in range(2):
        twin = copy.deepcopy(model)
        with torch.no_grad():
            for k, d in draw_sample(post, 0, t).items():
                p = twin.get_parameter(k)
                p += d.reshape(p.shape)
            probs.append(torch.softmax(twin(x), -1))
    want = torch.stack(probs).mean(0)
    got = MCPredictor(model, post, n_samples=2, seed=0).predict(x)
    assert _rel(got, want) < TOL
    with torch.no_grad():
        assert float((got - torch.softmax(model(x), -1)).abs().max()) > 1e-4  # not the MAP


def test_subnet_fisher_over_free_entries_equals_the_backward_loop(free_posterior):
    """Subnetwork Laplace may select free entries: ``Σ_k d_S d_S^T`` at the selected positions."""
    arch, model, x, y, _ = free_posterior
    names = FREE[arch][-2:]
    infos = find_layers(model, norm_layers="diag")[1]
    masks = {k: torch.zeros(infos[k].shape, dtype=torch.bool) for k in names}
    for k in names:
        masks[k].view(-1)[::2] = True
    F, count = collect_subnet_fisher(model, [(x, y)], masks, fisher="empirical")
    ref = _loop_grads(model, x, y[None], names)
    d = torch.cat([vec(ref[k][0].reshape(x.shape[0], *infos[k].shape))[:, vec(masks[k].double()).bool()]
                   for k in names], 1)
    assert count == 4 and _rel(F, d.T @ d) < TOL


def test_sizes_name_the_free_parameters_at_map_and_count_them_under_diag():
    model = _model("vit")
    at_map = model_sizes(model, norm_layers="map").coverage
    assert "cls_token, pos_embed: parameters of no Linear" in at_map["at_map_why"]["VisionTransformer"]
    assert "LayerScale" in at_map["at_map_by_type"]
    diag = model_sizes(model, norm_layers="diag").coverage
    assert diag["weights_at_map"] == 0 and diag["fraction"] == 1.0
