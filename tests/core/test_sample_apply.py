"""laplace_core.predictive.sample_apply: a factored draw ``δ = L C R^T`` applied to a layer's inputs
(``δ x~`` added to the output) gives the predictions of ``δ`` added to the weights.

Ground truth: the weight-space forward with :func:`laplace_core.curvature.layers.perturbed` and the
deltas of :func:`laplace_core.predictive.monte_carlo.draw_sample` (itself checked against explicit
``F.conv2d`` / ``F.linear`` forwards in test_predictive.py), float64, on convolutions with
padding, stride, dilation and no bias, and on linear layers with 2-D and 3-D inputs.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_core.curvature.collect import collect_statistics
from laplace_core.basis.eigenbasis import eigenbasis
from laplace_core.curvature.layers import find_layers, perturbed
from laplace_core.posteriors.build import build_posterior
from laplace_core.predictive.monte_carlo import MCPredictor, draw_sample, draw_sample_factored, sample_generator
from laplace_core.predictive.sample_apply import applied, draw_costs, input_space_cheaper
from laplace_core.posteriors.structures.base import ScaleFactors

F64 = torch.float64
EXACT = 1e-12  # same draw, another summation order: rounding only (relative to the largest entry)
FACTORED = ("kfac", "kfac_exact", "efb")


def _conv_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1), nn.Tanh(),
        nn.Conv2d(6, 5, 3, stride=2, bias=False), nn.Tanh(),
        nn.Conv2d(5, 4, 2, dilation=2, padding=(2, 1)), nn.Tanh(),
        nn.Flatten(), nn.Linear(4 * 5 * 2, 30),
    ).to(F64).eval()


def _posterior(model, x, method, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        y = torch.randint(0, model(x).shape[1], (x.shape[0],), generator=g)
    batches = [(x[:6], y[:6]), (x[6:], y[6:])]
    stats = collect_statistics(model, batches, generator=torch.Generator().manual_seed(1))
    basis = eigenbasis(stats)
    if method in ("efb", "inf"):
        stats = collect_statistics(model, batches, generator=torch.Generator().manual_seed(1), basis=basis)
    return build_posterior(stats, method, rank=4 if method == "inf" else None, n_data=50.0, prior_precision=0.5,
                           basis=basis)


@pytest.fixture(scope="module")
def conv_problem():
    model = _conv_net()
    x = torch.randn(12, 2, 7, 6, generator=torch.Generator().manual_seed(2), dtype=F64)
    return model, x, {m: _posterior(model, x, m) for m in (*FACTORED, "inf", "diag")}


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _both_ways(model, post, x, t, space="inputs"):
    """``(reference, output, used)``: draw ``t`` added to the weights (``perturbed``), and
    applied by ``applied(..., space)``."""
    modules = find_layers(model)[0]
    with torch.no_grad(), perturbed(modules, draw_sample(post, 0, t)):
        ref = model(x)
    used: dict[str, str] = {}
    with torch.no_grad(), applied(modules, draw_sample_factored(post, 0, t), space, used):
        out = model(x)
    return ref, out, used


def test_costs_pick_inputs_where_columns_are_few():
    # resnet18 layer4 conv at 64x64, batch 32: 2x2 positions, 128 columns, m = 512, n = 9 * 512 + 1
    w, i = draw_costs(512, 4609, 4608, 128)
    assert (w, i) == (512 * 4609 * (512 + 4609), 128 * (4608 * 4609 + 4609 * 512 + 512 * 512 + 4608))
    assert input_space_cheaper(512, 4609, 4608, 128) and w > 3.5 * i
    # layer1 conv: 16x16 positions x 32 images, m = 64: weights
    assert not input_space_cheaper(64, 577, 576, 32 * 256)
    # a 1000-class classifier (resnet50 fc) at batch 64: inputs
    assert input_space_cheaper(1000, 2049, 2048, 64)
    # break-even is about columns = m
    assert input_space_cheaper(256, 2305, 2304, 200) and not input_space_cheaper(256, 2305, 2304, 300)


@pytest.mark.parametrize("method", FACTORED)
def test_factored_draw_is_the_sample_bit_for_bit(conv_problem, method):
    _, _, posts = conv_problem
    post = posts[method]
    plain = post.sample(1, sample_generator(0, 3))
    fact = post.sample_factored(1, sample_generator(0, 3))
    for k, d in plain.items():
        assert isinstance(fact[k], ScaleFactors)
        assert torch.equal(fact[k].matrix(), d)
    assert all(torch.equal(a.matrix()[0] if isinstance(a, ScaleFactors) else a, draw_sample(post, 0, 5)[k])
               for k, a in draw_sample_factored(post, 0, 5).items())


@pytest.mark.parametrize("method", FACTORED)
def test_inputs_equal_weights_on_convolutions(conv_problem, method):
    model, x, posts = conv_problem
    post = posts[method]
    for t in range(3):
        ref, out, used = _both_ways(model, post, x, t)
        assert used == {k: "inputs" for k in post.layers}
        assert _rel(out, ref) < EXACT, (method, t, _rel(out, ref))
        ref, out, used = _both_ways(model, post, x, t, "weights")
        assert torch.equal(out, ref) and used == {}  # weights: the old path, bit for bit


@pytest.mark.parametrize("method", FACTORED)
def test_mc_predictor_spaces_agree_and_auto_follows_the_costs(conv_problem, method):
    model, x, posts = conv_problem
    post = posts[method]
    preds = {s: MCPredictor(model, post, n_samples=4, seed=7, sample_space=s) for s in ("weights", "inputs", "auto")}
    p = {s: pr.predict(x) for s, pr in preds.items()}
    assert _rel(p["inputs"], p["weights"]) < EXACT and _rel(p["auto"], p["weights"]) < EXACT
    assert set(preds["inputs"].used.values()) == {"inputs"} and preds["weights"].used == {}
    # auto: per layer, the cheaper of the two for the columns this batch gives it
    columns = {"0": 12 * 7 * 6, "2": 12 * 3 * 2, "4": 12 * 5 * 2, "7": 12}
    for k, lp in post.layers.items():
        m, n = lp.shape
        k_in = n - (find_layers(model)[0][k].bias is not None)
        want = "inputs" if input_space_cheaper(m, n, k_in, columns[k]) else "weights"
        assert preds["auto"].used[k] == want, (k, want)
    assert set(preds["auto"].used.values()) == {"inputs", "weights"}  # both ways are exercised here
    # predict_batches: the same numbers
    pb = preds["inputs"].predict_batches([x[:5], x[5:]])
    assert _rel(torch.cat(pb), p["weights"]) < EXACT


def test_a_delta_is_formed_once_per_sample_across_batches(conv_problem, monkeypatch):
    """``predict_batches`` (samples outer, batches inner): a layer that goes to the weights
    forms its delta once per sample, not once per batch."""
    model, x, posts = conv_problem
    calls = []
    matrix = ScaleFactors.matrix
    monkeypatch.setattr(ScaleFactors, "matrix", lambda self: calls.append(1) or matrix(self))
    pred = MCPredictor(model, posts["kfac"], n_samples=3, seed=2, sample_space="auto")
    out = pred.predict_batches([x[:4], x[4:8], x[8:]])
    n_weights = sum(v == "weights" for v in pred.used.values())
    assert 0 < n_weights < len(posts["kfac"].layers) and len(calls) == 3 * n_weights
    monkeypatch.setattr(ScaleFactors, "matrix", matrix)
    ref = MCPredictor(model, posts["kfac"], n_samples=3, seed=2, sample_space="weights").predict_batches(
        [x[:4], x[4:8], x[8:]])
    assert all(_rel(a, b) < EXACT for a, b in zip(out, ref))


def test_structures_without_factors_go_to_the_weights(conv_problem):
    model, x, posts = conv_problem
    for method in ("inf", "diag"):
        a = MCPredictor(model, posts[method], n_samples=3, seed=1, sample_space="inputs")
        b = MCPredictor(model, posts[method], n_samples=3, seed=1, sample_space="weights")
        assert torch.equal(a.predict(x), b.predict(x)) and a.used == {}


def test_linear_on_three_dimensional_inputs_and_float32_model():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 9), nn.Tanh(), nn.Linear(9, 3, bias=False)).to(F64).eval()
    x = torch.randn(10, 5, 4, generator=torch.Generator().manual_seed(4), dtype=F64)
    g = torch.Generator().manual_seed(5)
    y = torch.randn(10, 5, 3, generator=g, dtype=F64)
    stats = collect_statistics(model, [(x.reshape(-1, 4), y.reshape(-1, 3))], likelihood="regression",
                               generator=torch.Generator().manual_seed(6))
    post = build_posterior(stats, "kfac", n_data=20.0, prior_precision=1.0)
    ref, out, used = _both_ways(model, post, x, 0)
    assert used == {"0": "inputs", "2": "inputs"} and out.shape == (10, 5, 3)
    assert _rel(out, ref) < EXACT
    # float32 model, float64 posterior: the delta is computed in float64 and cast, as for weights
    ref32, out32, _ = _both_ways(model.to(torch.float32), post, x.float(), 0)
    assert out32.dtype == torch.float32 and _rel(out32.double(), ref32.double()) < 1e-5


def test_layers_input_space_cannot_handle_fall_back_to_weights():
    torch.manual_seed(8)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(),
                          nn.Conv2d(3, 3, 3, padding="same"), nn.Flatten(), nn.Linear(3 * 16, 4)).to(F64).eval()
    x = torch.randn(12, 2, 4, 4, generator=torch.Generator().manual_seed(9), dtype=F64)
    ref, out, used = _both_ways(model, _posterior(model, x, "kfac"), x, 1)
    assert used == {"0": "inputs", "2": "weights", "4": "inputs"}  # padding="same": not unfolded
    assert _rel(out, ref) < EXACT


def test_map_restored_and_hooks_removed_even_when_the_forward_fails(conv_problem):
    model, x, posts = conv_problem
    modules = find_layers(model)[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    draw = draw_sample_factored(posts["kfac"], 0, 0)
    for space in ("weights", "inputs", "auto"):
        with pytest.raises(RuntimeError), torch.no_grad(), applied(modules, draw, space):
            model(x[:, :1])  # wrong channel count: the first conv raises after its pre-hook ran
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), space
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with pytest.raises(ValueError, match="unknown sample space 'both'"):
        with applied(modules, draw, "both"):
            pass
    with pytest.raises(ValueError, match="unknown sample_space"):
        MCPredictor(model, posts["kfac"], sample_space="both")
