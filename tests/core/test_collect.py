"""collect_statistics against independent computations (float64, fixed seeds).

Ground truths: hand-written patch loops for A, autograd output gradients for G,
exact per-example gradients from ``torch.func`` (tests/core/fisher_reference.py) for
the Fisher diagonal, the exact Fisher block and the EFB eigenvalues.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

from laplace_core.curvature.collect import collect_efb, collect_statistics
from laplace_core.curvature.likelihoods import sample_targets
from laplace_core.curvature.accumulate import efb_contraction_order
from laplace_core.basis.eigenbasis import eigenbasis
from laplace_core.curvature.layers import find_layers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fisher_reference import exact_fisher_blocks, exact_fisher_diag, hand_patches, per_example_grads, vec  # noqa: E402

F64 = torch.float64
TOL = 1e-10  # relative to the largest entry of the reference


def _close(actual, expected, tol=TOL):
    scale = expected.abs().max().clamp_min(1e-300)
    err = (actual - expected).abs().max() / scale
    assert err < tol, f"relative error {float(err):.3e} >= {tol}"


class ConvNet(nn.Module):
    """Conv (stride 2, padding 1, dilation 2, bias) -> ReLU -> Conv (no bias) -> Linear -> Linear (no bias).
    Activations are out-of-place so tests can read layer-output gradients with retain_grad."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, stride=2, padding=1, dilation=2, bias=True)
        self.c2 = nn.Conv2d(4, 5, 2, stride=1, padding=0, bias=False)
        self.f1 = nn.Linear(5 * 2 * 2, 6)
        self.f2 = nn.Linear(6, classes, bias=False)

    def forward(self, x):
        h = torch.tanh(self.c1(x))
        h = torch.relu(self.c2(h))
        h = torch.tanh(self.f1(h.flatten(1)))
        return self.f2(h)


def _setup(M=5, seed=0):
    torch.manual_seed(seed)
    model = ConvNet().to(F64).eval()
    gen = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(M, 3, 8, 8, generator=gen, dtype=F64)  # c1: 8 -> 3x3 (T=9); c2: 3 -> 2x2 (T=4)
    y = torch.randint(0, 4, (M,), generator=gen)
    return model, x, y


def _targets(model, x, y, fisher, S, seed):
    with torch.no_grad():
        out = model(x)
    return sample_targets(out, y, fisher=fisher, mc_samples=S, generator=torch.Generator().manual_seed(seed))




def _inputs_and_output_grads(model, x, targets):
    """Layer inputs and d log p / d out per draw, via retain_grad (independent of laplace_core.curvature.hooks)."""
    mods, _, _ = find_layers(model)
    ins, outs = {}, {}

    def keep(name):
        def hook(mod, args, out):
            ins[name] = args[0].detach()
            out.retain_grad()
            outs[name] = out

        return hook

    hs = [m.register_forward_hook(keep(n)) for n, m in mods.items()]
    grads = {n: [] for n in mods}
    try:
        for s in range(targets.shape[0]):
            out = model(x)
            ll = torch.log_softmax(out, 1).gather(1, targets[s][:, None]).sum()
            ll.backward()
            for n in mods:
                grads[n].append(outs[n].grad.detach().clone())
    finally:
        for h in hs:
            h.remove()
    model.zero_grad(set_to_none=True)
    return mods, ins, grads


# ----------------------------------------------------------------------------- Acceptance 1
@pytest.mark.parametrize("fisher,S", [("mc", 1), ("mc", 3), ("empirical", 1)])
def test_kfac_sums_match_hand_written_sums(fisher, S):
    model, x, y = _setup()
    stats = collect_statistics(model, [(x, y)], fisher=fisher, mc_samples=S, generator=torch.Generator().manual_seed(7))
    targets = _targets(model, x, y, fisher, S, 7)
    mods, ins, grads = _inputs_and_output_grads(model, x, targets)
    assert stats.count == 5 and stats.mc_samples == S and stats.fisher == fisher
    for name, mod in mods.items():
        if isinstance(mod, nn.Conv2d):
            a = hand_patches(mod, ins[name])  # (B, T, n)
            gs = [g.reshape(g.shape[0], g.shape[1], -1).transpose(1, 2) for g in grads[name]]
        else:
            a = ins[name][:, None, :]
            if mod.bias is not None:
                a = torch.cat([a, torch.ones(a.shape[0], 1, 1, dtype=F64)], 2)
            gs = [g[:, None, :] for g in grads[name]]
        T = a.shape[1]
        A = sum(a[k, t][:, None] * a[k, t][None, :] for k in range(a.shape[0]) for t in range(T)) / T
        G = sum(g[k, t][:, None] * g[k, t][None, :] for g in gs for k in range(g.shape[0]) for t in range(T)) / S
        d = [torch.stack([g[k].T @ a[k] for k in range(a.shape[0])]) for g in gs]  # (B, m, n) per draw
        diag = sum(dk.square().sum(0) for dk in d) / S
        _close(stats.layers[name].A, A)
        _close(stats.layers[name].G, G)
        _close(stats.layers[name].diag, diag)
        assert stats.layers[name].A.dtype == F64


def test_single_example_kfac_equals_exact_block_for_linear():
    """M = 1, T = 1, one draw: (A/M) ⊗ (G/M) = vec(d) vec(d)^T exactly."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 5)).to(F64)
    x = torch.randn(1, 4, dtype=F64)
    y = torch.tensor([2])
    stats = collect_statistics(model, [(x, y)], generator=torch.Generator().manual_seed(3))
    targets = _targets(model, x, y, "mc", 1, 3)
    exact = exact_fisher_blocks(model, x, targets)
    for name, ls in stats.layers.items():
        kron = torch.kron(ls.A / stats.count, ls.G / stats.count)
        _close(kron, exact[name])


# ----------------------------------------------------------------------------- Acceptance 2
@pytest.mark.parametrize("fisher,S", [("mc", 1), ("mc", 3), ("empirical", 1), ("empirical", 3)])
def test_diagonal_equals_exact_fisher_diagonal(fisher, S):
    model, x, y = _setup()
    stats = collect_statistics(model, [(x, y)], fisher=fisher, mc_samples=S, generator=torch.Generator().manual_seed(11))
    targets = _targets(model, x, y, fisher, S, 11)
    blocks = exact_fisher_blocks(model, x, targets)
    for name, ls in stats.layers.items():
        m, n = ls.diag.shape
        exact_diag = torch.diagonal(blocks[name]).reshape(n, m).T  # vec order: index j*m + i
        _close(ls.diag / stats.count, exact_diag)


def test_mc_draws_are_averaged_not_summed():
    model, x, y = _setup()
    st1 = collect_statistics(model, [(x, y)], fisher="empirical", mc_samples=1)
    st3 = collect_statistics(model, [(x, y)], fisher="empirical", mc_samples=3)
    for k in st1.layers:
        _close(st3.layers[k].diag, st1.layers[k].diag)
        _close(st3.layers[k].G, st1.layers[k].G)


# ----------------------------------------------------------------------------- Acceptance 3
@pytest.mark.parametrize("order", [None, "form", "rotate"])
@pytest.mark.parametrize("fisher,S", [("mc", 2), ("empirical", 1)])
def test_efb_equals_diagonal_of_rotated_exact_block(order, fisher, S):
    model, x, y = _setup()
    base = collect_statistics(model, [(x, y)], fisher=fisher, mc_samples=S, generator=torch.Generator().manual_seed(5))
    basis = eigenbasis(base)
    stats = collect_statistics(model, [(x, y)], fisher=fisher, mc_samples=S, generator=torch.Generator().manual_seed(5),
                               basis=basis, _efb_order=order)
    targets = _targets(model, x, y, fisher, S, 5)
    blocks = exact_fisher_blocks(model, x, targets)
    assert stats.efb_count == stats.count == 5 and stats.has_efb
    for name, ls in stats.layers.items():
        lb = basis[name]
        V = torch.kron(lb.U_A, lb.U_G)
        m, n = ls.efb.shape
        lam = torch.diagonal(V.T @ blocks[name] @ V).reshape(n, m).T
        _close(ls.efb / stats.efb_count, lam)
        # the EFB pass must not disturb the KFAC sums
        _close(ls.diag, base.layers[name].diag)
        _close(ls.A, base.layers[name].A)


def test_collect_efb_alone_matches_combined_pass():
    model, x, y = _setup()
    base = collect_statistics(model, [(x, y)], fisher="empirical")
    basis = eigenbasis(base)
    both = collect_statistics(model, [(x, y)], fisher="empirical", basis=basis)
    for order in (None, "form", "rotate"):
        efb, count = collect_efb(model, [(x[:2], y[:2]), (x[2:], y[2:])], basis, fisher="empirical", _efb_order=order)
        assert count == 5
        for k in efb:
            _close(efb[k], both.layers[k].efb)
    attached = base.with_efb(efb, count)
    assert attached.has_efb


def test_contraction_order_rule():
    # resnet18 layer4 conv at 64x64: m=512, n=4608, T=4 -> rotating first is far cheaper
    assert efb_contraction_order(512, 4608, 4, have_d=False) == "rotate"
    # layer1 conv: m=64, n=576, T=256 -> forming d_k first is cheaper
    assert efb_contraction_order(64, 576, 256, have_d=False) == "form"
    assert efb_contraction_order(10, 10, 1, have_d=False) == "rotate"


# ----------------------------------------------------------------------------- merge, chunking, skipping
def test_merge_of_halves_equals_whole():
    model, x, y = _setup(M=6)
    whole = collect_statistics(model, [(x, y)], fisher="empirical")
    basis = eigenbasis(whole)
    whole = collect_statistics(model, [(x, y)], fisher="empirical", basis=basis)
    h1 = collect_statistics(model, [(x[:2], y[:2]), (x[2:3], y[2:3])], fisher="empirical", basis=basis)
    h2 = collect_statistics(model, [{"image": x[3:], "label": y[3:]}], fisher="empirical", basis=basis)
    merged = h1.merge(h2)
    assert merged.count == 6 and merged.efb_count == 6
    for k, ls in whole.layers.items():
        for f in ("A", "G", "diag", "efb"):
            _close(getattr(merged.layers[k], f), getattr(ls, f))


def test_chunking_does_not_change_the_result():
    model, x, y = _setup(M=6)
    basis = eigenbasis(collect_statistics(model, [(x, y)], fisher="empirical"))
    ref = collect_statistics(model, [(x, y)], fisher="empirical", basis=basis)
    small = collect_statistics(model, [(x, y)], fisher="empirical", basis=basis, max_chunk_elements=50)
    for k, ls in ref.layers.items():
        for f in ("A", "G", "diag", "efb"):
            _close(getattr(small.layers[k], f), getattr(ls, f))


def test_wide_layer_blocked_symmetric_A_and_flush_granularity():
    """n >= 1024 uses the blocked SYRK (upper blocks, mirrored); flushing every batch or
    once gives the same sums."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(1100, 3), nn.Tanh(), nn.Linear(3, 2)).to(F64)
    x = torch.randn(6, 1100, dtype=F64)
    y = torch.tensor([0, 1, 1, 0, 1, 0])
    batches = [(x[:2], y[:2]), (x[2:], y[2:])]
    st = collect_statistics(model, batches, fisher="empirical")
    st1 = collect_statistics(model, batches, fisher="empirical", flush_examples=1)
    xa = torch.cat([x, torch.ones(6, 1, dtype=F64)], 1)
    _close(st.layers["0"].A, xa.T @ xa)
    _close(st.layers["0"].A, st.layers["0"].A.T)
    for k in st.layers:
        for f in ("A", "G", "diag"):
            _close(getattr(st1.layers[k], f), getattr(st.layers[k], f))


def test_diagonal_paths_agree_per_example_and_batched(monkeypatch):
    """The CPU's per-example diagonal (one cache-resident ``m x n`` scratch) and the batched
    ``(b, m, n)`` product that accelerators run give the same sums, with tap-major conv rows
    put back into weight order at every flush (flush_examples=1: the reordered add path)."""
    from laplace_core.curvature import accumulate

    model, x, y = _setup(M=6)
    batches = [(x[:2], y[:2]), (x[2:], y[2:])]
    monkeypatch.setattr(accumulate, "PER_EXAMPLE_MIN", 0)
    per_example = collect_statistics(model, batches, fisher="empirical", flush_examples=1)
    monkeypatch.setattr(accumulate, "PER_EXAMPLE_MIN", 2**62)
    batched = collect_statistics(model, batches, fisher="empirical", flush_examples=1)
    ref = exact_fisher_diag(model, x, y)
    for k, ls in per_example.layers.items():
        for f in ("A", "G", "diag"):
            _close(getattr(ls, f), getattr(batched.layers[k], f))
        _close(ls.diag, ref[k])


def test_nonfinite_batch_is_skipped_and_counted():
    model, x, y = _setup(M=6)
    clean = collect_statistics(model, [(x[:3], y[:3])], fisher="empirical")
    bad = x[3:].clone()
    bad[0, 0, 0, 0] = float("nan")
    inf = x[3:].clone()
    inf[1, 2, 3, 3] = float("inf")
    seen = []
    stats = collect_statistics(model, [(x[:3], y[:3]), (bad, y[3:]), (inf, y[3:])], fisher="empirical", progress=seen.append)
    assert stats.count == 3 and stats.skipped_batches == 2 and stats.skipped_examples == 6
    assert seen == [3, 6, 9]
    for k, ls in clean.layers.items():
        _close(stats.layers[k].diag, ls.diag)
        assert torch.isfinite(stats.layers[k].A).all()


class _NanBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


def test_nonfinite_gradient_with_finite_loss_is_skipped():
    """Finite outputs and log-likelihood, NaN output gradients upstream: the batch is skipped."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.f1, self.f2 = nn.Linear(3, 4), nn.Linear(4, 2)
            self.poison = False

        def forward(self, x):
            h = torch.tanh(self.f1(x))
            return self.f2(_NanBackward.apply(h) if self.poison else h)

    net = Net().to(F64)
    x, y = torch.randn(4, 3, dtype=F64), torch.tensor([0, 1, 1, 0])
    clean = collect_statistics(net, [(x, y)], fisher="empirical")

    class Poisoning:
        def __iter__(self):
            net.poison = False
            yield x, y
            net.poison = True
            yield x, y
            net.poison = False

    stats = collect_statistics(net, Poisoning(), fisher="empirical")
    assert stats.count == 4 and stats.skipped_batches == 1 and stats.skipped_examples == 4
    for k, ls in clean.layers.items():
        _close(stats.layers[k].diag, ls.diag)
        _close(stats.layers[k].G, ls.G)


# ----------------------------------------------------------------------------- modes, params, inputs
def test_mode_and_parameters_are_restored():
    model, x, y = _setup()
    model.train()
    model.c2.eval()
    collect_statistics(model, [(x, y)], fisher="empirical")
    assert model.training and model.c1.training and not model.c2.training
    assert all(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())


def test_regression_likelihood_matches_reference():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(F64)
    x = torch.randn(4, 3, dtype=F64)
    y = torch.randn(4, 2, dtype=F64)
    for fisher, S in (("mc", 2), ("empirical", 1)):
        stats = collect_statistics(model, [(x, y)], fisher=fisher, mc_samples=S, likelihood="regression",
                                   generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            out = model(x)
        t = sample_targets(out, y, fisher=fisher, mc_samples=S, likelihood="regression", generator=torch.Generator().manual_seed(9))
        ref = exact_fisher_diag(model, x, t, likelihood="regression")
        for k in ref:
            _close(stats.layers[k].diag, ref[k])


def test_per_example_grads_reference_matches_autograd():
    """The reference itself against a plain autograd loop (guards the test utility)."""
    model, x, y = _setup(M=3)
    d = per_example_grads(model, x, y)
    for k in range(3):
        model.zero_grad(set_to_none=True)
        torch.log_softmax(model(x[k:k + 1]), 1)[0, y[k]].backward()
        for name, mod in find_layers(model)[0].items():
            g = mod.weight.grad.reshape(mod.weight.shape[0], -1)
            if mod.bias is not None:
                g = torch.cat([g, mod.bias.grad[:, None]], 1)
            _close(d[name][k], g)
    model.zero_grad(set_to_none=True)
    assert vec(torch.arange(6.0).reshape(2, 3)).tolist() == [0, 3, 1, 4, 2, 5]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(fisher="kfac"), "unknown fisher 'kfac'; valid: mc, empirical"),
        (dict(likelihood="poisson"), "unknown likelihood 'poisson'; valid: classification, regression"),
        (dict(mc_samples=0), "mc_samples must be a positive integer"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    model, x, y = _setup(M=2)
    with pytest.raises(ValueError, match=match):
        collect_statistics(model, [(x, y)], **kwargs)


def test_bad_inputs_raise():
    model, x, y = _setup(M=3)
    with pytest.raises(ValueError, match="empty"):
        collect_statistics(model, [])
    with pytest.raises(ValueError, match="empty input"):
        collect_statistics(model, [(x[:0], y[:0])])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\)"):
        collect_statistics(model, [(x, torch.tensor([0, 4, 1]))], fisher="empirical")
    with pytest.raises(ValueError, match=r"labels must have shape \(3,\)"):
        collect_statistics(model, [(x, y[:2])], fisher="empirical")
    with pytest.raises(ValueError, match="must be integers"):
        collect_statistics(model, [(x, y.double())], fisher="empirical")
    with pytest.raises(ValueError, match="needs labels"):
        collect_statistics(model, [(x, None)], fisher="empirical")
    with pytest.raises(ValueError, match="basis has no entry"):
        collect_statistics(model, [(x, y)], basis={})
    with pytest.raises(ValueError, match="expected an"):
        collect_statistics(model, [(x, y, y, y)])




def test_mc_without_labels_and_generator_reproducibility():
    model, x, y = _setup(M=4)
    a = collect_statistics(model, [(x, None)], generator=torch.Generator().manual_seed(1))
    b = collect_statistics(model, [{"x": x, "y": y}], generator=torch.Generator().manual_seed(1))
    for k in a.layers:
        torch.testing.assert_close(a.layers[k].diag, b.layers[k].diag, rtol=0, atol=0)


# ----------------------------------------------------------------------------- torchvision (in-place ReLU)
@pytest.mark.parametrize("arch", ["resnet18", "densenet121"])
def test_torchvision_diag_matches_torch_func(arch):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = getattr(torchvision.models, arch)(num_classes=5).to(F64).eval()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 32, 32, generator=gen, dtype=F64)
    y = torch.tensor([1, 3])
    stats = collect_statistics(model, [(x, y)], fisher="empirical")
    ref = exact_fisher_diag(model, x, y)
    assert list(stats.layers) == list(ref)
    for k, ls in stats.layers.items():
        _close(ls.diag, ref[k], tol=1e-9)
    assert stats.excluded  # BatchNorm reported


def test_keyed_mc_sampling_is_independent_of_batching_and_order():
    """With a KeyedSampler the MC labels depend on (seed, key, draw) only: any batching or
    order of the same examples gives the same sums (what the Ray workers rely on)."""
    from laplace_core.curvature.keyed_rng import KeyedSampler

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 4)).double()
    x = torch.randn(24, 5, dtype=torch.float64)
    keys = torch.arange(1000, 1024)
    whole = collect_statistics(model, [{"image": x, "key": keys}], generator=KeyedSampler(3), mc_samples=2)
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(1))
    parts = [{"image": x[perm[i:i + 5]], "key": keys[perm[i:i + 5]]} for i in range(0, 24, 5)]
    shuffled = collect_statistics(model, parts, generator=KeyedSampler(3), mc_samples=2)
    for k in whole.layers:
        for f in ("A", "G", "diag"):
            a, b = getattr(whole.layers[k], f), getattr(shuffled.layers[k], f)
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-14 * float(a.abs().max())), (k, f)
    other = collect_statistics(model, [{"image": x, "key": keys}], generator=KeyedSampler(4), mc_samples=2)
    assert not torch.allclose(whole.layers["2"].G, other.layers["2"].G)
    with pytest.raises(ValueError, match="keys"):
        collect_statistics(model, [(x, None)], generator=KeyedSampler(3))


def test_keyed_regression_sampling_matches_reference_targets():
    """Keyed regression draws give the same diagonal as the per-example reference with
    the same targets y = f + eps(seed, key)."""
    from fisher_reference import exact_fisher_diag
    from laplace_core.curvature.keyed_rng import KeyedSampler, keyed_normal

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2)).double()
    x = torch.randn(10, 3, dtype=torch.float64)
    keys = torch.arange(10)
    stats = collect_statistics(model, [{"image": x, "key": keys}], generator=KeyedSampler(9), likelihood="regression")
    with torch.no_grad():
        f = model(x)
    targets = (f + keyed_normal((2,), 9, keys, 0)).unsqueeze(0)
    ref = exact_fisher_diag(model, x, targets, "regression")
    for k, v in ref.items():
        assert torch.allclose(stats.layers[k].diag, v, rtol=1e-10, atol=1e-12)
