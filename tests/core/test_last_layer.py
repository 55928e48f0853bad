"""Last-layer Laplace: the layer selection and the closed-form GLM logit covariance.

* :func:`laplace_core.curvature.layer_selection.select_layers` (all / last / names / globs, one-line errors);
  ``find_layers(layers=...)`` lists what it leaves out; statistics collected over a selection
  equal the same layers' block of the full statistics (bit for bit: the same hooks, sums).
* ``(φ^T ⊗ I) Σ (φ ⊗ I)`` (:func:`laplace_core.predictive.last_layer.last_layer_covariance`) equals the
  dense ``J Σ J^T`` for every structure, ``J`` from ``torch.func.jacrev`` and ``Σ`` the dense
  inverse of the dense precision (float64, 1e-10 relative to ``max |J Σ J^T|``).
* The predictor's links on that covariance: probit links equal the formulas on the dense
  covariance; the "mc" link equals softmax-averaging ``f + chol(J Σ J^T) z_t`` with the
  keyed ``z_t``, and does not depend on how inputs are batched.
* torchvision resnet18 with ``layers="last"``: a real pass on tiny inputs gives statistics and
  posteriors over ``fc`` only, whose sizes are what ``infoform sizes --layers last`` reports.
"""
from __future__ import annotations

import os
import sys

import json

import pytest
import torch
from torch import nn

from laplace_core.curvature.collect import collect_statistics
from laplace_core.basis.eigenbasis import eigenbasis
from laplace_core.predictive.glm import GLMPredictor, glm_covariance, probit_pairwise, probit_pi8
from laplace_core.predictive.last_layer import (
    LastLayerGLMPredictor, last_layer_covariance, last_layer_glm_covariance, last_linear_layer,
)
from laplace_core.curvature.layer_selection import LayerSelectionError, check_selection, select_layers
from laplace_core.curvature.layers import DESELECTED, find_layers
from laplace_core.posteriors.build import build_posterior
from laplace_core.predictive.monte_carlo import sample_generator
from laplace_core.posteriors.sizes import model_sizes
from laplace_core.curvature.subnet_fisher import collect_subnet_fisher
from laplace_core.posteriors.subnet import build_subnet_posterior, select_subnetwork

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # not ``tests.core...``: a wheel may ship a ``tests``
from fisher_reference import dense_covariance, dense_jacobian  # noqa: E402

F64 = torch.float64
EXACT_TOL = 1e-10  # relative to max |J Σ J^T|
METHODS = ("diag", "kfac", "kfac_exact", "efb", "inf", "subnet")


# --------------------------------------------------------------------------- selection
NAMES = ("conv1", "layer1.0.conv1", "layer1.0.conv2", "layer4.1.conv2", "fc")


def test_select_layers_all_last_names_and_globs():
    assert select_layers(NAMES, "all") == NAMES
    assert select_layers(NAMES, "last") == ("fc",)
    assert select_layers(NAMES, ["fc", "conv1"]) == ("conv1", "fc")  # model order, not pattern order
    assert select_layers(NAMES, ["layer1"]) == ("layer1.0.conv1", "layer1.0.conv2")  # a containing module
    assert select_layers(NAMES, ["layer*.conv2"]) == ("layer1.0.conv2", "layer4.1.conv2")
    assert select_layers(NAMES, "fc") == ("fc",)  # one name as a string


def test_select_layers_errors_are_one_line_with_valid_names():
    with pytest.raises(LayerSelectionError) as e:
        select_layers(NAMES, ["fc", "head*"])
    msg = str(e.value)
    assert "\n" not in msg and "'head*' matches no curvature layer" in msg and "conv1" in msg and "fc" in msg
    for bad in ([], [""], 3, [1]):
        with pytest.raises(ValueError, match="layers must be 'all', 'last' or a non-empty list"):
            check_selection(bad)


def _grouped() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.ReLU(), nn.Flatten(), nn.Linear(16, 3)).to(F64)


def test_find_layers_selection_lists_the_layers_left_at_map():
    model = _grouped()
    mods, infos, excluded = find_layers(model, layers="last")
    assert list(mods) == list(infos) == ["3"]
    assert excluded == {"0": DESELECTED}  # both groups left out: listed under the owning conv
    mods, _, excluded = find_layers(model, layers=["0.group0", "3"])
    assert list(mods) == ["0.group0", "3"] and excluded == {"0.group1": DESELECTED}  # only one group left out
    full = model_sizes(model).coverage
    cov = model_sizes(model, layers="last").coverage
    assert cov["weights_under_posterior"] == 3 * 17 and cov["layers"] == "last"
    assert cov["weights_at_map"] == full["weights_under_posterior"] - 3 * 17  # the conv's 40 weights at MAP
    assert cov["at_map_by_type"] == {"Conv2d": 4 * 9 + 4}


def _mlp(seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 4)).to(F64).eval()


def _data(model, n=24, seed=10):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=F64)
    y = torch.randint(0, 4, (n,), generator=g)
    return x, y


def test_statistics_over_a_selection_equal_that_block_of_the_full_statistics():
    model = _mlp()
    x, y = _data(model)
    batches = [(x[:12], y[:12]), (x[12:], y[12:])]
    full = collect_statistics(model, batches, generator=torch.Generator().manual_seed(0))
    last = collect_statistics(model, batches, generator=torch.Generator().manual_seed(0), layers="last")
    assert list(last.layers) == ["4"] and last.count == full.count
    assert set(last.excluded) == {"0", "2"}
    for f in ("A", "G", "diag"):
        assert torch.equal(getattr(last.layers["4"], f), getattr(full.layers["4"], f)), f
    basis = eigenbasis(last)
    efb_last = collect_statistics(model, batches, generator=torch.Generator().manual_seed(0), basis=basis,
                                  layers="last")
    efb_full = collect_statistics(model, batches, generator=torch.Generator().manual_seed(0),
                                  basis=eigenbasis(full))
    assert torch.allclose(efb_last.layers["4"].efb, efb_full.layers["4"].efb, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- closed form
def _last_layer_posterior(method, model=None):
    model = _mlp() if model is None else model
    x, y = _data(model)
    batches = [(x[:12], y[:12]), (x[12:], y[12:])]
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    stats = collect_statistics(model, batches, generator=g(), layers="last")
    if method == "subnet":
        masks = select_subnetwork(stats, 12, prior_precision=0.7)  # 12 of the 20 weights of W~
        F, count = collect_subnet_fisher(model, batches, masks, fisher="ggn")
        return model, build_subnet_posterior(F, count, masks, n_data=30.0, prior_precision=0.7)
    if method in ("efb", "inf"):
        stats = collect_statistics(model, batches, generator=g(), basis=eigenbasis(stats), layers="last")
    return model, build_posterior(stats, method, rank=3 if method == "inf" else None, n_data=30.0,
                                  prior_precision=0.7)


def _dense_logit_cov(model, post, x):
    J = dense_jacobian(model, x, list(post.layers))
    return J @ dense_covariance(post) @ J.transpose(1, 2)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("method", METHODS)
def test_closed_form_last_layer_covariance_equals_dense(method):
    model, post = _last_layer_posterior(method)
    assert [k for k, lp in post.layers.items() if getattr(lp, "size", 1)] == ["4"]
    xt, _ = _data(model, 5, 99)
    got = last_layer_glm_covariance(model, post, xt)
    assert got is not None
    out, cov = got
    want = _dense_logit_cov(model, post, xt)
    assert cov.dtype == F64 and cov.shape == (5, 4, 4)
    assert _rel(cov, want) < EXACT_TOL, (method, _rel(cov, want))
    with torch.no_grad():
        assert torch.equal(out, model(xt))
        phi = torch.cat([model[:4](xt), torch.ones(5, 1, dtype=F64)], 1)
    one_at_a_time = last_layer_covariance(post, "4", phi, max_elements=1)  # the INF / subnet blocks
    assert _rel(one_at_a_time, want) < EXACT_TOL
    # the generic route (C backward passes) agrees: the closed form is the same J Σ J^T
    assert _rel(glm_covariance(model, post, xt, closed_form=False), want) < EXACT_TOL


def test_closed_form_needs_a_last_linear_layer_whose_output_is_the_model_output():
    model = _mlp()
    x, y = _data(model)
    stats = collect_statistics(model, [(x, y)], generator=torch.Generator().manual_seed(0), layers=["2"])
    post = build_posterior(stats, "diag", n_data=30.0, prior_precision=0.7)
    assert last_linear_layer(model, post) == "2"  # a Linear, but its output is not the logits
    assert last_layer_glm_covariance(model, post, x[:3]) is None
    with pytest.raises(ValueError, match="not the model output"):
        LastLayerGLMPredictor(model, post, link="probit").predict(x[:3])
    sampled = GLMPredictor(model, post, n_samples=8, seed=3)
    fb = LastLayerGLMPredictor(model, post, n_samples=8, seed=3, fallback=sampled)
    assert torch.equal(fb.predict(x[:3]), sampled.predict(x[:3]))  # MC-GLM where the closed form does not apply
    full = build_posterior(collect_statistics(model, [(x, y)], generator=torch.Generator().manual_seed(0)), "diag")
    with pytest.raises(ValueError, match="needs a posterior over one nn.Linear"):
        LastLayerGLMPredictor(model, full)


def test_pipeline_glm_predictor_is_closed_form_for_a_last_layer_posterior():
    from pipelines.evaluation.predictors import make_predictor

    model, post = _last_layer_posterior("kfac")
    pred = make_predictor(model, post, "glm", 16, 0, 0)
    assert isinstance(pred, LastLayerGLMPredictor) and pred.link == "mc"
    xt, _ = _data(model, 3, 97)
    assert torch.allclose(pred.predict(xt).sum(-1), torch.ones(3, dtype=F64))
    x, y = _data(model)
    full = build_posterior(collect_statistics(model, [(x, y)], generator=torch.Generator().manual_seed(0)), "kfac")
    assert isinstance(make_predictor(model, full, "glm", 16, 0, 0), GLMPredictor)


@pytest.mark.parametrize("method", ["kfac", "inf", "subnet"])
def test_predictor_links_on_the_closed_form(method):
    model, post = _last_layer_posterior(method)
    xt, _ = _data(model, 6, 98)
    want = _dense_logit_cov(model, post, xt)
    with torch.no_grad():
        f = model(xt)
    p8 = LastLayerGLMPredictor(model, post, link="probit_pi8").predict(xt)
    assert _rel(p8, probit_pi8(f, torch.diagonal(want, dim1=-2, dim2=-1))) < 1e-10
    pp = LastLayerGLMPredictor(model, post, link="probit").predict(xt)
    assert _rel(pp, probit_pairwise(f, want)) < 1e-10
    K = 64
    mc = LastLayerGLMPredictor(model, post, n_samples=K, seed=5, link="mc")
    z = torch.stack([torch.randn(4, generator=sample_generator(5, t), dtype=F64) for t in range(K)])
    Lf, info = torch.linalg.cholesky_ex(want)  # any L with L L^T = Σ_f gives the same distribution;
    bad = info != 0  # the predictor's: Cholesky, eigh where a subnet leaves a whole logit at MAP (singular)
    lam, U = torch.linalg.eigh(want[bad])
    Lf[bad] = U * lam.clamp_min(0).sqrt()[:, None, :]
    ref = torch.softmax(f[None] + torch.einsum("bcd,kd->kbc", Lf, z), -1).mean(0)
    got = mc.predict(xt)
    assert float((got - ref).abs().max()) < 1e-9, method
    # batching does not change the draws, nor do the predictor's own row blocks
    parts = mc.predict_batches([xt[:2], xt[2:]])
    assert torch.allclose(torch.cat(parts), got, rtol=0, atol=1e-14)
    small = LastLayerGLMPredictor(model, post, n_samples=K, seed=5, link="mc", max_elements=1)
    assert len(small._rows(xt)) == 6 and torch.allclose(small.predict(xt), got, rtol=0, atol=1e-14)
    mean, var = mc.predict_mean_var(xt)
    assert torch.equal(mean, f) and _rel(var, torch.diagonal(want, dim1=-2, dim2=-1)) < 1e-10


# --------------------------------------------------------------------------- resnet18
def test_resnet18_last_layer_posterior_is_fc_only_with_the_size_sizes_reports(capsys):
    torchvision = pytest.importorskip("torchvision")
    from pipelines.cli.main import main

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3).to(F64).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 16, 16, generator=g, dtype=F64)
    y = torch.randint(0, 3, (2,), generator=g)
    stats = collect_statistics(model, [(x, y)], generator=torch.Generator().manual_seed(0), layers="last")
    assert list(stats.layers) == ["fc"] and stats.infos["fc"].shape == (3, 513)
    assert len([k for k, why in stats.excluded.items() if why == DESELECTED]) == 20  # every conv at MAP
    stats = collect_statistics(model, [(x, y)], generator=torch.Generator().manual_seed(0), layers="last",
                               basis=eigenbasis(stats))
    assert main(["sizes", "--model", "resnet18", "--num-classes", "3", "--layers", "last", "--norm-layers", "map",
                 "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["num_layers"] == 1 and [ls["name"] for ls in rep["layers"]] == ["fc"]
    assert rep["num_weights"] == 3 * 513 and rep["coverage"]["layers"] == "last"
    for method in ("diag", "kfac", "kfac_exact", "efb"):
        post = build_posterior(stats, method, n_data=10.0, prior_precision=1.0)
        assert list(post.layers) == ["fc"]
        assert post.num_stored() == rep["methods"][method]["numbers"], method
    assert model_sizes(model, layers="last").to_json()["methods"] == rep["methods"]
    post = build_posterior(stats, "kfac", n_data=10.0, prior_precision=1.0)
    out, cov = last_layer_glm_covariance(model, post, x[:2])
    assert _rel(cov, glm_covariance(model, post, x[:2], closed_form=False)) < EXACT_TOL


def test_predictors_give_exact_log_probabilities_of_their_probabilities():
    """Issue 27: every MC predictive's ``predict_batches_stats`` is the log of its probabilities
    (log-mean-exp of the draws, float64) plus the draws' mean entropy; the probit links have none."""
    from laplace_core.predictive.monte_carlo import MCPredictor

    model, post = _last_layer_posterior("kfac")
    x, _ = _data(model, 7, 99)
    for pred in (MCPredictor(model, post, 5, 3), GLMPredictor(model, post, 5, 3),
                 LastLayerGLMPredictor(model, post, n_samples=5, seed=3, max_elements=40)):
        p = torch.cat(pred.predict_batches([x[:3], x[3:]]))
        stats = pred.predict_batches_stats([x[:3], x[3:]])
        lp, ent = torch.cat([s[0] for s in stats]), torch.cat([s[1] for s in stats])
        assert float((torch.exp(lp) - p).abs().max()) < 1e-14, type(pred).__name__
        h = -(p * torch.log(p)).sum(-1)
        assert bool((ent <= h + 1e-12).all()) and bool((ent > 0).all())  # E H(p_t) <= H(E p_t)
    assert LastLayerGLMPredictor(model, post, link="probit").predict_batches_stats([x]) is None
