"""One pass over the data: KFAC factors, the exact Fisher diagonal and EFB sums.

For ``M`` examples and every registered layer (``W~`` is ``m x n``, docs/design.md §1), with
input rows ``a_{k,t}`` (``n``) and output-gradient rows ``g_{k,t}`` (``m``) of the
per-example log-likelihood ``log p(y_k | x_k)`` over ``T`` positions:

* ``A    = Σ_{k,t} a a^T / T``                       (n x n)
* ``G    = Σ_{k,t} g g^T``                           (m x m)
* ``diag = Σ_k d_k ∘ d_k``, ``d_k = Σ_t g_{k,t} a_{k,t}^T`` (m x n, exact)
* ``efb  = Σ_k (U_G^T d_k U_A)^2``                   (m x n, George et al. 2018;
  with a basis from :func:`laplace_core.eigenbasis.eigenbasis`)

Labels ``y_k`` are sampled from the model's predictive (``fisher="mc"``,
``mc_samples`` draws per example, output-gradient quantities averaged over the draws)
or are the true labels (``fisher="empirical"``). Everything is a sum plus a count,
accumulated in ``dtype`` (float64 by default) while the matrix products run in the
model's dtype.

Cost per example and layer (multiply counts, docs/design.md §1): forward ``mnT`` and the
back-propagation of output gradients ``≈ mnT`` (weight gradients are never formed);
``A``: ``n²T``, as a blocked symmetric product (upper blocks only, ``(k+1)/2k`` of
that); ``G``: ``m²T``; ``diag``: for ``T > 8`` positions ``d_k`` by a batched matmul
(``mnT``), squared and summed; for ``T <= 8`` one GEMM over position pairs,
``Σ_k d_k∘d_k = Σ_{t<=t'} w (g_t∘g_t')^T (a_t∘a_t')`` (``mnT(T+1)/2`` multiplies at
full GEMM speed instead of a memory-bound ``m x n`` intermediate per example; for
``T = 1`` it is ``(g∘g)^T (a∘a)``). EFB takes the cheaper of "form ``d_k`` then
rotate" (``mnT + m²n + mn²``, the ``mnT`` free when the diagonal already formed
``d_k``) and "rotate ``a`` and ``g`` first" (``n²T + m²T + mnT``); small ``T``
always rotates first and squares through the pair GEMM. Work is chunked over
examples so that no intermediate exceeds ``max_chunk_elements`` elements; sums over
about ``flush_examples`` examples stay in the compute dtype (inside the GEMMs) before
being added to the ``dtype`` totals.

The per-layer arithmetic is in :mod:`laplace_core.accumulate`, the likelihoods and label
draws in :mod:`laplace_core.likelihoods`; this module runs the pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch
from torch import nn

from .accumulate import EFB_ORDERS, Accumulator, GroupedConvSums, LayerSums, sym_blocks
from .eigenbasis import Eigenbasis, LayerBasis
from .hooks import capture
from .keyed_rng import KeyedSampler
from .layers import GroupView, check_norm_layers, find_layers
from .likelihoods import check_fisher, likelihood_for
from .statistics import CurvatureStatistics, LayerInfo, LayerStatistics

__all__ = [
    "collect_statistics",
    "collect_efb",
    "split_batch",
]


# =========================================================================== batches
def split_batch(batch, i: int) -> tuple[torch.Tensor, object, object]:
    """``(x, y, keys)``; ``keys`` (per-example integer ids for keyed MC sampling) come from
    a dict batch's ``"key"`` entry or the third element of an ``(x, y, keys)`` tuple."""
    if isinstance(batch, Mapping):
        x = batch["image"] if "image" in batch else batch.get("x")
        y = batch["label"] if "label" in batch else batch.get("y")
        if x is None:
            raise ValueError(f"batch {i}: dict batches need an 'image' (or 'x') entry, got keys {sorted(batch)}")
        return x, y, batch.get("key")
    if isinstance(batch, (tuple, list)):
        if len(batch) not in (2, 3):
            raise ValueError(f"batch {i}: expected an (x, y) pair or (x, y, keys), got a sequence of length {len(batch)}")
        return batch[0], batch[1], (batch[2] if len(batch) == 3 else None)
    if isinstance(batch, torch.Tensor):
        return batch, None, None
    raise ValueError(f"batch {i}: expected (x, y), a dict with 'image'/'label', or a tensor; got {type(batch).__name__}")


def _resolve_basis(basis, infos: Mapping[str, LayerInfo], cdtype, device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    layers = basis.layers if isinstance(basis, Eigenbasis) else basis
    if not isinstance(layers, Mapping):
        raise ValueError(f"basis must be an Eigenbasis or a mapping name -> LayerBasis, got {type(basis).__name__}")
    out = {}
    for name, info in infos.items():
        if info.diag_only:
            continue  # normalisation layers: no eigenbasis, no EFB sums
        if name not in layers:
            raise ValueError(f"basis has no entry for layer {name!r}")
        lb = layers[name]
        if not isinstance(lb, LayerBasis):
            raise ValueError(f"basis entry {name!r} is {type(lb).__name__}, expected LayerBasis")
        m, n = info.shape
        if tuple(lb.U_A.shape) != (n, n) or tuple(lb.U_G.shape) != (m, m):
            raise ValueError(
                f"basis for layer {name!r} has U_A {tuple(lb.U_A.shape)}, U_G {tuple(lb.U_G.shape)}; "
                f"expected ({n}, {n}) and ({m}, {m})"
            )
        out[name] = (lb.U_A.to(device=device, dtype=cdtype), lb.U_G.to(device=device, dtype=cdtype))
    return out


@dataclass(frozen=True)
class _PassResult:
    layers: dict[str, tuple]  # name -> (A, G, diag, efb) totals (None where not computed)
    infos: dict[str, LayerInfo]
    excluded: dict[str, str]
    count: int
    skipped_batches: int
    skipped_examples: int
    S: int


def _run(
    model: nn.Module,
    batches: Iterable,
    *,
    kfac: bool,
    basis,
    fisher: str,
    mc_samples: int,
    generator: torch.Generator | None,
    dtype: torch.dtype,
    likelihood: str,
    progress: Callable[[int], None] | None,
    max_chunk_elements: int,
    flush_examples: int,
    efb_order: str | None,
    norm_layers: str = "map",
    layers="all",
) -> _PassResult:
    lik = likelihood_for(likelihood)
    S = check_fisher(fisher, mc_samples)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if efb_order is not None and efb_order not in EFB_ORDERS:
        raise ValueError(f"unknown EFB contraction order {efb_order!r}; valid: {', '.join(EFB_ORDERS)}")
    if int(flush_examples) < 1:
        raise ValueError(f"flush_examples must be positive, got {flush_examples}")
    if int(max_chunk_elements) < 1:
        raise ValueError(f"max_chunk_elements must be positive, got {max_chunk_elements}")
    modules, infos, excluded = find_layers(model, norm_layers=check_norm_layers(norm_layers), layers=layers)
    if not modules:
        raise ValueError("model has no supported trainable layers (nn.Linear / nn.Conv2d with groups=1)")
    first = next(iter(modules.values())).weight
    cdtype, device = first.dtype, first.device
    bases = _resolve_basis(basis, infos, cdtype, device) if basis is not None else {}

    def acc(*shape, sym=1):
        return Accumulator(shape, dtype, cdtype, device, sym_blocks=sym)

    layers: dict[str, LayerSums] = {}
    grouped: dict[int, list[str]] = {}  # all groups of a grouped conv go to one GroupedConvSums
    for name, mod in modules.items():
        if isinstance(mod, GroupView):
            grouped.setdefault(id(mod.parent), []).append(name)
    grouped = {pid: ns for pid, ns in grouped.items() if len(ns) == modules[ns[0]].parent.groups and len(ns) > 1}
    in_group = {n for ns in grouped.values() for n in ns}
    gconvs = [GroupedConvSums(ns, modules[ns[0]].parent, infos[ns[0]], kfac,
                           [bases[k] for k in ns] if basis is not None else None, acc) for ns in grouped.values()]
    for name, mod in modules.items():
        if name in in_group:
            continue
        m, n = infos[name].shape
        U_A, U_G = bases.get(name, (None, None))
        dg = infos[name].diag_only
        layers[name] = LayerSums(
            name=name, module=mod, info=infos[name],
            A=acc(n, n, sym=sym_blocks(n)) if kfac and not dg else None, G=acc(m, m) if kfac and not dg else None,
            diag=acc(m, n) if kfac else None, efb=acc(m, n) if basis is not None and not dg else None,
            U_A=U_A, U_G=U_G, force_order=efb_order,
        )

    def flush(i):
        checks = [c for layer in (*layers.values(), *gconvs) for a in layer.accumulators() if (c := a.flush()) is not None]
        if checks and not bool(torch.isfinite(torch.stack(checks)).all()):
            raise FloatingPointError(
                f"batch {i}: finite activations and gradients overflowed in the curvature products "
                f"(compute dtype {cdtype}); run the model in float64"
            )

    modes = {mod: mod.training for mod in model.modules()}
    model.eval()
    count = seen = skipped_batches = skipped_examples = n_batches = pending = 0
    try:
        with capture(model, modules) as cap, torch.enable_grad():
            for i, batch in enumerate(batches):
                n_batches += 1
                x, y, keys = split_batch(batch, i)
                if not isinstance(x, torch.Tensor):
                    x = torch.as_tensor(x)
                if x.dim() == 0 or x.shape[0] == 0:
                    raise ValueError(f"batch {i}: empty input of shape {tuple(x.shape)}")
                x = x.to(device=device, dtype=cdtype if x.dtype.is_floating_point else x.dtype)
                B = x.shape[0]
                out = model(x)
                if not isinstance(out, torch.Tensor):
                    raise ValueError(f"model output must be a tensor, got {type(out).__name__}")
                if out.shape[0] != B:
                    raise ValueError(f"batch {i}: model output has batch size {out.shape[0]}, input has {B}")
                missing = cap.missing()
                if missing:
                    raise ValueError(f"layers not called in the forward pass: {missing[:5]}")
                labels = lik.check(out.detach(), y, fisher)
                seen += B
                od = out.detach()
                if not bool(torch.isfinite(od).all()):
                    skipped_batches += 1
                    skipped_examples += B
                    if progress is not None:
                        progress(seen)
                    continue
                if fisher == "empirical":
                    targets = labels.unsqueeze(0)
                elif isinstance(generator, KeyedSampler):
                    if keys is None:
                        raise ValueError(f"batch {i}: a KeyedSampler needs per-example keys (dict key 'key')")
                    keys = torch.as_tensor(keys).reshape(-1)
                    if keys.shape[0] != B:
                        raise ValueError(f"batch {i}: {keys.shape[0]} keys for {B} examples")
                    targets = lik.sample_keyed(od, S, generator.seed, keys)
                else:
                    targets = lik.sample(od, S, generator)
                go = lik.output_grad(od, targets).to(out.dtype)
                checks = [lik.log_lik(od, targets).reshape(1)]
                grads: dict[str, list[torch.Tensor]] = {k: [] for k in modules}
                for s in range(S):
                    gs = cap.backward(out, go[s], retain_graph=s < S - 1)
                    for k in modules:
                        grads[k].append(gs[k])
                del out
                checks += [cap.inputs[k].sum().reshape(1).to(cdtype) for k in modules]
                checks += [g.sum().reshape(1) for k in modules for g in grads[k]]
                if not bool(torch.isfinite(torch.cat(checks)).all()):
                    skipped_batches += 1
                    skipped_examples += B
                    if progress is not None:
                        progress(seen)
                    continue
                for k, layer in layers.items():
                    layer.add(cap.inputs[k], grads[k], int(max_chunk_elements))
                    grads[k] = []
                for gc in gconvs:  # the groups share the convolution's input and output gradient
                    gc.add(cap.inputs[gc.names[0]], grads[gc.names[0]], int(max_chunk_elements))
                    for k in gc.names:
                        grads[k] = []
                count += B
                pending += B
                if pending >= flush_examples:
                    flush(i)
                    pending = 0
                if progress is not None:
                    progress(seen)
                cap.clear()
            if pending:
                flush(n_batches - 1)
    finally:
        for mod, mode in modes.items():
            mod.training = mode
    if n_batches == 0 or seen == 0:
        raise ValueError("no batches: the data iterable was empty")
    totals = {
        k: tuple(None if a is None else a.total for a in (l.A, l.G, l.diag, l.efb)) for k, l in layers.items()
    }
    for gc in gconvs:
        totals.update(gc.totals())
    totals = {k: totals[k] for k in modules}  # model order
    return _PassResult(totals, infos, excluded, count, skipped_batches, skipped_examples, S)


# =========================================================================== public
def collect_statistics(
    model: nn.Module,
    batches: Iterable,
    *,
    fisher: str = "mc",
    mc_samples: int = 1,
    generator: torch.Generator | KeyedSampler | None = None,
    basis: Eigenbasis | Mapping[str, LayerBasis] | None = None,
    dtype: torch.dtype = torch.float64,
    likelihood: str = "classification",
    progress: Callable[[int], None] | None = None,
    max_chunk_elements: int = 2**26,
    flush_examples: int = 256,
    _efb_order: str | None = None,
    norm_layers: str = "map",
    layers="all",
) -> CurvatureStatistics:
    """KFAC sums ``A``, ``G``, the exact Fisher diagonal and the count ``M`` in one pass;
    with ``basis`` also the EFB sums ``efb`` (and ``efb_count = M``).

    ``batches``: iterable of ``(x, y)`` pairs or dicts with ``"image"``/``"label"``
    (or ``"x"``/``"y"``); ``y`` may be ``None`` for ``fisher="mc"``. The model runs in
    ``eval()`` mode (each module's mode is restored afterwards); parameters keep
    ``requires_grad`` and ``.grad`` is never written. ``generator`` drives the label
    sampling (see :func:`sample_targets`); a :class:`~laplace_core.keyed_rng.KeyedSampler`
    instead draws each label from ``(seed, example key, draw)`` so that the sums do not
    depend on batching, sharding or restarts (batches then carry keys: ``"key"`` in dict
    batches or ``(x, y, keys)``). A batch whose outputs, log-likelihood,
    captured inputs or gradients are not finite is skipped and counted in
    ``skipped_batches`` / ``skipped_examples``. ``progress(n)`` is called after each
    batch with the number of examples seen so far. Products run in the model's dtype
    and are summed there over about ``flush_examples`` examples (whole batches) (inside the GEMMs)
    before being added into the ``dtype`` sums. ``_efb_order`` (``"form"`` /
    ``"rotate"``, tests only) forces the EFB contraction order.

    Shapes per layer (``W~`` is ``m x n``): ``A`` (n, n), ``G`` (m, m), ``diag`` and
    ``efb`` (m, n). Identities: docs/design.md §1; KFC (Grosse & Martens 2016) for convs.

    ``norm_layers="diag"`` adds the normalisation layers (:mod:`laplace_core.layers`):
    only their exact Fisher diagonal ``Σ_k d_k ∘ d_k`` (``d_k`` from
    :func:`laplace_core.hooks.norm_grads`), no ``A``, ``G`` or ``efb``. ``layers``: which
    curvature layers to collect (``"all"``, ``"last"``, names / globs;
    :func:`laplace_core.layer_selection.select_layers`); the others stay at MAP (``excluded``).
    """
    res = _run(
        model, batches, kfac=True, basis=basis, fisher=fisher, mc_samples=mc_samples, generator=generator,
        dtype=dtype, likelihood=likelihood, progress=progress, max_chunk_elements=max_chunk_elements,
        flush_examples=flush_examples, efb_order=_efb_order, norm_layers=norm_layers,
        layers=layers,
    )
    layers = {k: LayerStatistics(A=A, G=G, diag=diag, efb=efb) for k, (A, G, diag, efb) in res.layers.items()}
    return CurvatureStatistics(
        layers=layers,
        infos=res.infos,
        count=res.count,
        efb_count=res.count if basis is not None else 0,
        skipped_batches=res.skipped_batches,
        skipped_examples=res.skipped_examples,
        fisher=fisher,
        mc_samples=res.S,
        excluded=res.excluded,
    )


def collect_efb(
    model: nn.Module,
    batches: Iterable,
    basis: Eigenbasis | Mapping[str, LayerBasis],
    *,
    fisher: str = "mc",
    mc_samples: int = 1,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
    likelihood: str = "classification",
    progress: Callable[[int], None] | None = None,
    max_chunk_elements: int = 2**26,
    flush_examples: int = 256,
    _efb_order: str | None = None,
    norm_layers: str = "map",
    layers="all",
) -> tuple[dict[str, torch.Tensor], int]:
    """The EFB second pass alone: ``({name: Σ_k (U_G^T d_k U_A)^2}, M)``.

    Same arguments as :func:`collect_statistics`; no ``A``/``G``/``diag`` work, so the
    contraction order is chosen with ``have_d=False``. Attach the result with
    ``stats.with_efb(efb, count)``. Skipped batches are not in ``M``. Normalisation layers
    (``norm_layers="diag"``) have no EFB sums and are not in the result.
    """
    if basis is None:
        raise ValueError("collect_efb needs an eigenbasis (laplace_core.eigenbasis(stats))")
    res = _run(
        model, batches, kfac=False, basis=basis, fisher=fisher, mc_samples=mc_samples, generator=generator,
        dtype=dtype, likelihood=likelihood, progress=progress, max_chunk_elements=max_chunk_elements,
        flush_examples=flush_examples, efb_order=_efb_order, norm_layers=norm_layers,
        layers=layers,
    )
    return {k: t[3] for k, t in res.layers.items() if not res.infos[k].diag_only}, res.count
