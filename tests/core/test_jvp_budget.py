"""The MC-GLM predictive's memory budget (laplace_core.predictive.jvp_budget).

A resnet18's MC-GLM search on the search's batches of 64 images at 224 px put two search actors
at 9.7 and 11.0 GB (10 directions x 64 examples in one vmap-ed JVP) and Ray's memory monitor
killed them. The plan splits the directions and the batch; the probabilities must not change.
"""
from __future__ import annotations

import torch
from torch import nn

from laplace_core.curvature.collect import collect_statistics
from laplace_core.posteriors.build import build_posterior
from laplace_core.predictive.glm import GLMPredictor
from laplace_core.predictive.jvp_budget import PARAM_COPIES, forward_with_bytes, jvp_plan

F64 = torch.float64


def test_the_plan_keeps_directions_and_examples_within_the_budget():
    mib = 2**20
    # resnet18 at 224 px: 47 MB of weights, 33.5 MiB of module outputs per example, 10 directions
    k, b = jvp_plan(10, 16, 64, int(33.5 * mib), 47_000_000, budget=2048 * mib)
    assert (k, b) == (4, 8)
    assert k * PARAM_COPIES * 47_000_000 + k * b * 33.5 * mib <= 2048 * mib
    assert jvp_plan(10, 16, 64, 1000, 4000, budget=2048 * mib) == (10, 64)  # a small model: one call, as before
    assert jvp_plan(30, 16, 64, 1000, 4000, budget=2048 * mib) == (16, 64)  # chunk still caps the directions
    assert jvp_plan(10, 16, 64, 10**12, 10**12, budget=mib) == (1, 1)  # nothing fits: one of each, never zero
    # room for 9 examples of a batch of 60: 6, a divisor, so every JVP has the same shape
    assert jvp_plan(1, 16, 60, 100, 0, budget=900) == (1, 6)


def test_module_output_bytes_are_counted_per_example():
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh()).to(F64)
    out, per = forward_with_bytes(net, torch.randn(5, 4, dtype=F64))
    # Linear [5, 3] + Tanh [5, 3] + the Sequential's own output [5, 3], float64, per example
    assert out.shape == (5, 3) and per == 3 * 3 * 8
    assert not net._forward_hooks and not net[0]._forward_hooks  # the hooks are removed


def test_a_split_batch_and_split_directions_give_the_same_probabilities():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 4)).to(F64).eval()
    x = torch.randn(12, 2, 4, 4, dtype=F64)
    y = torch.randint(0, 4, (12,))
    stats = collect_statistics(net, [(x, y)], generator=torch.Generator().manual_seed(0))
    post = build_posterior(stats, "diag", n_data=12.0, prior_precision=0.5)
    xt = torch.randn(7, 2, 4, 4, dtype=F64)
    whole = GLMPredictor(net, post, 10, seed=3)
    split = GLMPredictor(net, post, 10, seed=3, jvp_bytes=1)  # one direction and one example per JVP
    assert jvp_plan(10, 16, 7, 1, 1, budget=1) == (1, 1)
    p_whole, p_split = whole.predict(xt), split.predict(xt)
    assert not torch.equal(p_whole, net(xt).softmax(-1))  # the directions move the predictive
    torch.testing.assert_close(p_split, p_whole, rtol=0, atol=1e-12)
    f0, jv = split.logit_directions(xt)
    assert jv.shape == (10, 7, 4)
