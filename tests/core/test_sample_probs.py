"""Per-sample probabilities of the predictors (``sample_probs``, what ``infoform score`` derives the
expected entropy and mutual information from): ``[K, B, C]``, each row a distribution, the
samples distinct, and their mean is the predictor's own ``predict`` (the audit's numbers) for
MC weight sampling, MC-GLM and the closed-form last-layer GLM.
"""
from __future__ import annotations

import pytest
import torch

import laplace_core as lc
from laplace_core.predictive.glm import GLMPredictor
from laplace_core.predictive.last_layer import LastLayerGLMPredictor
from laplace_core.predictive.monte_carlo import MCPredictor
from pipelines.ingest.models import tiny_cnn
from pipelines.serve.uncertainty import entropy, predict_columns

MEAN_TOL = 1e-6  # float32 output of predict vs the float64 mean of the samples, cast
K = 5


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = tiny_cnn(4).eval()
    batches = [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(2)]
    posts = {}
    for layers in ("all", "last"):
        stats = lc.collect_statistics(model, batches, fisher="mc", mc_samples=1,
                                      generator=torch.Generator().manual_seed(2), layers=layers)
        posts[layers] = lc.build_posterior(stats, method="diag", n_data=50.0, prior_precision=30.0)
    x = torch.randn(6, 3, 8, 8, generator=g)
    return model, posts, x


@pytest.mark.parametrize("kind", ["nn", "glm", "last"])
def test_mean_of_sample_probs_is_predict(setup, kind):
    model, posts, x = setup
    if kind == "nn":
        pred = MCPredictor(model, posts["all"], K, seed=3)
    elif kind == "glm":
        pred = GLMPredictor(model, posts["all"], K, 3, link="mc", variance="mc")
    else:
        pred = LastLayerGLMPredictor(model, posts["last"], K, 3, link="mc")
    sp = pred.sample_probs(x)
    assert sp.shape == (K, 6, 4) and sp.dtype == torch.float64
    assert torch.allclose(sp.sum(-1), torch.ones(K, 6, dtype=torch.float64), atol=1e-12)
    assert (sp[0] - sp[1]).abs().max() > 1e-4  # distinct draws
    assert (sp.mean(0).to(torch.float32) - pred.predict(x)).abs().max() <= MEAN_TOL


def test_uncertainty_columns_decompose_the_entropy(setup):
    """entropy = expected entropy + mutual information, MI >= 0, top-k sorted, max prob = top-1;
    for MAP there is no decomposition (NaN)."""
    model, posts, x = setup
    pred = MCPredictor(model, posts["all"], K, seed=3)
    cols = predict_columns(model, pred, x, top_k=3, keep_probs=True)
    sp = pred.sample_probs(x)
    ref_exp = entropy(sp).mean(0).numpy()
    assert abs(cols["expected_entropy"] - ref_exp).max() < 1e-12
    ent = entropy(torch.from_numpy(cols["probs"]).double()).numpy()
    assert abs(cols["entropy"] - ent).max() < 1e-12
    assert abs(cols["mutual_information"] - (cols["entropy"] - ref_exp)).max() < 1e-12
    assert (cols["mutual_information"] >= 0).all() and cols["mutual_information"].max() > 0
    assert (cols["topk_probs"][:, :-1] >= cols["topk_probs"][:, 1:]).all()
    assert (cols["max_prob"] == cols["topk_probs"][:, 0]).all() and (cols["pred"] == cols["probs"].argmax(1)).all()
    m = predict_columns(model, None, x, top_k=3)
    assert torch.isnan(torch.from_numpy(m["mutual_information"])).all() and "probs" not in m
