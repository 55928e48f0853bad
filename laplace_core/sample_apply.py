"""Running a model under one posterior draw: the delta added to the weights, or to the outputs.

A draw gives each layer a delta ``δ = F z`` (``m x n``) for ``W~ = [W, b]``. For the
structures whose ``F z`` ends in two basis products, ``δ = L C R^T``
(:class:`~laplace_core.structures.base.ScaleFactors`: KFAC, EFB, exact-prior KFAC), there
are two exact ways to compute ``f(x; θ* + δ)`` at that layer:

* **weights**: form ``δ = (L C) R^T`` (``m²n + mn²`` multiply-adds) and add it to the
  weights in place (:func:`laplace_core.layers.perturbed`, the MAP restored from a copy);
* **inputs**: keep the MAP weights and add ``δ x~`` to the layer's output, ``x~`` being
  the layer's input columns (``[x; 1]`` for ``nn.Linear``, ``[unfold(x); 1]`` for
  ``nn.Conv2d``, one column per example and output position):
  ``δ x~ = L (C (R^T x~))``, ``r (k n + n m + m²)`` multiply-adds for ``r`` columns
  (``k`` = ``n`` less the bias column), plus the unfold. Since
  ``(W + δ) x~ = W x~ + δ x~``, both give the same numbers up to rounding.

Inputs win when a layer sees fewer columns than it has outputs, roughly ``r < m``: the
last blocks of a ResNet on small images or small batches, or the classifier of a
1000-class model at usual batch sizes (resnet18 at 64x64, batch 32: layer4's convolutions
see 128 columns for ``m = 512``, and one KFAC draw drops from 91 to about 30 GFLOP).
:func:`input_space_cheaper` decides per layer at every call, from the shape of that
call's input, so a layer runs the same way for every batch of the same shape. Every
other draw (Diag, INF, subnet: no factored form) is added to the weights, as before.
The GEMMs run in the posterior's dtype, like the weight-space delta, and the result is
cast to the layer's output dtype. Nothing of size ``(mn) x anything`` is formed; the
extra memory is ``r x n`` per input-space layer.

Layer views (:mod:`laplace_core.layers`: conv groups, attention projections) always take
the weight route, whatever ``space`` says: a tapped projection has no module call to hook,
and a conv group is never cheaper in input space (``m/g`` outputs against ``T`` columns;
depthwise: one output).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Mapping

import torch
import torch.nn.functional as tF
from torch import nn

from .layers import LayerView, perturbed
from .structures.base import ScaleFactors

__all__ = ["SAMPLE_SPACES", "input_space_cheaper", "draw_costs", "applied"]

SAMPLE_SPACES = ("auto", "weights", "inputs")
"""``auto``: the cheaper per layer and call (:func:`input_space_cheaper`); ``weights``:
always add the delta to the weights; ``inputs``: always add ``δ x~`` to the output where
the layer allows it (tests, benchmarks)."""


def draw_costs(m: int, n: int, k: int, columns: int) -> tuple[int, int]:
    """Multiply-adds to apply a factored delta ``L C R^T`` (``m x n``, ``k`` weight columns)
    ``(weights, inputs)``: ``m n (m + n)`` to form it, ``columns (k n + n m + m m)`` to apply
    it to ``columns`` input columns (plus ``columns k`` for copying them)."""
    return m * n * (m + n), columns * (k * n + n * m + m * m + k)


def input_space_cheaper(m: int, n: int, k: int, columns: int) -> bool:
    """Whether ``δ x~`` on ``columns`` columns costs fewer multiply-adds than forming ``δ``."""
    weights, inputs = draw_costs(m, n, k, columns)
    return inputs < weights


def _output_positions(module: nn.Module, x: torch.Tensor) -> tuple[int, ...] | None:
    """The output's shape less its channel/feature axis (``(B, H', W')`` for a convolution,
    ``x.shape[:-1]`` for a linear layer), i.e. where the input columns come from; ``None``
    when this layer/input cannot be handled in input space (the delta goes to the weights)."""
    if isinstance(module, nn.Linear):
        return tuple(x.shape[:-1])
    if isinstance(module, nn.Conv2d):
        if x.dim() != 4 or module.groups != 1 or module.padding_mode != "zeros" or isinstance(module.padding, str):
            return None
        return (x.shape[0], *(
            (size + 2 * p - d * (kk - 1) - 1) // s + 1
            for size, p, d, kk, s in zip(x.shape[2:], module.padding, module.dilation, module.kernel_size, module.stride)
        ))
    return None


def _input_rows(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's input columns ``x`` (without the bias entry) as rows ``(r, k)``, in the
    order of :func:`_output_positions` (``F.unfold`` for a convolution)."""
    if isinstance(module, nn.Conv2d):
        cols = tF.unfold(x, module.kernel_size, dilation=module.dilation, padding=module.padding, stride=module.stride)
        return cols.transpose(1, 2).reshape(-1, cols.shape[1])
    return x.reshape(-1, x.shape[-1])


def _output_delta(module: nn.Module, x: torch.Tensor, positions: tuple[int, ...], f: ScaleFactors) -> torch.Tensor:
    """``δ x~`` for the layer's input ``x``, in the layer's output shape."""
    R, C, Lf = f.right, f.core[0] if f.core.dim() == 3 else f.core, f.left
    X = _input_rows(module, x)
    k = X.shape[1]
    Y = X.to(R.dtype) @ R[:k]  # (r, n): R^T x~ without the bias column ...
    if module.bias is not None:
        Y = Y + R[k]  # ... whose entry of x~ is 1
    Y = (Y @ C.T) @ Lf.T  # (r, m)
    Y = Y.reshape(*positions, Y.shape[-1])
    return Y.permute(0, 3, 1, 2) if isinstance(module, nn.Conv2d) else Y


@contextlib.contextmanager
def applied(
    modules: Mapping[str, nn.Module],
    draw: Mapping[str, Any],
    space: str = "auto",
    used: dict[str, str] | None = None,
) -> Iterator[None]:
    """Run ``modules``' model inside this block under ``draw``: ``name ->`` delta ``(m, n)``
    (added to the weights, as :func:`~laplace_core.layers.perturbed`) or
    :class:`ScaleFactors` with a ``(1, m, n)`` or ``(m, n)`` core (weights or inputs, per
    ``space`` and each call's input shape). ``used`` (optional) receives ``name -> "weights"
    / "inputs"`` for the factored layers' last call. The MAP weights are restored exactly
    on exit, and after every weight-space call of a factored layer; a factored delta is
    formed at most once per block, however many batches run inside it."""
    if space not in SAMPLE_SPACES:
        raise ValueError(f"unknown sample space {space!r}; valid: {', '.join(SAMPLE_SPACES)}")
    plain = {k: v for k, v in draw.items() if not isinstance(v, ScaleFactors)}
    factored = {k: v for k, v in draw.items() if isinstance(v, ScaleFactors)}
    views = [k for k in factored if isinstance(modules[k], LayerView)]  # always the weight route
    plain.update({k: factored.pop(k).matrix().reshape(draw[k].core.shape[-2:]) for k in views})
    if used is not None:
        used.update({k: "weights" for k in views})
    if space == "weights":
        plain.update({k: f.matrix().reshape(f.core.shape[-2:]) for k, f in factored.items()})
        factored = {}
    handles = []
    live: dict[str, Any] = {}  # name -> the open weight-space context, or the input columns
    formed: dict[str, torch.Tensor] = {}  # name -> delta, formed once per block for every call that needs it

    def make_hooks(name: str, f: ScaleFactors):
        mod = modules[name]

        def pre(module, args):
            x = args[0]
            positions = _output_positions(module, x) if f.right.device == x.device else None
            m, n = f.core.shape[-2:]
            k = n - (module.bias is not None)
            columns = 0 if positions is None else math.prod(positions)
            if positions is not None and (space == "inputs" or input_space_cheaper(m, n, k, columns)):
                live[name] = (x, positions)
                mode = "inputs"
            else:
                if name not in formed:
                    formed[name] = f.matrix().reshape(m, n)
                ctx = perturbed({name: module}, {name: formed[name]})
                ctx.__enter__()
                live[name] = ctx
                mode = "weights"
            if used is not None:
                used[name] = mode

        def post(module, args, output):
            state = live.pop(name)
            if isinstance(state, tuple):
                return output + _output_delta(module, *state, f).to(output.dtype)
            state.__exit__(None, None, None)
            return None

        return mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)

    try:
        for name, f in factored.items():
            handles.extend(make_hooks(name, f))
        with perturbed(modules, plain):
            yield
    finally:
        for h in handles:
            h.remove()
        for state in live.values():  # a forward that raised between a pre- and a post-hook
            if not isinstance(state, tuple):
                state.__exit__(None, None, None)
