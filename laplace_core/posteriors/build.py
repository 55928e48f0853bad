"""Build a Laplace posterior from curvature statistics (docs/design.md §1, §3).

``P = N F/M + τ I`` per layer, with ``F`` one of the registered structures:

=============  ===============================================================  =====================
method         per-layer precision                                              needs
=============  ===============================================================  =====================
``diag``       ``N diag/M + τ``                                                 stats
``kfac``       ``(√N A/M + √τ I) ⊗ (√N G/M + √τ I)`` (Ritter et al. eq. 9)      eigenbasis
``kfac_exact`` ``(U_A ⊗ U_G) diag(N S_G S_A^T + τ) (U_A ⊗ U_G)^T`` (Lee F.3.2)  eigenbasis
``efb``        ``(U_A ⊗ U_G) diag(N Λ/M + τ) (U_A ⊗ U_G)^T`` (George et al.)    eigenbasis + EFB pass
``inf``        low rank ``(U_a ⊗ U_g) N Λ_L/M (..)^T`` + ``diag(N D + τ)``       eigenbasis + EFB pass
=============  ===============================================================  =====================

Normalisation layers (kind ``"norm"``, collected with ``norm_layers="diag"``; see
:mod:`laplace_core.curvature.layers`) carry only the exact Fisher diagonal: their block is always
``diag`` (``P = N diag/M + τ``), whatever the method of the other layers, so every
method's posterior then has a diagonal part for them.

Hyperparameter searches rebuild the same posterior under new ``(N, τ)`` with
:func:`with_hyper`, which reuses the stored normalised pieces (``Λ/M``, ``D``,
eigenvectors) and never redoes an eigendecomposition of a Kronecker factor.
"""
from __future__ import annotations

import dataclasses
import numbers
from enum import Enum
from typing import Mapping

import torch

from ..basis.eigenbasis import Eigenbasis, LayerBasis, eigenbasis
from .layer_builders import BUILDERS, Builder, LayerInput
from .methods import REGISTRY, layer_methods, method_info, posterior_methods
from ..curvature.statistics import CurvatureStatistics, LayerStatistics
from .structures.base import LayerPosterior, Posterior
from .structures.diag import check_hyper
from .structures.inf import MAX_L

__all__ = ["Method", "METHODS", "WHOLE_METHODS", "ALL_METHODS", "build_posterior", "with_hyper", "resolve_method",
           "inf_clipping_info"]


#: ``Method.DIAG == "diag"``, ... for every per-layer method of the registry.
Method = Enum("Method", {n.upper(): n for n in layer_methods()}, type=str)


METHODS: dict[str, Builder] = {n: BUILDERS[m.builder] for n, m in REGISTRY.items() if m.per_layer}
# Whole-network structures (covariance couples layers), built from extra inputs rather than
# per layer from ``stats``: "subnet" (Daxberger et al. 2021) needs
# ``subnet_fisher=(F_sum, count, masks)`` from laplace_core.curvature.subnet_fisher.collect_subnet_fisher.
WHOLE_METHODS: tuple[str, ...] = tuple(n for n, m in REGISTRY.items() if m.posterior and not m.per_layer)
#: Every method with a posterior (the registry's ``temperature`` has none: nothing to build).
ALL_METHODS: tuple[str, ...] = posterior_methods()


def resolve_method(method: str | Method) -> str:
    """Registry name of a posterior ``method``; ``ValueError`` listing the valid ones (a
    registry method without a posterior, ``temperature``, is refused too)."""
    name = method.value if isinstance(method, Method) else str(method)
    if name not in METHODS and name not in WHOLE_METHODS:
        raise ValueError(f"unknown posterior method {method!r}; valid: {', '.join(ALL_METHODS)}")
    return name


def _check_rank(name: str, rank) -> None:
    if rank is None:
        return
    if name != "inf":
        raise ValueError(f"rank= applies only to method 'inf', not {name!r}")
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 1:
        raise ValueError(f"rank must be a positive int (top-K eigenvalues per layer) or None, got {rank!r}")


def _check_basis(basis: Eigenbasis, stats: CurvatureStatistics) -> None:
    for k, info in stats.infos.items():
        if info.diag_only:
            continue
        if k not in basis:
            raise ValueError(f"eigenbasis has no entry for layer {k!r}")
        b = basis[k]
        m, n = info.shape
        if tuple(b.U_G.shape) != (m, m) or tuple(b.U_A.shape) != (n, n):
            raise ValueError(
                f"layer {k!r}: eigenbasis shapes U_G {tuple(b.U_G.shape)}, U_A {tuple(b.U_A.shape)} "
                f"do not match W~ of shape {(m, n)}"
            )


def build_posterior(
    stats: CurvatureStatistics,
    method: str | Method,
    rank: int | None = None,
    n_data: float | None = None,
    prior_precision: float = 1.0,
    basis: Eigenbasis | Mapping[str, LayerBasis] | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    max_l: int = MAX_L,
    subnet_fisher: "tuple[torch.Tensor, int, Mapping[str, torch.Tensor]] | None" = None,
) -> Posterior:
    """Laplace posterior ``P = N F/M + τ I`` for every layer of ``stats``.

    ``n_data`` = ``N`` (default ``stats.count`` = ``M``), ``prior_precision`` = ``τ >= 0``
    (``τ = 0`` only where the precision stays positive definite). ``basis`` defaults to
    ``eigenbasis(stats)``; for ``efb``/``inf`` it must be the basis the EFB pass used
    (recomputing it from the same ``stats`` reproduces it). ``rank`` (``inf`` only) is
    the top-``K`` count of Algorithm 1 per layer (``K >= m n`` keeps the full layer);
    ``None`` is full rank, refused when ``m n > max_l``. Everything is computed in
    float64 and stored as ``dtype``.

    ``info`` holds ``clipped_D`` (INF entries where ``N D + τ`` was raised to its floor at
    this ``(N, τ)``; see :func:`inf_clipping_info`), ``clamped_eigenvalues`` (negative factor
    eigenvalues clamped by the eigenbasis) and, for ``inf``, ``kept`` (``L`` per layer).

    ``method="subnet"`` (Daxberger et al. 2021) needs ``subnet_fisher=(F_sum, count, masks)``
    from :func:`laplace_core.curvature.subnet_fisher.collect_subnet_fisher` / ``select_subnetwork`` and
    builds :func:`laplace_core.posteriors.subnet.build_subnet_posterior` (prior ``τ S / D_total``,
    ``N`` default ``count``; ``stats`` may be None, else its layers must match the masks).
    """
    name = resolve_method(method)
    if name == "subnet":
        return _build_subnet(stats, subnet_fisher, rank, n_data, prior_precision, dtype)
    if subnet_fisher is not None:
        raise ValueError(f"subnet_fisher= applies only to method 'subnet', not {name!r}")
    _check_rank(name, rank)
    if not isinstance(stats, CurvatureStatistics):
        raise ValueError(f"stats must be CurvatureStatistics, got {type(stats).__name__}")
    if stats.count <= 0:
        raise ValueError("cannot build a posterior from statistics of zero examples (count = 0)")
    N, tau = check_hyper(stats.count if n_data is None else n_data, prior_precision)
    if method_info(name).needs_efb and not stats.has_efb:
        raise ValueError(
            f"method {name!r} needs EFB eigenvalues: run a second pass "
            "collect_statistics(..., basis=eigenbasis(stats)) and build from its result"
        )
    stats64 = stats.to(torch.float64)
    if method_info(name).needs_basis:
        if basis is None:
            basis = eigenbasis(stats64)
        _check_basis(basis, stats)

    layers: dict[str, LayerPosterior] = {}
    clipped: dict[str, int] = {}
    for k, ls in stats64.layers.items():
        diag_only = stats.infos[k].diag_only  # normalisation layer: a diagonal block for every method
        lname = "diag" if diag_only else name
        x = _layer_input(ls, stats64, basis[k] if method_info(lname).needs_basis else None, lname, dtype)
        try:
            layers[k], clipped[k] = METHODS[lname](x, N, tau, rank, max_l)
        except ValueError as e:
            raise ValueError(f"layer {k!r}: {e}") from None

    info: dict = {
        "clipped_D": int(sum(clipped.values())),
        "clamped_eigenvalues": _clamped(basis) if method_info(name).needs_basis else 0,
    }
    norm = [k for k, i in stats.infos.items() if i.diag_only]
    if norm:
        info["diag_norm_layers"] = len(norm)
    if name == "inf":
        info.update(inf_clipping_info(layers))
        info["kept"] = {k: int(lp.rank) for k, lp in layers.items() if hasattr(lp, "rank")}
    return Posterior(method=name, layers=layers, n_data=N, prior_precision=tau,
                     rank=None if rank is None else int(rank), info=info)


def inf_clipping_info(layers: Mapping[str, LayerPosterior]) -> dict:
    """INF's clipping at the layers' ``(N, τ)``: ``clipped_D`` (entries where ``N D + τ`` was
    raised to ``DP_FLOOR τ``), ``clipped_D_per_layer``, ``clipped_D_fraction`` (of all ``D``
    entries) and ``diag_rel_error`` (``||diag(F_INF) − diag/M||_F / ||diag/M||_F`` over all
    layers; 0 where nothing was clipped: Lemma 2's exact diagonal)."""
    inf = {k: lp for k, lp in layers.items() if hasattr(lp, "clipped_D")}  # not norm layers' Diag blocks
    per = {k: int(lp.clipped_D) for k, lp in inf.items()}
    total = sum(lp.shape[0] * lp.shape[1] for lp in inf.values())
    norm = sum(float(getattr(lp, "diag_sq_norm", 0.0)) for lp in layers.values())
    err = sum(float(getattr(lp, "diag_sq_error", 0.0)) for lp in layers.values())
    return {
        "clipped_D": int(sum(per.values())),
        "clipped_D_per_layer": per,
        "clipped_D_fraction": sum(per.values()) / total if total else 0.0,
        "diag_rel_error": (err / norm) ** 0.5 if norm > 0 else 0.0,
    }


def _build_subnet(stats, subnet_fisher, rank, n_data, prior_precision, dtype) -> Posterior:
    from .subnet import build_subnet_posterior

    if rank is not None:
        raise ValueError("rank= applies only to method 'inf', not 'subnet' (the subnetwork size is set by the masks)")
    if subnet_fisher is None or not isinstance(subnet_fisher, (tuple, list)) or len(subnet_fisher) != 3:
        raise ValueError(
            "method 'subnet' needs subnet_fisher=(F_sum, count, masks): masks from "
            "laplace_core.posteriors.subnet.select_subnetwork, (F_sum, count) from collect_subnet_fisher"
        )
    F_sum, count, masks = subnet_fisher
    if stats is not None:
        if not isinstance(stats, CurvatureStatistics):
            raise ValueError(f"stats must be CurvatureStatistics or None, got {type(stats).__name__}")
        if list(stats.infos) != list(masks):
            raise ValueError(f"subnet masks cover layers {list(masks)}, statistics have {list(stats.infos)}")
        for k, info in stats.infos.items():
            if tuple(masks[k].shape) != tuple(info.shape):
                raise ValueError(f"layer {k!r}: mask shape {tuple(masks[k].shape)} != W~ shape {info.shape}")
    return build_subnet_posterior(F_sum, count, masks, n_data, prior_precision, dtype=dtype)


def _clamped(basis) -> int:
    """Negative factor eigenvalues clamped by the eigenbasis (Eigenbasis or name -> LayerBasis)."""
    if isinstance(basis, Eigenbasis):
        return int(basis.total_clamped())
    return int(sum(int(getattr(b, "clamped", 0)) for b in basis.values()))


def _layer_input(ls: LayerStatistics, stats: CurvatureStatistics, b: LayerBasis | None, name: str,
                 dtype: torch.dtype) -> LayerInput:
    fisher_diag = ls.diag / stats.count
    lam = ls.efb / stats.efb_count if method_info(name).needs_efb else None
    if b is not None:
        b = b.to(dtype=torch.float64, device=ls.diag.device)
        if dtype != torch.float64:
            b = b.to(dtype=dtype)
    return LayerInput(
        fisher_diag=fisher_diag.to(dtype),
        basis=b,
        lam=None if lam is None else lam.to(dtype),
    )


def with_hyper(posterior: Posterior, n_data: float, prior_precision: float) -> Posterior:
    """The same posterior structure under new ``(N, τ)``.

    Reuses every stored normalised piece (``diag/M``, eigenvectors, ``Λ/M``, ``D``);
    only INF redoes its ``L x L`` eigendecomposition (it depends on ``N D + τ``).
    Cost per call: ``O(mn)`` for diag/efb/kfac_exact, ``O(m + n)`` for kfac,
    ``O(L³ + ...)`` for inf.
    """
    N, tau = check_hyper(n_data, prior_precision)
    if posterior.method in WHOLE_METHODS:  # e.g. SubnetPosterior: one S x S Cholesky
        return posterior.with_hyper(N, tau)
    layers = {}
    for k, lp in posterior.layers.items():
        if not hasattr(lp, "with_hyper"):
            raise ValueError(f"layer {k!r}: structure {lp.method!r} does not support with_hyper; rebuild it")
        try:
            layers[k] = lp.with_hyper(N, tau)
        except ValueError as e:
            raise ValueError(f"layer {k!r}: {e}") from None
    info = dict(posterior.info)
    if posterior.method == Method.INF.value:  # the clipped entries of N D + τ depend on (N, τ)
        info.update(inf_clipping_info(layers))
    return dataclasses.replace(posterior, layers=layers, n_data=N, prior_precision=tau, info=info)
