"""Subnetwork Laplace (Daxberger et al. 2021): selection, subnetwork Fisher, posterior.

1. **Selection** (§5, eq. 23). With a diagonal approximation ``σ_d²`` of the posterior
   marginal variances, the squared 2-Wasserstein distance between the full posterior
   and the subnetwork posterior (MAP outside the subnetwork, mask ``m_d``) is
   ``≈ Σ_d σ_d² (1 − m_d)``, minimised by keeping the ``S`` weights of **largest
   marginal variance**. From the statistics already collected,
   ``σ_d² = 1 / (N diag_d/M + τ)`` (diagonal Laplace). ``rule="random"`` is the
   uniform baseline. Ties are broken by position (layers in model order, then ``vec``
   order), so selection is deterministic. Caveat (Daxberger et al. §6.3): weights with
   zero Fisher (dead ReLUs) have the prior variance ``1/τ``, the largest possible,
   and are picked first although they do not move the function. ``rule="wasserstein_live"``
   (opt-in, not in the paper) ranks the same way but only among **live** weights, whose
   Fisher diagonal is ``> LIVE_RTOL x`` its layer's largest (:func:`live_weights`).
2. **Inference** (§3): the full ``S x S`` Fisher over the selected weights,
   ``F_sum = Σ_k d_{k,S} d_{k,S}^T`` from per-example gradients gathered at the
   selected entries (:func:`~laplace_core.curvature.subnet_fisher.collect_subnet_fisher`, a pass of
   the curvature floor; MC / empirical labels as in
   :mod:`laplace_core.curvature.collect`, or the exact GGN ``Σ_k J_S^T Λ J_S`` with
   ``Λ = diag(p) − p p^T`` (classification) or ``I`` (unit-noise regression)). Sums plus
   the count, so shards merge by addition.
3. **Posterior**: ``P_S = N F_sum/count + τ (S / D_total) I`` (prior rescaling of §4 /
   appendix C), :class:`~laplace_core.posteriors.structures.subnet.SubnetPosterior`. Predict with
   :mod:`laplace_core.predictive.glm` (linearised) or :class:`~laplace_core.predictive.monte_carlo.MCPredictor`.

Subnetwork order: layers in model order (:func:`~laplace_core.curvature.layers.find_layers`), within
a layer ascending ``vec`` (column-stacking) position of ``W~``.
"""
from __future__ import annotations

import math
import warnings
from typing import Mapping

import torch
from torch import nn

from ..curvature.statistics import CurvatureStatistics
from ..curvature.subnet_fisher import DEFAULT_MEMORY_BUDGET, check_subnet_memory, collect_subnet_fisher
from ..names import SELECTION_RULES
from .structures.base import Posterior, vec
from .structures.diag import DiagLayer, check_hyper
from .structures.subnet import SubnetLayerView, SubnetPosterior

__all__ = [
    "SELECTION_RULES",
    "LIVE_RTOL",
    "marginal_variances",
    "live_weights",
    "select_subnetwork",
    "build_subnet_posterior",
    "subnet_laplace",
]

LIVE_RTOL = 1e-12
"""A weight is live when its Fisher diagonal is ``> LIVE_RTOL x`` the largest of its layer
(see :func:`live_weights`): gradients below ``1e-6`` of the layer's largest (about ten
float32 round-off units), squared, count as dead."""


# =========================================================================== selection
def marginal_variances(source, prior_precision: float = 1.0, n_data: float | None = None) -> dict[str, torch.Tensor]:
    """Diagonal-Laplace marginal variances ``name -> (m, n)``.

    ``source``: :class:`CurvatureStatistics` (``1 / (N diag/M + τ)``, ``N`` default ``M``),
    a :class:`Posterior` (its ``marginal_variance()``, e.g. a ``diag`` posterior), or a
    mapping ``name -> (m, n)`` of variances (used as given, e.g. exact full-covariance
    marginals on a toy problem as in Daxberger et al. §6.1).
    """
    if isinstance(source, CurvatureStatistics):
        if source.count <= 0:
            raise ValueError("statistics of zero examples: no Fisher diagonal to select from")
        N, tau = check_hyper(source.count if n_data is None else n_data, prior_precision)
        out = {}
        for k, ls in source.layers.items():
            prec = N * ls.diag.to(torch.float64) / source.count + tau
            if bool((prec <= 0).any()):
                raise ValueError(f"layer {k!r}: N diag/M + tau has non-positive entries; use prior_precision > 0")
            out[k] = 1.0 / prec
        return out
    if isinstance(source, Posterior):
        return {k: v.to(torch.float64) for k, v in source.marginal_variance().items()}
    if isinstance(source, Mapping):
        out = {}
        for k, v in source.items():
            if not isinstance(v, torch.Tensor) or v.dim() != 2:
                raise ValueError(f"marginal variances must be m x n tensors; {k!r} is {type(v).__name__}")
            out[k] = v.to(torch.float64)
        return out
    raise ValueError(
        f"select from CurvatureStatistics, a Posterior or a mapping name -> (m, n) variances; got {type(source).__name__}"
    )


def live_weights(source, rtol: float = LIVE_RTOL) -> dict[str, torch.Tensor]:
    """Boolean masks ``name -> (m, n)``: weights whose Fisher diagonal is **live**,
    ``diag_d > rtol * max_{d' in layer} diag_{d'}`` (strict, so exact zeros are never live,
    nor is any weight of a layer whose diagonal is all zero).

    Why a relative, per-layer threshold and not ``diag > 0``: ``diag = Σ_k d_k²`` is exactly
    0 for dead ReLU units, but smooth activations (GELU, SiLU in torchvision's ConvNeXt /
    EfficientNet) or float32 round-off leave tiny non-zero values whose marginal variance
    ``1 / (N diag/M + τ)`` equals the prior's ``1/τ`` to machine precision, i.e. the same
    pathology. The default ``rtol = 1e-12`` on the squared sums means gradients below
    ``1e-6`` of the layer's largest (≈ ten float32 round-off units). Per layer, because
    gradient scales differ by orders of magnitude between layers (a global maximum could
    declare a whole small-gradient layer dead), and round-off is relative to the layer's own
    scale. ``diag`` is invariant to ``N, τ``, so liveness does not depend on them.

    ``source``: :class:`CurvatureStatistics` (its ``diag`` sums) or a :class:`Posterior`
    whose layers are all diagonal (their ``fisher_diag = diag/M``); marginal-variance
    mappings carry no Fisher diagonal and are refused (one-line ``ValueError``).
    """
    rtol = float(rtol)
    if not (math.isfinite(rtol) and rtol >= 0):
        raise ValueError(f"rtol must be a finite number >= 0, got {rtol!r}")
    if isinstance(source, CurvatureStatistics):
        diags = {k: ls.diag for k, ls in source.layers.items()}
    elif isinstance(source, Posterior) and all(isinstance(lp, DiagLayer) for lp in source.layers.values()):
        diags = {k: lp.fisher_diag for k, lp in source.layers.items()}
    else:
        kind = f"a {source.method!r} posterior" if isinstance(source, Posterior) else type(source).__name__
        raise ValueError(f"live weights need the Fisher diagonal: pass CurvatureStatistics or a diag posterior, "
                         f"got {kind}")
    out = {}
    for k, d in diags.items():
        d = d.to(torch.float64)
        if not bool(torch.isfinite(d).all()) or bool((d < 0).any()):
            raise ValueError(f"layer {k!r}: Fisher diagonal has negative or NaN/inf entries")
        out[k] = d > rtol * d.max() if d.numel() else torch.zeros_like(d, dtype=torch.bool)
    return out


def select_subnetwork(
    source,
    S: int,
    rule: str = "wasserstein",
    prior_precision: float = 1.0,
    n_data: float | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Boolean masks ``name -> (m, n)`` selecting exactly ``S`` weights (see module docstring).

    ``rule="wasserstein"``: the ``S`` largest marginal variances (Daxberger eq. 23 with a
    diagonal posterior); ties go to the earlier position (model order, then vec order).
    ``rule="wasserstein_live"``: the same ranking among the live weights only
    (:func:`live_weights`, Fisher diagonal ``> LIVE_RTOL x`` its layer's largest), so dead
    units (variance ``1/τ``, no effect on the data's predictions) are not picked first.
    ``source`` must then be :class:`CurvatureStatistics` or a diag posterior. When fewer
    than ``S`` weights are live, all live ones are kept and the rest is **filled** by the
    plain rule among the non-live ones (largest variance, then position), with a one-line
    ``UserWarning`` giving the live and filled counts: ``S`` (and with it the prior
    ``τ S/D`` and the ``S x S`` memory) stays what was asked, and a long run does not
    fail after its curvature pass; the filled weights only add prior mass.
    ``rule="random"``: ``S`` positions uniformly without replacement from
    ``torch.Generator().manual_seed(seed)``. ``source``: see :func:`marginal_variances`.
    """
    if rule not in SELECTION_RULES:
        raise ValueError(f"unknown subnetwork selection rule {rule!r}; valid: {', '.join(SELECTION_RULES)}")
    var = marginal_variances(source, prior_precision, n_data)
    if not var:
        raise ValueError("no layers to select from")
    flat = torch.cat([vec(v).cpu() for v in var.values()])
    D = flat.numel()
    if isinstance(S, bool) or not isinstance(S, int) or not 1 <= S <= D:
        raise ValueError(f"S must be an int in [1, {D}] (weights in all curvature layers), got {S!r}")
    if rule in ("wasserstein", "wasserstein_live"):
        if not bool(torch.isfinite(flat).all()):
            raise ValueError("marginal variances contain NaN/inf")
        order = torch.sort(flat, descending=True, stable=True).indices
        if rule == "wasserstein_live":
            live = torch.cat([vec(mk).cpu() for mk in live_weights(source).values()])
            if live.numel() != D:
                raise ValueError(f"Fisher diagonal has {live.numel()} entries but the marginal variances {D}")
            alive = live[order]
            order = torch.cat([order[alive], order[~alive]])  # live first, each part by variance then position
            n_live = int(live.sum())
            if n_live < S:
                warnings.warn(f"wasserstein_live: only {n_live} of {D} weights have a live Fisher diagonal "
                              f"(> {LIVE_RTOL:g} x layer max); filled the other {S - n_live} of S = {S} by "
                              "the plain wasserstein rule", UserWarning, stacklevel=2)
        chosen = order[:S]
    else:
        g = torch.Generator().manual_seed(int(seed))
        chosen = torch.randperm(D, generator=g)[:S]
    keep = torch.zeros(D, dtype=torch.bool)
    keep[chosen] = True
    out, pos = {}, 0
    for k, v in var.items():
        m, n = v.shape
        out[k] = keep[pos:pos + m * n].reshape(n, m).T.contiguous().to(v.device)  # unvec
        pos += m * n
    return out


# =========================================================================== posterior
def build_subnet_posterior(
    fisher_sum: torch.Tensor,
    count: int,
    masks: Mapping[str, torch.Tensor],
    n_data: float | None = None,
    prior_precision: float = 1.0,
    *,
    scale_prior: bool = True,
    d_total: int | None = None,
    dtype: torch.dtype = torch.float64,
) -> SubnetPosterior:
    """:class:`SubnetPosterior` with ``P_S = N F_sum/count + τ' I``.

    ``masks`` must list **every** curvature layer in model order (as
    :func:`select_subnetwork` returns them), so ``D_total`` = their total size (or pass
    ``d_total``). ``scale_prior``: ``τ' = τ S / D_total`` (Daxberger et al.), else ``τ' = τ``.
    ``N`` defaults to ``count``.
    """
    if not isinstance(fisher_sum, torch.Tensor) or fisher_sum.dim() != 2 or fisher_sum.shape[0] != fisher_sum.shape[1]:
        raise ValueError(f"fisher_sum must be a square S x S tensor, got {getattr(fisher_sum, 'shape', type(fisher_sum))}")
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise ValueError(f"count must be a positive int (examples in the Fisher sum), got {count!r}")
    N, tau = check_hyper(count if n_data is None else n_data, prior_precision)
    layers, offset = {}, 0
    for k, mk in masks.items():
        if not isinstance(mk, torch.Tensor) or mk.dtype != torch.bool or mk.dim() != 2:
            raise ValueError(f"mask {k!r} must be a bool (m, n) tensor")
        idx = vec(mk).nonzero().flatten().to(torch.int64)
        layers[k] = SubnetLayerView(idx, tuple(mk.shape), offset)
        offset += idx.numel()
    S = offset
    if S != fisher_sum.shape[0]:
        raise ValueError(f"masks select S = {S} weights but fisher_sum is {tuple(fisher_sum.shape)}")
    D = int(sum(mk.numel() for mk in masks.values())) if d_total is None else int(d_total)
    if D < S:
        raise ValueError(f"d_total = {D} is smaller than S = {S}")
    scale = S / D if scale_prior else 1.0
    fisher = (fisher_sum.to(torch.float64) / count).to(dtype)
    return SubnetPosterior(
        method="subnet", layers=layers, n_data=N, prior_precision=tau, rank=None,
        info={"subnet_size": S, "d_total": D, "prior_scale": scale}, fisher=fisher, prior_scale=scale,
    )


def subnet_laplace(
    model: nn.Module,
    batches,
    stats: CurvatureStatistics,
    S: int,
    *,
    rule: str = "wasserstein",
    fisher: str = "mc",
    mc_samples: int = 1,
    generator: torch.Generator | None = None,
    n_data: float | None = None,
    prior_precision: float = 1.0,
    seed: int = 0,
    likelihood: str = "classification",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    dtype: torch.dtype = torch.float64,
) -> SubnetPosterior:
    """One process, all three steps: select ``S`` weights from ``stats`` (diagonal Laplace with
    ``(n_data, prior_precision)``), one pass of :func:`collect_subnet_fisher` over ``batches``
    (re-iterable if it was also used for ``stats``), then :func:`build_subnet_posterior` with
    the prior ``τ S / D_total`` and ``N`` = ``n_data`` (default: the Fisher's count).
    Distributed runs call the three functions separately and sum ``(F_sum, count)`` over shards."""
    masks = select_subnetwork(stats, S, rule=rule, prior_precision=prior_precision, n_data=n_data, seed=seed)
    check_subnet_memory(S, memory_budget, dtype)
    F, count = collect_subnet_fisher(model, batches, masks, fisher=fisher, mc_samples=mc_samples,
                                     generator=generator, dtype=dtype, likelihood=likelihood,
                                     memory_budget=memory_budget)
    return build_subnet_posterior(F, count, masks, n_data, prior_precision, dtype=dtype)
