"""Mixed precision of the curvature passes (issue 31, acceptance 1): bf16 / fp16 statistics of
pass 1 and the EFB pass against float64 ground truth, float64 running sums, fp32 unchanged.

Ground truth: the same network in float64 (``precision="fp32"`` on a float64 model). The
half-precision runs use the float32 copy of the network under autocast. Errors are
scale-normalised: ``||X - X_64||_F / ||X_64||_F`` per layer and statistic. The empirical
Fisher is used so that both runs differentiate the same labels (MC draws from half-precision
logits can pick another label for an example whose class probabilities are close).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_core.curvature.batch_loop import PassOptions
from laplace_core.curvature.collect import collect_efb, collect_statistics
from laplace_core.basis.eigenbasis import eigenbasis

F64 = torch.float64
#: bf16 keeps 8 significant bits (unit round-off 2^-9 = 0.2%); the captured inputs and output
#: gradients carry a few such round-offs through the layers, the float32 products and float64
#: sums add none of their own. Measured on this network (worst of 24 layer-statistics, torch
#: 2.14.1 CPU): 0.62% (conv G); the bound leaves a factor of ~3.
BF16_RTOL = 0.02
#: fp16 keeps 11 significant bits (unit round-off 2^-12): measured worst 0.094%, bound ~3x.
FP16_RTOL = 0.003


class Net(nn.Module):
    """A conv, a grouped conv, a multi-head attention block and a linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        h = torch.tanh(self.grouped(h))
        t = h.flatten(2).transpose(1, 2)
        t, _ = self.attn(t, t, t)
        return self.fc(t.mean(1))


def _setup(M=16):
    torch.manual_seed(0)
    net = Net().eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(M, 3, 6, 6, generator=gen)
    y = torch.randint(0, 5, (M,), generator=gen)
    return net, [(x[:8], y[:8]), (x[8:], y[8:])]


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.to(F64) - ref).norm() / ref.norm())


def _errors(net, batches, precision):
    exact = collect_statistics(net.to(F64), [(x.to(F64), y) for x, y in batches], fisher="empirical")
    basis = eigenbasis(exact)
    efb64, _ = collect_efb(net, [(x.to(F64), y) for x, y in batches], basis, fisher="empirical")
    net.float()
    half = collect_statistics(net, batches, fisher="empirical", precision=precision)
    efb, count = collect_efb(net, batches, basis, fisher="empirical", precision=precision)
    assert count == exact.count == 16
    errs = {}
    for k, ls in exact.layers.items():
        for f in ("A", "G", "diag"):
            errs[(k, f)] = _rel(getattr(half.layers[k], f), getattr(ls, f))
        errs[(k, "efb")] = _rel(efb[k], efb64[k])
    return half, efb, errs


@pytest.mark.parametrize("precision,rtol", [("bf16", BF16_RTOL), ("fp16", FP16_RTOL)])
def test_half_precision_statistics_match_float64(precision, rtol):
    net, batches = _setup()
    half, efb, errs = _errors(net, batches, precision)
    kinds = {k.split(".")[0] for k, _ in errs}
    assert kinds == {"conv", "grouped", "attn", "fc"}  # linear, conv, grouped conv, attention
    worst = max(errs.values())
    assert worst <= rtol, {k: round(v, 4) for k, v in errs.items() if v > rtol}
    assert worst > 0  # the half-precision forward really ran (not a float32 pass)
    # running sums stay float64
    for ls in half.layers.values():
        assert ls.A.dtype == ls.G.dtype == ls.diag.dtype == F64
    assert all(v.dtype == F64 for v in efb.values())


def test_bf16_captures_half_precision_and_fp32_does_not():
    """The forward runs under autocast only with a half precision; with ``fp32`` no autocast is
    active and the result equals the call without the option bit for bit."""
    net, batches = _setup()
    seen = []
    hook = net.grouped.register_forward_hook(lambda m, a, o: seen.append((torch.is_autocast_enabled("cpu"), o.dtype)))
    try:
        plain = collect_statistics(net, batches, fisher="empirical")
        fp32 = collect_statistics(net, batches, fisher="empirical", options=PassOptions(precision="fp32"))
        assert seen and all(s == (False, torch.float32) for s in seen)
        seen.clear()
        collect_statistics(net, batches, fisher="empirical", precision="bf16")
        assert seen and all(s == (True, torch.bfloat16) for s in seen)
    finally:
        hook.remove()
    for k in plain.layers:
        for f in ("A", "G", "diag"):
            assert torch.equal(getattr(plain.layers[k], f), getattr(fp32.layers[k], f)), (k, f)


def test_channels_last_matches_contiguous():
    net, batches = _setup()
    plain = collect_statistics(net, batches, fisher="empirical")
    nhwc = collect_statistics(net, batches, fisher="empirical", channels_last=True)
    for k in plain.layers:
        for f in ("A", "G", "diag"):
            a, b = getattr(plain.layers[k], f), getattr(nhwc.layers[k], f)
            assert _rel(b, a) < 1e-5, (k, f)
    assert all(p.is_contiguous() for p in net.parameters())  # the pass restores the layout


def test_bad_precision_is_one_line():
    net, batches = _setup()
    with pytest.raises(ValueError, match="unknown precision 'int8'; valid: fp32, bf16, fp16"):
        collect_statistics(net, batches, precision="int8")
