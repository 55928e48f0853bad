"""Hooks: layouts (unfold rows reproduce the conv), output gradients under in-place ReLU,
weight sharing, hook removal, and coverage of every layer of torchvision resnet18/densenet121."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from laplace_core.curvature.hooks import capture, conv_padding, layer_inputs, layer_output_grads, num_positions
from laplace_core.curvature.layers import GroupView, find_layers, get_matrix
from laplace_core.curvature.tap_major import conv_rows_tap_major, tap_major_perm

TOL = 1e-12


CONV_SHAPES = [
        dict(kernel_size=3, stride=2, padding=1, dilation=2, bias=True),
        dict(kernel_size=3, stride=1, padding=0, dilation=1, bias=False),
        dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 0), dilation=(2, 1), bias=True),
        dict(kernel_size=(2, 4), stride=1, padding="same", dilation=(1, 2), bias=True),  # asymmetric 'same'
        dict(kernel_size=3, stride=1, padding="valid", bias=True),
]


@pytest.mark.parametrize("kwargs", CONV_SHAPES)
def test_conv_rows_reproduce_the_convolution(kwargs):
    """rows (B, T, n) @ W~^T == conv output (B, m, T): unfold order == weight.reshape(m, -1)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, **kwargs).double()
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    rows = layer_inputs(conv, x)
    out = conv(x)
    T = out.shape[-2] * out.shape[-1]
    assert rows.shape == (2, T, get_matrix(conv).shape[1])
    assert num_positions(conv, x) == T
    lhs = rows @ get_matrix(conv).T  # (B, T, m)
    torch.testing.assert_close(lhs, layer_output_grads(conv, out), atol=TOL, rtol=0)


@pytest.mark.parametrize("kwargs", CONV_SHAPES)
def test_tap_major_rows_are_the_rows_with_permuted_columns(kwargs):
    """The pass's tap-major gather: the same values as layer_inputs, columns in (kh, kw, c_in)
    order mapped by tap_major_perm; channels-last inputs and conv groups too."""
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, **kwargs).double()
    x = torch.randn(2, 4, 9, 8, dtype=torch.float64)
    perm = tap_major_perm(conv)
    assert sorted(perm.tolist()) == list(range(get_matrix(conv).shape[1]))
    assert not torch.equal(perm, torch.arange(len(perm)))
    for xi in (x, x.contiguous(memory_format=torch.channels_last)):
        assert torch.equal(conv_rows_tap_major(conv, xi), layer_inputs(conv, x)[..., perm])
    grouped = nn.Conv2d(4, 6, groups=2, **kwargs).double()
    view = GroupView(grouped, "g", 1)
    assert torch.equal(conv_rows_tap_major(view, x), layer_inputs(view, x)[..., tap_major_perm(view)])


def test_same_padding_is_asymmetric_like_pytorch():
    conv = nn.Conv2d(1, 1, kernel_size=(2, 4), padding="same", dilation=(1, 1))
    # total padding = d*(k-1): H: 1 -> (0 top, 1 bottom); W: 3 -> (1 left, 2 right)
    assert conv_padding(conv) == (1, 2, 0, 1)


def test_linear_rows_with_sequence_dims():
    torch.manual_seed(0)
    lin = nn.Linear(5, 3).double()
    x = torch.randn(2, 4, 5, dtype=torch.float64)
    rows = layer_inputs(lin, x)
    assert rows.shape == (2, 4, 6)
    torch.testing.assert_close(rows @ get_matrix(lin).T, lin(x), atol=TOL, rtol=0)
    assert num_positions(lin, x) == 4


class _InplaceNet(nn.Module):
    def __init__(self, inplace: bool):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc1 = nn.Linear(3 * 4 * 4, 5)
        self.fc2 = nn.Linear(5, 3)
        self.inplace = inplace

    def forward(self, x):
        h = F.relu(self.conv(x), inplace=self.inplace)  # in-place on the conv output itself
        h = F.relu(self.fc1(h.flatten(1)), inplace=self.inplace)
        return self.fc2(h)


def test_output_grads_survive_inplace_relu():
    """Captured g equals the gradient w.r.t. the pre-ReLU output (reference: out-of-place net)."""
    torch.manual_seed(0)
    net = _InplaceNet(inplace=True).double()
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    mods, _, _ = find_layers(net)
    with capture(net, mods) as cap:
        out = net(x)
        grads = cap.backward(out, torch.ones_like(out))
    # reference with retain_grad on out-of-place outputs
    net.inplace = False
    store = {}

    def keep(name):
        def hook(mod, args, out):
            out.retain_grad()
            store[name] = out

        return hook

    hs = [m.register_forward_hook(keep(n)) for n, m in mods.items()]
    net(x).sum().backward()
    for h in hs:
        h.remove()
    for name in mods:
        torch.testing.assert_close(grads[name], store[name].grad, atol=TOL, rtol=0)


def test_backward_does_not_touch_param_grads_and_hooks_are_removed():
    torch.manual_seed(0)
    net = _InplaceNet(inplace=True).double()
    mods, _, _ = find_layers(net)
    with capture(net, mods) as cap:
        out = net(torch.randn(2, 2, 4, 4, dtype=torch.float64))
        cap.backward(out, torch.ones_like(out))
    assert all(p.grad is None for p in net.parameters())
    assert not net._forward_pre_hooks
    assert all(not m._forward_hooks for m in net.modules())


def test_weight_sharing_raises():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(torch.tanh(self.fc(x)))

    net = Shared()
    mods, _, _ = find_layers(net)
    with pytest.raises(ValueError, match="'fc' was called twice"):
        with capture(net, mods):
            net(torch.randn(2, 4))
    assert not net.fc._forward_hooks


@pytest.mark.parametrize("arch", ["resnet18", "densenet121"])
def test_every_torchvision_layer_gets_a_and_g(arch):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = getattr(torchvision.models, arch)(num_classes=7).eval()
    mods, infos, excluded = find_layers(model)
    assert excluded  # BatchNorm layers are reported
    x = torch.randn(2, 3, 32, 32)
    with capture(model, mods) as cap:
        out = model(x)
        grads = cap.backward(out, torch.randn_like(out))
        assert cap.names == list(mods)  # both nets call layers in registration order
        for name, mod in mods.items():
            m, n = infos[name].shape
            a = layer_inputs(mod, cap.inputs[name])
            g = layer_output_grads(mod, grads[name])
            T = num_positions(mod, cap.inputs[name])
            assert a.shape == (2, T, n), name
            assert g.shape == (2, T, m), name
            assert torch.isfinite(g).all() and g.abs().sum() > 0, name
