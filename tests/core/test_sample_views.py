"""Input-space draws on the layer views (laplace_core.predictive.sample_apply): grouped and depthwise
convolutions, the packed q/k/v projection of ``nn.MultiheadAttention`` and linear layers
applied with ``F.linear`` on 3-D inputs (``out_proj``, torchvision Swin's ``qkv`` / ``proj``).

Ground truth: the weight-space forward, the same draw (:func:`draw_sample`) added to the
weights with :func:`laplace_core.curvature.layers.perturbed` and the model run as usual (the library's
own attention, fused kernel included), in float64; the input-space route
(``applied(..., "inputs")``) must agree to 1e-10 relative to the largest output, and must have
been taken (``used``), so that a route that silently fell back to the weights cannot pass.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_core.curvature.collect import collect_statistics
from laplace_core.basis.eigenbasis import eigenbasis
from laplace_core.curvature.layers import GroupView, InProjView, TapView, find_layers, perturbed
from laplace_core.posteriors.build import build_posterior
from laplace_core.predictive.monte_carlo import MCPredictor, draw_sample, draw_sample_factored
from laplace_core.predictive.sample_apply import applied, draw_costs

F64 = torch.float64
TOL = 1e-10  # relative to the largest entry of the weight-space output
FACTORED = ("kfac", "kfac_exact", "efb")


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _posteriors(model, x, methods=FACTORED):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        y = torch.randint(0, model(x).shape[1], (x.shape[0],), generator=g)
    batches = [(x[:3], y[:3]), (x[3:], y[3:])]
    stats = collect_statistics(model, batches, generator=torch.Generator().manual_seed(1))
    basis = eigenbasis(stats)
    stats = collect_statistics(model, batches, generator=torch.Generator().manual_seed(1), basis=basis)
    return {m: build_posterior(stats, m, n_data=40.0, prior_precision=0.5, basis=basis) for m in methods}


def _both_ways(model, post, x, t, space="inputs", only=None, forward=None):
    """``(reference, output, used)`` for draw ``t`` (restricted to the layers ``only``)."""
    forward = forward or model
    modules = find_layers(model)[0]
    plain, fact = draw_sample(post, 0, t), draw_sample_factored(post, 0, t)
    if only is not None:
        plain, fact = {k: plain[k] for k in only}, {k: fact[k] for k in only}
    with torch.no_grad(), perturbed(modules, plain):
        ref = forward(x)
    used: dict[str, str] = {}
    with torch.no_grad(), applied(modules, fact, space, used):
        out = forward(x)
    return ref, out, used


# --------------------------------------------------------------------------- grouped convolutions
class GroupNet(nn.Module):
    """groups 2 (stride 2, padding 1, bias) -> depthwise (padding 2, dilation 2, no bias) ->
    groups 3 (padding "same", dilation (1, 2), bias) -> depthwise with channel multiplier 2
    (stride (2, 1), no padding, bias) -> Linear."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2, bias=True)
        self.c2 = nn.Conv2d(6, 6, 3, padding=2, dilation=2, groups=6, bias=False)
        self.c3 = nn.Conv2d(6, 9, (3, 2), padding="same", dilation=(1, 2), groups=3, bias=True)
        self.c4 = nn.Conv2d(9, 18, 2, stride=(2, 1), groups=9, bias=True)
        self.fc = nn.Linear(18 * 2 * 5, 4)

    def forward(self, x):
        h = torch.tanh(self.c2(torch.tanh(self.c1(x))))
        h = torch.tanh(self.c4(torch.tanh(self.c3(h))))
        return self.fc(h.flatten(1))


@pytest.fixture(scope="module")
def group_problem():
    torch.manual_seed(0)
    model = GroupNet().to(F64).eval()
    x = torch.randn(6, 4, 9, 11, generator=torch.Generator().manual_seed(2), dtype=F64)
    return model, x, _posteriors(model, x)


@pytest.mark.parametrize("method", FACTORED)
def test_grouped_and_depthwise_convolutions_inputs_equal_weights(group_problem, method):
    model, x, posts = group_problem
    modules = find_layers(model)[0]
    assert sum(isinstance(v, GroupView) for v in modules.values()) == 2 + 6 + 3 + 9
    for t in range(2):
        ref, out, used = _both_ways(model, posts[method], x, t)
        assert used == {k: "inputs" for k in modules}, used
        assert _rel(out, ref) < TOL, (method, t, _rel(out, ref))


def test_some_groups_of_a_convolution_alone(group_problem):
    """Groups without a draw keep the MAP: their output channels get no delta."""
    model, x, posts = group_problem
    only = ["c1.group1", "c2.group0", "c2.group4", "c3.group2", "c4.group5"]
    ref, out, used = _both_ways(model, posts["kfac"], x, 0, only=only)
    assert used == {k: "inputs" for k in only}
    assert _rel(out, ref) < TOL
    with torch.no_grad():
        assert not torch.equal(out, model(x))  # the draw did something


def test_grouped_auto_follows_the_summed_costs(group_problem):
    model, x, posts = group_problem
    post = posts["kfac"]
    pred = MCPredictor(model, post, n_samples=2, seed=3, sample_space="auto")
    ref = MCPredictor(model, post, n_samples=2, seed=3, sample_space="weights").predict(x)
    assert _rel(pred.predict(x), ref) < TOL
    modules = find_layers(model)[0]
    # columns per convolution for this batch: B x output positions
    columns = {"c1": 6 * 5 * 6, "c2": 6 * 5 * 6, "c3": 6 * 5 * 6, "c4": 6 * 2 * 5}
    for conv, cols in columns.items():
        names = [k for k in modules if k.startswith(conv + ".group")]
        bias = modules[names[0]].bias is not None
        costs = [draw_costs(*post.layers[k].shape, post.layers[k].shape[1] - bias, cols) for k in names]
        want = "inputs" if sum(c[1] for c in costs) < sum(c[0] for c in costs) else "weights"
        assert {pred.used[k] for k in names} == {want}, conv
    # every group here is cheaper in weight space (m/g <= 2 outputs against >= 60 columns)
    assert {pred.used[k] for k in modules if k != "fc"} == {"weights"}


# --------------------------------------------------------------------------- attention
class AttentionNet(nn.Module):
    """Conv -> sequence of positions -> MultiheadAttention (self-attention, or cross-attention
    with ``cross=True``) -> Linear applied to the 3-D sequence -> mean -> Linear."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, stride=2)
        self.att = nn.MultiheadAttention(6, 2, batch_first=batch_first)
        self.mix = nn.Linear(6, 5)
        self.fc = nn.Linear(5, 3)
        self.batch_first = batch_first
        self.cross = False
        self.need_weights = False

    def forward(self, x):
        seq = self.conv(x).flatten(2).transpose(1, 2)  # (B, L, E)
        q = seq
        kv = torch.tanh(seq) if self.cross else seq
        if not self.batch_first:
            q, kv = q.transpose(0, 1), (kv.transpose(0, 1) if self.cross else q.transpose(0, 1))
        if not self.cross:
            kv = q
        a = self.att(q, kv, kv, need_weights=self.need_weights)[0]
        if not self.batch_first:
            a = a.transpose(0, 1)
        return self.fc(torch.tanh(self.mix(torch.tanh(a))).mean(1))


@pytest.fixture(scope="module", params=[True, False], ids=["batch_first", "seq_first"])
def attention_problem(request):
    torch.manual_seed(4)
    model = AttentionNet(request.param).to(F64).eval()
    x = torch.randn(6, 3, 7, 7, generator=torch.Generator().manual_seed(5), dtype=F64)
    return model, x, _posteriors(model, x)


@pytest.mark.parametrize("method", FACTORED)
def test_attention_in_projection_inputs_equal_weights(attention_problem, method):
    model, x, posts = attention_problem
    modules = find_layers(model)[0]
    assert isinstance(modules["att.in_proj"], InProjView) and isinstance(modules["att.out_proj"], TapView)
    for t in range(2):
        ref, out, used = _both_ways(model, posts[method], x, t)
        assert used == {k: "inputs" for k in modules}, used
        assert _rel(out, ref) < TOL, (method, t, _rel(out, ref))
    # the in-projection alone, with the attention weights requested
    model.need_weights = True
    try:
        ref, out, used = _both_ways(model, posts[method], x, 0, only=["att.in_proj"])
    finally:
        model.need_weights = False
    assert used == {"att.in_proj": "inputs"} and _rel(out, ref) < TOL


def test_attention_calls_the_input_route_cannot_take_go_to_the_weights(attention_problem):
    """Cross-attention (query is not key): the library function runs with ``W + δ`` as its
    projection arguments; the numbers are those of the weights perturbed in place."""
    model, x, posts = attention_problem
    model.cross = True
    try:
        ref, out, used = _both_ways(model, posts["kfac"], x, 1)
    finally:
        model.cross = False
    assert used["att.in_proj"] == "weights" and used["att.out_proj"] == "weights"
    assert used["mix"] == used["conv"] == "inputs"
    assert _rel(out, ref) < TOL


def test_attention_auto_and_predictor_agree(attention_problem):
    model, x, posts = attention_problem
    for method in ("kfac", "efb"):
        ref = MCPredictor(model, posts[method], n_samples=3, seed=1, sample_space="weights").predict(x)
        for space in ("inputs", "auto"):
            pred = MCPredictor(model, posts[method], n_samples=3, seed=1, sample_space=space)
            assert _rel(pred.predict(x), ref) < TOL, (method, space)
    # auto: 6 x 9 = 54 columns; in_proj m = 18, n = 7: weights cost 18*7*25 = 3150 < 54*(6*7+7*18+18*18+6)
    assert pred.used["att.in_proj"] == pred.used["att.out_proj"] == "weights"  # the library attention, W + δ


def test_swin_window_attention_tapped_linears_on_three_dimensional_inputs():
    """torchvision Swin's ``qkv`` / ``proj`` (TapViews, ``F.linear`` on ``(B·windows, N, C)``)."""
    from torchvision.models.swin_transformer import ShiftedWindowAttention

    class SwinNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Conv2d(3, 8, 2, stride=2)
            self.attn = ShiftedWindowAttention(8, [2, 2], [1, 1], num_heads=2)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            h = self.embed(x).permute(0, 2, 3, 1)  # (B, H, W, C)
            return self.head(torch.tanh(self.attn(h)).mean((1, 2)))

    torch.manual_seed(6)
    model = SwinNet().to(F64).eval()
    x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(7), dtype=F64)
    posts = _posteriors(model, x, ("kfac", "efb"))
    modules = find_layers(model)[0]
    assert isinstance(modules["attn.qkv"], TapView) and isinstance(modules["attn.proj"], TapView)
    for method, post in posts.items():
        ref, out, used = _both_ways(model, post, x, 0)
        assert used == {k: "inputs" for k in modules}, used
        assert _rel(out, ref) < TOL, (method, _rel(out, ref))


def test_map_restored_and_mode_left_even_when_the_forward_fails(attention_problem, group_problem):
    for model, x, posts in (attention_problem, group_problem):
        modules = find_layers(model)[0]
        before = {k: v.clone() for k, v in model.state_dict().items()}
        draw = draw_sample_factored(posts["kfac"], 0, 0)
        for space in ("inputs", "auto"):
            with pytest.raises(RuntimeError), torch.no_grad(), applied(modules, draw, space):
                model(x[:, :2])  # wrong channel count: the first convolution raises
            assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), space
            assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
            assert not torch.overrides._is_torch_function_mode_enabled()
        with torch.no_grad():
            assert torch.equal(model(x), model(x))
