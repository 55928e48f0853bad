"""Per-example gradients of the free parameters (:class:`~laplace_core.curvature.layers.FreeView`:
position embeddings, class tokens, layer-scale gammas, relative-position bias tables), which no
module hook can see, and their exact Fisher diagonal.

For output-gradient seeds ``e_{s,k}`` (``∂ log p(y_{s,k} | f_k) / ∂ f_k`` for a label draw, or a
one-hot row for a Jacobian) the per-example gradient of a free parameter ``p`` is
``d_{s,k} = J_k(p)^T e_{s,k}``, with ``J_k`` the Jacobian of the output of example ``k`` alone: one
``torch.func.vjp`` of ``functional_call(model, {p: ...}, x_k)`` per example, ``vmap``-ed over the
examples (only the free parameters are differentiated; the rest of the model is a constant). It is
the same seed the hooks back-propagate for every other layer, so the sums merge per shard alike.
The forward runs in the model's dtype (no autocast), inside :meth:`Capture.paused` when a capture
is installed, with attention in plain ops (:func:`~laplace_core.curvature.hooks.reference_attention`:
``vmap`` has no batching rule for the fused kernels and would loop over the examples). Cost: one extra forward and backward of the model per batch (the backward to the
free parameters only), chunked over examples so that the gradients stay below ``max_elements``.
"""
from __future__ import annotations

import contextlib
from typing import Mapping

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

from .accumulate import Accumulator
from .hooks import reference_attention
from .layers import FreeView, is_free

__all__ = ["free_views", "free_grads", "FreeDiagSums"]


def free_views(modules: Mapping[str, object]) -> dict[str, FreeView]:
    """The :class:`FreeView` entries of ``modules`` (model order)."""
    return {k: m for k, m in modules.items() if is_free(m)}


def _keys(model: nn.Module, views: Mapping[str, FreeView]) -> dict[str, str]:
    """Layer name -> the parameter's key in ``model.named_parameters()``."""
    ids = {id(p): k for k, p in model.named_parameters(remove_duplicate=False)}
    out = {}
    for name, v in views.items():
        key = ids.get(id(getattr(v.parent, v.weight_name)))
        if key is None:
            raise ValueError(f"free parameter {name!r} is not a parameter of the model")
        out[name] = key
    return out


def free_grads(model: nn.Module, views: Mapping[str, FreeView], x: torch.Tensor, seeds: torch.Tensor, *,
               max_elements: int = 2**26, cap=None) -> dict[str, torch.Tensor]:
    """``{name: (S, B, m, n)}``: per-example gradients ``J_k^T seeds[s, k]`` of each free parameter in
    its ``W~`` layout. ``x`` (B, ...) the model input, ``seeds`` (S, B, C) output-gradient rows;
    ``cap``: the installed :class:`~laplace_core.curvature.hooks.Capture` (paused meanwhile). ``seeds``
    must have the output's dtype."""
    keys = _keys(model, views)
    params = {keys[k]: getattr(v.parent, v.weight_name).detach() for k, v in views.items()}
    S, B = int(seeds.shape[0]), int(x.shape[0])
    per = S * sum(p.numel() for p in params.values())
    bs = max(1, min(B, int(max_elements) // max(1, per)))

    def one(xk, sk):  # sk (S, C): every draw's seed of one example
        _, pull = vjp(lambda p: functional_call(model, p, (xk.unsqueeze(0),))[0], params)
        return [pull(sk[s])[0] for s in range(S)]

    parts: dict[str, list[torch.Tensor]] = {k: [] for k in views}
    paused = cap.paused() if cap is not None else contextlib.nullcontext()
    with paused, reference_attention(model), torch.enable_grad():  # attention in plain ops: vmap-able
        for i0 in range(0, B, bs):
            res = vmap(one, in_dims=(0, 1))(x[i0:i0 + bs], seeds[:, i0:i0 + bs])
            for k in views:
                parts[k].append(torch.stack([r[keys[k]] for r in res]))  # (S, b, *shape)
    return {k: torch.cat(parts[k], 1).reshape(S, B, v.weight.shape[0], -1).detach() for k, v in views.items()}


class FreeDiagSums:
    """The exact Fisher diagonal ``Σ_k (1/S) Σ_s d_{s,k}∘d_{s,k}`` of every free parameter of a pass."""

    def __init__(self, views: Mapping[str, FreeView], infos, dtype, cdtype, device):
        self.views = dict(views)
        self.diag = {k: Accumulator(infos[k].shape, dtype, cdtype, device) for k in self.views}
        self.names = list(self.views)

    def accumulators(self) -> list[Accumulator]:
        return list(self.diag.values())

    def totals(self) -> dict[str, tuple]:
        return {k: (None, None, a.total, None) for k, a in self.diag.items()}

    def add(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Add one batch of :func:`free_grads` (``(S, B, m, n)`` each)."""
        for k, g in grads.items():
            self.diag[k].add(g.square().sum((0, 1)), 1.0 / g.shape[0])
