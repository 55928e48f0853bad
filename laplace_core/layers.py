"""Which modules carry a posterior, and the ``W~ = [W, b]`` view of their parameters.

DESIGN §1: curvature covers the weights and biases of every ``nn.Linear`` and every
``nn.Conv2d`` with ``groups == 1``. The registry below is explicit; any other module
that owns parameters (BatchNorm, grouped convs, ...) stays a point estimate and is
listed in ``excluded`` with the reason, never silently dropped.

``W~`` has shape ``m x n``: ``m`` = output channels/features, ``n`` = fan-in
(``c_in * kh * kw`` for a conv, in ``weight.reshape(m, -1)`` order, which is also
``F.unfold``'s patch order) plus one column when there is a bias.
"""
from __future__ import annotations

import contextlib
from enum import Enum
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

from .statistics import LayerInfo

__all__ = [
    "LayerKind",
    "LAYER_REGISTRY",
    "find_layers",
    "get_matrix",
    "set_matrix",
    "perturbed",
]


class LayerKind(str, Enum):
    LINEAR = "linear"
    CONV2D = "conv2d"


def _linear_ok(m: nn.Module) -> str | None:
    return None


def _conv_ok(m: nn.Module) -> str | None:
    assert isinstance(m, nn.Conv2d)
    if m.groups != 1:
        return f"grouped convolution (groups={m.groups}) is not supported"
    if m.padding_mode != "zeros":
        return f"padding_mode={m.padding_mode!r} is not supported"
    if isinstance(m.padding, str):
        return None  # 'same'/'valid' are resolved by the hooks
    return None


# exact type -> (kind, check returning a reason when unsupported)
LAYER_REGISTRY: dict[type, tuple[LayerKind, Callable[[nn.Module], str | None]]] = {
    nn.Linear: (LayerKind.LINEAR, _linear_ok),
    nn.Conv2d: (LayerKind.CONV2D, _conv_ok),
}


def _info(name: str, module: nn.Module, kind: LayerKind) -> LayerInfo:
    w = module.weight
    m = w.shape[0]
    n = int(w[0].numel()) + (1 if module.bias is not None else 0)
    return LayerInfo(
        name=name,
        kind=kind.value,
        out_features=int(m),
        in_features=n,
        has_bias=module.bias is not None,
        weight_shape=tuple(int(s) for s in w.shape),
    )


def find_layers(model: nn.Module) -> tuple[dict[str, nn.Module], dict[str, LayerInfo], dict[str, str]]:
    """Return ``(modules, infos, excluded)`` in ``model.named_modules()`` order.

    ``modules``/``infos`` map qualified names of supported layers; ``excluded`` maps
    names of other modules that directly own trainable parameters to a reason.
    Modules whose parameters are frozen (``requires_grad=False``) are excluded too.
    """
    modules: dict[str, nn.Module] = {}
    infos: dict[str, LayerInfo] = {}
    excluded: dict[str, str] = {}
    for name, mod in model.named_modules():
        own = [p for p in mod.parameters(recurse=False)]
        if not own:
            continue
        entry = LAYER_REGISTRY.get(type(mod))
        if entry is None:
            excluded[name] = f"{type(mod).__name__} is not in the layer registry (point estimate)"
            continue
        kind, check = entry
        reason = check(mod)
        if reason is not None:
            excluded[name] = reason
            continue
        if not all(p.requires_grad for p in own):
            excluded[name] = "parameters are frozen (requires_grad=False)"
            continue
        modules[name] = mod
        infos[name] = _info(name, mod, kind)
    return modules, infos, excluded


def get_matrix(module: nn.Module) -> torch.Tensor:
    """``W~`` (m x n): weight flattened to ``(m, -1)`` with the bias as last column."""
    w = module.weight.detach().reshape(module.weight.shape[0], -1)
    if module.bias is not None:
        w = torch.cat([w, module.bias.detach().reshape(-1, 1)], dim=1)
    return w


def set_matrix(module: nn.Module, mat: torch.Tensor) -> None:
    """In-place inverse of :func:`get_matrix` (no autograd)."""
    with torch.no_grad():
        k = module.weight[0].numel()
        module.weight.copy_(mat[:, :k].reshape(module.weight.shape))
        if module.bias is not None:
            module.bias.copy_(mat[:, k])


@contextlib.contextmanager
def perturbed(modules: Mapping[str, nn.Module], deltas: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Temporarily add ``deltas[name]`` (``W~``-shaped) to each named layer's parameters.

    ``delta`` is ``m x n``: columns ``[:n-1]`` (or all, without a bias) go to the
    flattened weight, the last to the bias; added in place (``W + δ`` elementwise, no
    ``W~`` concatenation). The MAP values are restored exactly (saved copies, not
    subtraction) on exit.
    """
    saved = {}
    try:
        with torch.no_grad():
            for name, delta in deltas.items():
                mod = modules[name]
                w = mod.weight
                saved[name] = (w.detach().clone(), None if mod.bias is None else mod.bias.detach().clone())
                d = delta.to(device=w.device, dtype=w.dtype)
                k = w[0].numel()
                w.add_(d[:, :k].reshape(w.shape))
                if mod.bias is not None:
                    mod.bias.add_(d[:, k])
        yield
    finally:
        with torch.no_grad():
            for name, (w, b) in saved.items():
                mod = modules[name]
                mod.weight.copy_(w)
                if b is not None:
                    mod.bias.copy_(b)
