"""One pass over the data: KFAC factors, the exact Fisher diagonal and EFB sums.

For ``M`` examples and every registered layer (``W~`` is ``m x n``, docs/design.md §1), with
input rows ``a_{k,t}`` (``n``) and output-gradient rows ``g_{k,t}`` (``m``) of the
per-example log-likelihood ``log p(y_k | x_k)`` over ``T`` positions:

* ``A    = Σ_{k,t} a a^T / T``                       (n x n)
* ``G    = Σ_{k,t} g g^T``                           (m x m)
* ``diag = Σ_k d_k ∘ d_k``, ``d_k = Σ_t g_{k,t} a_{k,t}^T`` (m x n, exact)
* ``efb  = Σ_k (U_G^T d_k U_A)^2``                   (m x n, George et al. 2018;
  with a basis from :func:`laplace_core.basis.eigenbasis.eigenbasis`)

Labels ``y_k`` are sampled from the model's predictive (``fisher="mc"``,
``mc_samples`` draws per example, output-gradient quantities averaged over the draws)
or are the true labels (``fisher="empirical"``). Everything is a sum plus a count,
accumulated in ``dtype`` (float64 by default) while the matrix products run in the
model's dtype.

Cost per example and layer (multiply counts, docs/design.md §1): forward ``mnT`` and the
back-propagation of output gradients ``≈ mnT`` (weight gradients are never formed);
``A``: ``n²T``, as a blocked symmetric product (upper blocks only, ``(k+1)/2k`` of
that); ``G``: ``m²T``; ``diag``: for ``T > 8`` positions ``d_k`` (``mnT``), squared and summed,
one example at a time through a cache-resident scratch on a CPU and as one batched matmul
on an accelerator (docs/design.md §1: memory traffic, not multiplies, decides); for
``T <= 8`` one GEMM over position pairs,
``Σ_k d_k∘d_k = Σ_{t<=t'} w (g_t∘g_t')^T (a_t∘a_t')`` (``mnT(T+1)/2`` multiplies at
full GEMM speed instead of a memory-bound ``m x n`` intermediate per example; for
``T = 1`` it is ``(g∘g)^T (a∘a)``). EFB takes the cheaper of "form ``d_k`` then
rotate" (``mnT + m²n + mn²``, the ``mnT`` free when the diagonal already formed
``d_k``) and "rotate ``a`` and ``g`` first" (``n²T + m²T + mnT``); small ``T``
always rotates first and squares through the pair GEMM. Work is chunked over
examples so that no intermediate exceeds ``max_chunk_elements`` elements; a
convolution's rows are gathered in tap-major order (:func:`~laplace_core.curvature.tap_major.conv_rows_tap_major`)
and its ``A`` and ``diag`` put back into ``weight.reshape(m, -1)`` order at each flush; sums over
about ``flush_examples`` examples stay in the compute dtype (inside the GEMMs) before
being added to the ``dtype`` totals.

The per-layer arithmetic is in :mod:`laplace_core.curvature.accumulate`, the likelihoods and label
draws in :mod:`laplace_core.curvature.likelihoods`, the batch loop and the options
(:class:`~laplace_core.curvature.batch_loop.PassOptions`, including ``precision``) in
:mod:`laplace_core.curvature.batch_loop`; this module runs the pass.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch import nn

from .accumulate import EFB_ORDERS, Accumulator, GroupedConvSums, LayerSums, sym_blocks
from .batch_loop import ModelBatch, PassOptions, draw_targets, model_batches, split_batch
from ..basis.eigenbasis import Eigenbasis, LayerBasis
from .free_grads import FreeDiagSums, free_grads, free_views
from .layers import GroupView, check_norm_layers, find_layers, is_free
from .likelihoods import check_fisher, likelihood_for
from .statistics import CurvatureStatistics, LayerInfo, LayerStatistics

__all__ = [
    "collect_statistics",
    "collect_efb",
    "split_batch",
    "PassOptions",
]


# =========================================================================== set-up
def _resolve_basis(basis, infos: Mapping[str, LayerInfo], cdtype, device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    layer_bases = basis.layers if isinstance(basis, Eigenbasis) else basis
    if not isinstance(layer_bases, Mapping):
        raise ValueError(f"basis must be an Eigenbasis or a mapping name -> LayerBasis, got {type(basis).__name__}")
    resolved = {}
    for name, info in infos.items():
        if info.diag_only:
            continue  # normalisation layers: no eigenbasis, no EFB sums
        if name not in layer_bases:
            raise ValueError(f"basis has no entry for layer {name!r}")
        lb = layer_bases[name]
        if not isinstance(lb, LayerBasis):
            raise ValueError(f"basis entry {name!r} is {type(lb).__name__}, expected LayerBasis")
        m, n = info.shape
        if tuple(lb.U_A.shape) != (n, n) or tuple(lb.U_G.shape) != (m, m):
            raise ValueError(
                f"basis for layer {name!r} has U_A {tuple(lb.U_A.shape)}, U_G {tuple(lb.U_G.shape)}; "
                f"expected ({n}, {n}) and ({m}, {m})"
            )
        resolved[name] = (lb.U_A.to(device=device, dtype=cdtype), lb.U_G.to(device=device, dtype=cdtype))
    return resolved


def _layer_sums(modules, infos, kfac: bool, bases, opts: PassOptions, weight: torch.Tensor) -> list:
    """One :class:`LayerSums` per layer, one :class:`GroupedConvSums` per grouped convolution
    (all its groups together), in model order of their first layer."""
    def acc(*shape, sym=1):
        return Accumulator(shape, opts.dtype, weight.dtype, weight.device, sym_blocks=sym)

    groups: dict[int, list[str]] = {}
    for name, mod in modules.items():
        if isinstance(mod, GroupView):
            groups.setdefault(id(mod.parent), []).append(name)
    groups = {pid: ns for pid, ns in groups.items() if len(ns) == modules[ns[0]].parent.groups and len(ns) > 1}
    first_of = {ns[0]: ns for ns in groups.values()}
    in_group = {n for ns in groups.values() for n in ns}
    sums = []
    for name, mod in modules.items():
        if is_free(mod):
            continue  # FreeDiagSums (free_grads), after these
        if name in first_of:
            names = first_of[name]
            sums.append(GroupedConvSums(names, mod.parent, infos[name], kfac,
                                        [bases[k] for k in names] if bases else None, acc))
        elif name not in in_group:
            m, n = infos[name].shape
            U_A, U_G = bases.get(name, (None, None))
            factors = kfac and not infos[name].diag_only
            sums.append(LayerSums(
                name=name, module=mod, info=infos[name],
                A=acc(n, n, sym=sym_blocks(n)) if factors else None, G=acc(m, m) if factors else None,
                diag=acc(m, n) if kfac else None, efb=acc(m, n) if U_A is not None else None,
                U_A=U_A, U_G=U_G, force_order=opts.efb_order,
            ))
    free = free_views(modules)
    if free and kfac:
        sums.append(FreeDiagSums(free, infos, opts.dtype, weight.dtype, weight.device))
    return sums


# =========================================================================== the pass
@dataclass
class _Tally:
    batches: int = 0
    seen: int = 0
    count: int = 0
    pending: int = 0
    skipped_batches: int = 0
    skipped_examples: int = 0


@dataclass(frozen=True)
class _PassResult:
    totals: dict[str, tuple]  # name -> (A, G, diag, efb) sums (None where not computed)
    infos: dict[str, LayerInfo]
    excluded: dict[str, str]
    tally: _Tally
    draws: int  # label draws per example


def _flush(sums, batch_index: int, cdtype) -> None:
    checks = [c for layer in sums for a in layer.accumulators() if (c := a.flush()) is not None]
    if checks and not bool(torch.isfinite(torch.stack(checks)).all()):
        raise FloatingPointError(
            f"batch {batch_index}: finite activations and gradients overflowed in the curvature products "
            f"(compute dtype {cdtype}); run the model in float64"
        )


def _output_grads(lik, batch: ModelBatch, modules, draws: int, opts: PassOptions, free=None) -> dict[str, list] | None:
    """Per layer, one captured output gradient per label draw (a free parameter: its per-example
    gradients, ``[(S, B, m, n)]``, from ``free = (model, views)``); ``None`` when the outputs, the
    log-likelihood, the captured inputs or the gradients are not finite (batch skipped)."""
    cap, logits = batch.capture, batch.logits
    labels = lik.check(logits, batch.labels, opts.fisher)
    if not bool(torch.isfinite(logits).all()):
        return None
    targets = draw_targets(lik, batch, labels, draws, opts)
    seeds = lik.output_grad(logits, targets).to(batch.outputs.dtype)
    checks = [lik.log_lik(logits, targets).reshape(1)]
    hooked = [k for k in modules if k in cap.modules]
    grads: dict[str, list[torch.Tensor]] = {k: [] for k in hooked}
    for s in range(draws if hooked else 0):
        per_layer = cap.backward(batch.outputs, seeds[s], retain_graph=s < draws - 1)
        for k in hooked:
            grads[k].append(per_layer[k])
    batch.outputs = None  # free the graph before the products
    if free is not None:
        fg = free_grads(free[0], free[1], batch.inputs, seeds.to(batch.inputs.dtype), max_elements=opts.max_chunk_elements, cap=cap)
        grads.update({k: [g] for k, g in fg.items()})
    checks += [cap.inputs[k].sum().reshape(1).to(logits.dtype) for k in hooked]
    checks += [g.sum().reshape(1).to(logits.dtype) for k in grads for g in grads[k]]
    return grads if bool(torch.isfinite(torch.cat(checks)).all()) else None


def _add_batch(sums, cap, grads: dict[str, list], cdtype, max_chunk: int) -> None:
    """Add one batch to every layer's sums (a grouped convolution's groups share its input
    and output gradient); captured half-precision rows are cast to the model's dtype."""
    for layer in sums:
        first = layer.names[0]
        if isinstance(layer, FreeDiagSums):
            layer.add({k: grads[k][0] for k in layer.names})
            continue
        layer.add(cap.inputs[first].to(cdtype), [g.to(cdtype) for g in grads[first]], max_chunk)
        for k in layer.names:
            grads[k] = []


def _run(model: nn.Module, batches: Iterable, *, kfac: bool, basis, opts: PassOptions) -> _PassResult:
    lik = likelihood_for(opts.likelihood)
    draws = check_fisher(opts.fisher, opts.mc_samples)
    if opts.efb_order is not None and opts.efb_order not in EFB_ORDERS:
        raise ValueError(f"unknown EFB contraction order {opts.efb_order!r}; valid: {', '.join(EFB_ORDERS)}")
    modules, infos, excluded = find_layers(model, norm_layers=check_norm_layers(opts.norm_layers), layers=opts.layers)
    if not modules:
        raise ValueError("model has no supported trainable layers (nn.Linear / nn.Conv2d with groups=1)")
    weight = next(iter(modules.values())).weight
    bases = _resolve_basis(basis, infos, weight.dtype, weight.device) if basis is not None else {}
    sums = _layer_sums(modules, infos, kfac, bases, opts, weight)
    free = (model, free_views(modules)) if any(isinstance(s, FreeDiagSums) for s in sums) else None
    tally = _Tally()
    with contextlib.closing(model_batches(model, batches, modules, opts)) as stream:
        for batch in stream:
            tally.batches += 1
            tally.seen += batch.size
            grads = _output_grads(lik, batch, modules, draws, opts, free)
            if grads is None:
                tally.skipped_batches += 1
                tally.skipped_examples += batch.size
            else:
                _add_batch(sums, batch.capture, grads, weight.dtype, int(opts.max_chunk_elements))
                tally.count += batch.size
                tally.pending += batch.size
                if tally.pending >= opts.flush_examples:
                    _flush(sums, batch.index, weight.dtype)
                    tally.pending = 0
            if opts.progress is not None:
                opts.progress(tally.seen)
            batch.capture.clear()
        if tally.pending:
            _flush(sums, tally.batches - 1, weight.dtype)
    if tally.batches == 0 or tally.seen == 0:
        raise ValueError("no batches: the data iterable was empty")
    totals = {k: t for layer in sums for k, t in layer.totals().items()}
    return _PassResult({k: totals[k] for k in modules if k in totals}, infos, excluded, tally, draws)


# =========================================================================== public
def collect_statistics(
    model: nn.Module,
    batches: Iterable,
    *,
    basis: Eigenbasis | Mapping[str, LayerBasis] | None = None,
    options: PassOptions | None = None,
    **option_values,
) -> CurvatureStatistics:
    """KFAC sums ``A``, ``G``, the exact Fisher diagonal and the count ``M`` in one pass;
    with ``basis`` also the EFB sums ``efb`` (and ``efb_count = M``).

    Options: a :class:`~laplace_core.curvature.batch_loop.PassOptions` and/or its fields as keywords
    (``fisher="mc"``, ``mc_samples=1``, ``generator=None``, ``dtype=torch.float64``,
    ``likelihood="classification"``, ``progress=None``, ``max_chunk_elements=2**26``,
    ``flush_examples=256``, ``norm_layers="map"``, ``layers="all"``,
    ``precision="fp32"``, ``channels_last=False``; ``_efb_order`` for ``efb_order``).

    ``batches``: iterable of ``(x, y)`` pairs or dicts with ``"image"``/``"label"``
    (or ``"x"``/``"y"``); ``y`` may be ``None`` for ``fisher="mc"``. The model runs in
    ``eval()`` mode (each module's mode is restored afterwards); parameters keep
    ``requires_grad`` and ``.grad`` is never written. ``generator`` drives the label
    sampling (see :func:`sample_targets`); a :class:`~laplace_core.curvature.keyed_rng.KeyedSampler`
    instead draws each label from ``(seed, example key, draw)`` so that the sums do not
    depend on batching, sharding or restarts (batches then carry keys: ``"key"`` in dict
    batches or ``(x, y, keys)``). A batch whose outputs, log-likelihood,
    captured inputs or gradients are not finite is skipped and counted in
    ``skipped_batches`` / ``skipped_examples``. ``progress(n)`` is called after each
    batch with the number of examples seen so far. Products run in the model's dtype
    and are summed there over about ``flush_examples`` examples (whole batches) (inside the GEMMs)
    before being added into the ``dtype`` sums. ``_efb_order`` (``"form"`` /
    ``"rotate"``, tests only) forces the EFB contraction order. ``precision="bf16"``
    (or ``"fp16"``) runs the forward and backward under autocast
    (:mod:`laplace_core.curvature.batch_loop`); the products and sums stay as described.

    Shapes per layer (``W~`` is ``m x n``): ``A`` (n, n), ``G`` (m, m), ``diag`` and
    ``efb`` (m, n). Identities: docs/design.md §1; KFC (Grosse & Martens 2016) for convs.

    ``norm_layers="diag"`` adds the normalisation layers (:mod:`laplace_core.curvature.layers`):
    only their exact Fisher diagonal ``Σ_k d_k ∘ d_k`` (``d_k`` from
    :func:`laplace_core.curvature.hooks.norm_grads`), no ``A``, ``G`` or ``efb``; and the free parameters
    (:class:`~laplace_core.curvature.layers.FreeView`: ``d_k`` from
    :func:`laplace_core.curvature.free_grads.free_grads`, one more forward and backward per batch). ``layers``: which
    curvature layers to collect (``"all"``, ``"last"``, names / globs;
    :func:`laplace_core.curvature.layer_selection.select_layers`); the others stay at MAP (``excluded``).
    """
    opts = PassOptions.build(options, **option_values)
    res = _run(model, batches, kfac=True, basis=basis, opts=opts)
    tally = res.tally
    return CurvatureStatistics(
        layers={k: LayerStatistics(A=A, G=G, diag=diag, efb=efb) for k, (A, G, diag, efb) in res.totals.items()},
        infos=res.infos,
        count=tally.count,
        efb_count=tally.count if basis is not None else 0,
        skipped_batches=tally.skipped_batches,
        skipped_examples=tally.skipped_examples,
        fisher=opts.fisher,
        mc_samples=res.draws,
        excluded=res.excluded,
    )


def collect_efb(
    model: nn.Module,
    batches: Iterable,
    basis: Eigenbasis | Mapping[str, LayerBasis],
    *,
    options: PassOptions | None = None,
    **option_values,
) -> tuple[dict[str, torch.Tensor], int]:
    """The EFB second pass alone: ``({name: Σ_k (U_G^T d_k U_A)^2}, M)``.

    Same options as :func:`collect_statistics`; no ``A``/``G``/``diag`` work, so the
    contraction order is chosen with ``have_d=False``. Attach the result with
    ``stats.with_efb(efb, count)``. Skipped batches are not in ``M``. Normalisation layers
    (``norm_layers="diag"``) have no EFB sums and are not in the result.
    """
    if basis is None:
        raise ValueError("collect_efb needs an eigenbasis (laplace_core.eigenbasis(stats))")
    res = _run(model, batches, kfac=False, basis=basis, opts=PassOptions.build(options, **option_values))
    return {k: t[3] for k, t in res.totals.items() if not res.infos[k].diag_only}, res.tally.count
