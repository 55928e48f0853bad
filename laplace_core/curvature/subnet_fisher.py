"""The subnetwork Fisher pass of subnetwork Laplace (Daxberger et al. 2021, §3): the full
``S x S`` Fisher over the weights selected by :func:`laplace_core.posteriors.subnet.select_subnetwork`,

    ``F_sum = Σ_k d_{k,S} d_{k,S}^T``

from per-example gradients gathered at the selected entries (MC / empirical labels as in
:mod:`laplace_core.curvature.collect`, or the exact GGN ``Σ_k J_S^T Λ J_S`` with
``Λ = diag(p) − p p^T`` (classification) or ``I`` (unit-noise regression)). Sums plus the
count, so shards merge by addition; :func:`laplace_core.posteriors.subnet.build_subnet_posterior`
turns them into the posterior. The ``S x S`` matrix is checked against a memory budget first.

Subnetwork order: layers in model order (:func:`~laplace_core.curvature.layers.find_layers`),
within a layer ascending ``vec`` (column-stacking) position of ``W~``.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable, Mapping

import torch
from torch import nn

from ..names import SUBNET_FISHER_TYPES
from .batch_loop import ModelBatch, PassOptions, draw_targets, model_batches
from .hooks import layer_inputs, layer_output_grads, norm_grads
from .free_grads import free_grads, free_views
from .layers import LayerKind, find_layers, layer_kind
from .likelihoods import check_fisher, likelihood_for

__all__ = [
    "SUBNET_FISHER_TYPES",
    "DEFAULT_MEMORY_BUDGET",
    "subnet_size",
    "max_subnet_size",
    "check_subnet_memory",
    "collect_subnet_fisher",
]

DEFAULT_MEMORY_BUDGET = 4 * 2**30
"""Default bytes allowed for the ``S x S`` Fisher (4 GiB: ``S ≈ 23,170`` in float64)."""


def subnet_size(masks: Mapping[str, torch.Tensor]) -> int:
    """``S`` = number of selected weights."""
    return int(sum(int(mk.sum()) for mk in masks.values()))


def max_subnet_size(budget_bytes: int, dtype: torch.dtype = torch.float64) -> int:
    """Largest ``S`` whose ``S x S`` matrix in ``dtype`` fits ``budget_bytes``."""
    elt = torch.empty((), dtype=dtype).element_size()
    return int(math.isqrt(int(budget_bytes) // elt))


def check_subnet_memory(S: int, budget_bytes: int = DEFAULT_MEMORY_BUDGET, dtype: torch.dtype = torch.float64) -> None:
    """``ValueError`` naming the largest ``S`` that fits when ``S²`` numbers exceed the budget."""
    elt = torch.empty((), dtype=dtype).element_size()
    need = S * S * elt
    if need > budget_bytes:
        raise ValueError(
            f"subnetwork of S = {S} weights needs an S x S {str(dtype).removeprefix('torch.')} matrix of "
            f"{need / 2**30:.2f} GiB, above the budget of {budget_bytes / 2**30:.2f} GiB; "
            f"the largest S that fits is {max_subnet_size(budget_bytes, dtype)}"
        )


def _check_masks(masks: Mapping[str, torch.Tensor], modules: Mapping[str, nn.Module], infos) -> list[str]:
    if not isinstance(masks, Mapping) or not masks:
        raise ValueError("masks must be a non-empty mapping name -> bool (m, n) tensor (see select_subnetwork)")
    unknown = [k for k in masks if k not in modules]
    if unknown:
        raise ValueError(f"masks name layers not in the model: {unknown}; model layers: {list(modules)}")
    names = [k for k in modules if k in masks]
    if list(masks) != names:
        raise ValueError(f"masks must be in model order {names}, got {list(masks)}")
    for k in names:
        mk = masks[k]
        if not isinstance(mk, torch.Tensor) or mk.dtype != torch.bool or tuple(mk.shape) != tuple(infos[k].shape):
            raise ValueError(f"mask {k!r} must be a bool tensor of shape {infos[k].shape}, got "
                             f"{getattr(mk, 'dtype', type(mk).__name__)} {tuple(getattr(mk, 'shape', ()))}")
    return names


# =========================================================================== subnet Fisher
def _ggn_output_grads(out: torch.Tensor, likelihood: str) -> torch.Tensor:
    """Rows ``r_c`` with ``Σ_c r_c r_c^T = Λ`` per example, shape ``(C, B, C)``.

    Classification: ``Λ = diag(p) − p p^T = L L^T`` with ``L = (I − p 1^T) diag(√p)``,
    i.e. ``r_c = √p_c (e_c − p)``. Regression (unit noise): ``r_c = e_c``.
    """
    B, C = out.shape
    eye = torch.eye(C, dtype=out.dtype, device=out.device)
    if likelihood == "classification":
        p = torch.softmax(out, dim=1)  # (B, C)
        return p.T.sqrt()[:, :, None] * (eye[:, None, :] - p[None, :, :])
    return eye[:, None, :].expand(C, B, C)


def _layer_selected_grads(mod, x_in, g_out, rows, cols, max_chunk: int) -> torch.Tensor:
    """Per-example gradient entries ``d_k[rows, cols]`` (``(B, S_l)``) with
    ``d_k = Σ_t g_{k,t} a_{k,t}^T``: gathered products when ``T S_l <= m n``, else
    ``d_k`` formed by a batched matmul and gathered. Chunked over examples. A normalisation
    layer's ``d_k`` comes from :func:`laplace_core.curvature.hooks.norm_grads`."""
    if layer_kind(mod) is LayerKind.NORM:
        return norm_grads(mod, x_in, g_out)[:, rows, cols]
    a3 = layer_inputs(mod, x_in)  # (B, T, n)
    g3 = layer_output_grads(mod, g_out)  # (B, T, m)
    B, T, n = a3.shape
    m = g3.shape[2]
    Sl = rows.numel()
    gather_first = T * Sl <= m * n
    per = max(1, T * Sl if gather_first else m * n)
    bs = max(1, min(B, max_chunk // per))
    out = []
    for i0 in range(0, B, bs):
        a, g = a3[i0:i0 + bs], g3[i0:i0 + bs]
        if gather_first:
            out.append((g[:, :, rows] * a[:, :, cols]).sum(1))
        else:
            d = torch.bmm(g.transpose(1, 2), a)  # (b, m, n)
            out.append(d[:, rows, cols])
    return torch.cat(out, 0)


def _fisher_buffer(out, size: int, dtype, device) -> torch.Tensor:
    if out is None:
        return torch.zeros(size, size, dtype=dtype, device=device)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (size, size) or out.dtype != dtype or out.device != device:
        raise ValueError(f"out must be an {size} x {size} {dtype} tensor on {device}, got "
                         f"{tuple(getattr(out, 'shape', ()))} {getattr(out, 'dtype', type(out))} on {getattr(out, 'device', None)}")
    return out


def _subnet_output_grads(batch: ModelBatch, opts: PassOptions) -> tuple[torch.Tensor, float]:
    """Output-gradient seeds ``(R, B, C)`` and their weight: the GGN's ``Λ`` rows (weight 1)
    or one label draw each (weight ``1 / draws``)."""
    logits = batch.logits
    if logits.dim() != 2:
        raise ValueError(f"batch {batch.index}: model output must be (B, C), got {tuple(logits.shape)}")
    if opts.fisher == "ggn":
        return _ggn_output_grads(logits, opts.likelihood), 1.0
    lik = likelihood_for(opts.likelihood)
    draws = check_fisher(opts.fisher, opts.mc_samples)
    labels = lik.check(logits, batch.labels, opts.fisher)
    seeds = lik.output_grad(logits, draw_targets(lik, batch, labels, draws, opts))
    return seeds, 1.0 / seeds.shape[0]


def _add_subnet_batch(fisher_sum: torch.Tensor, batch: ModelBatch, modules, selected, opts: PassOptions,
                      model: nn.Module) -> None:
    """``fisher_sum += w Σ_s d_s^T d_s`` with ``d_s`` (B, S) the selected per-example gradients
    (free parameters': :func:`laplace_core.curvature.free_grads.free_grads`)."""
    seeds, weight = _subnet_output_grads(batch, opts)
    seeds = seeds.to(batch.outputs.dtype)
    cap = batch.capture
    free = free_views({k: modules[k] for k in selected})
    fg = free_grads(model, free, batch.inputs, seeds.to(batch.inputs.dtype), max_elements=opts.max_chunk_elements,
                    cap=cap) if free else {}
    hooked = len(free) < len(selected)
    for s in range(seeds.shape[0]):
        grads = cap.backward(batch.outputs, seeds[s], retain_graph=s < seeds.shape[0] - 1) if hooked else {}
        parts = [
            fg[k][s][:, rows, cols] if k in fg else
            _layer_selected_grads(modules[k], cap.inputs[k].to(modules[k].weight.dtype),
                                  grads[k].to(modules[k].weight.dtype), rows, cols, int(opts.max_chunk_elements))
            for k, (rows, cols) in selected.items()
        ]
        d = torch.cat(parts, 1).to(fisher_sum.dtype)  # (B, S)
        fisher_sum.addmm_(d.T, d, alpha=weight)
    batch.outputs = None


def collect_subnet_fisher(
    model: nn.Module,
    batches: Iterable,
    masks: Mapping[str, torch.Tensor],
    *,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    out: torch.Tensor | None = None,
    options: PassOptions | None = None,
    **option_values,
) -> tuple[torch.Tensor, int]:
    """``(F_sum, count)``: ``F_sum = Σ_k w_s Σ_s d_{s,k,S} d_{s,k,S}^T`` (``S x S``, in ``dtype``).

    Options: a :class:`~laplace_core.curvature.batch_loop.PassOptions` and/or its fields as keywords
    (``fisher="mc"``, ``mc_samples=1``, ``generator=None``, ``dtype=torch.float64``,
    ``likelihood="classification"``, ``max_chunk_elements=2**26``, ``precision="fp32"``).

    ``d_{s,k,S}`` = per-example gradient of ``log p(y_s | x_k)`` at the selected weights
    (subnetwork order, module docstring). ``fisher="mc"``: ``mc_samples`` labels drawn
    from the model's predictive with ``generator`` (the same draws as
    :func:`laplace_core.curvature.collect.collect_statistics` makes from a generator in the same
    state, or with a :class:`~laplace_core.curvature.keyed_rng.KeyedSampler` the same keyed draws,
    batches then carrying keys: ``(x, y, keys)`` or a dict ``"key"``),
    ``w_s = 1/mc_samples``; ``"empirical"``: true labels; ``"ggn"``: the exact
    GGN, ``Σ_k J_S^T Λ_k J_S`` (one backward pass per class/output). ``masks``: bool
    ``(m, n)`` per curvature layer in model order (layers may be omitted: nothing
    selected there). Fails up front when ``S²`` numbers exceed ``memory_budget`` bytes.
    Model in ``eval()`` mode; modes restored; ``.grad`` untouched.

    ``out``: an ``S x S`` tensor of ``dtype`` on the model's device to add this data's
    sum into (returned as ``F_sum``; ``count`` is still this call's): a sum over several
    calls, e.g. one per data partition, then holds a single ``S x S`` matrix.
    """
    opts = PassOptions.build(options, **option_values)
    if opts.fisher not in SUBNET_FISHER_TYPES:
        raise ValueError(f"unknown subnet fisher {opts.fisher!r}; valid: {', '.join(SUBNET_FISHER_TYPES)}")
    if opts.likelihood not in ("classification", "regression"):
        raise ValueError(f"unknown likelihood {opts.likelihood!r}; valid: classification, regression")
    modules, infos, _ = find_layers(model, norm_layers="diag")  # masks may select normalisation weights too
    names = _check_masks(masks, modules, infos)
    size = subnet_size({k: masks[k] for k in names})
    if size == 0:
        raise ValueError("the masks select no weight (S = 0)")
    check_subnet_memory(size, memory_budget, opts.dtype)
    device = next(iter(modules.values())).weight.device
    selected = {}
    for k in names:
        nz = masks[k].to(device).T.nonzero()  # (j, i) pairs in vec (column-stacking) order
        if nz.shape[0]:
            selected[k] = (nz[:, 1], nz[:, 0])
    fisher_sum = _fisher_buffer(out, size, opts.dtype, device)
    count = 0
    # only the layers with selected weights are captured: the backward stops at the lowest of
    # them (a last-layer subnetwork back-propagates to the last layer only)
    with contextlib.closing(model_batches(model, batches, {k: modules[k] for k in selected}, opts)) as stream:
        for batch in stream:
            _add_subnet_batch(fisher_sum, batch, modules, selected, opts, model)
            count += batch.size
            batch.capture.clear()
    if count == 0:
        raise ValueError("no batches: the data iterable was empty")
    if not bool(torch.isfinite(fisher_sum).all()):
        raise FloatingPointError("subnet Fisher is not finite (overflow in the model's dtype?); run in float64")
    return fisher_sum, count
