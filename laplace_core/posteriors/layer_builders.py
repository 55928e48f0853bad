"""The per-layer posterior builders of the method registry (:mod:`.methods`).

Each takes the normalised pieces of one layer (:class:`LayerInput`: ``diag/M``, the
eigenbasis of ``A``/``G``, ``Λ/M`` from the EFB pass) and ``(N, τ, rank, max_l)`` and returns
the layer posterior of ``P = N F/M + τ I`` (docs/design.md §1) with the count of INF diagonal
entries raised to their floor; each structure's identity is in its own module
(:mod:`.structures.diag`, ``kron``, ``efb``, ``inf``). A registry entry names its builder
(``MethodInfo.builder``); :data:`BUILDERS` maps the names to the functions. Kept apart from the
registry so that the registry, and a run configuration checked against it, import no torch.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..basis.eigenbasis import LayerBasis
from .sparsify import sparsify
from .structures.base import LayerPosterior
from .structures.diag import DiagLayer
from .structures.efb import EFBLayer, KronExactLayer
from .structures.inf import InfLayer
from .structures.kron import KronLayer

__all__ = ["LayerInput", "Builder", "BUILDERS", "build_diag", "build_kfac", "build_kfac_exact", "build_efb",
           "build_inf"]


@dataclasses.dataclass(frozen=True)
class LayerInput:
    """Normalised pieces for one layer: ``diag/M``, ``A``/``G`` eigenbasis, ``Λ/M`` (or None)."""

    fisher_diag: torch.Tensor
    basis: LayerBasis | None
    lam: torch.Tensor | None


# builder(inputs, N, τ, rank, max_l) -> (layer, clipped D count)
Builder = Callable[[LayerInput, float, float, "int | None", int], "tuple[LayerPosterior, int]"]


def build_diag(x: LayerInput, N, tau, rank, max_l):
    return DiagLayer(x.fisher_diag, N, tau), 0


def build_kfac(x: LayerInput, N, tau, rank, max_l):
    b = x.basis
    return KronLayer(b.U_A, b.S_A, b.U_G, b.S_G, N, tau), 0


def build_kfac_exact(x: LayerInput, N, tau, rank, max_l):
    b = x.basis
    return KronExactLayer.from_factors(b.U_A, b.S_A, b.U_G, b.S_G, N, tau), 0


def build_efb(x: LayerInput, N, tau, rank, max_l):
    return EFBLayer(x.basis.U_A, x.basis.U_G, x.lam, N, tau), 0


def build_inf(x: LayerInput, N, tau, rank, max_l):
    m, n = x.lam.shape
    if rank is None:
        if m * n > max_l:
            raise ValueError(
                f"full-rank INF keeps all {m}*{n} = {m * n} eigenvalues, above max_l={max_l}; pass rank= (top-K)"
            )
        dev = x.lam.device
        rows, cols = torch.arange(m, device=dev), torch.arange(n, device=dev)
    else:
        rows, cols = sparsify(x.lam, min(int(rank), m * n))
    layer = InfLayer.from_eigen(x.fisher_diag, x.basis.U_G, x.basis.U_A, x.lam, rows, cols, N, tau, max_l=max_l)
    return layer, layer.clipped_D


#: ``MethodInfo.builder`` -> the function
BUILDERS: dict[str, Builder] = {f.__name__: f for f in (build_diag, build_kfac, build_kfac_exact, build_efb, build_inf)}
