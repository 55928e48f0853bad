"""The method registry: every posterior method's name written once, with what it needs.

One :class:`MethodInfo` per method, read by everything that must know about methods:
:func:`laplace_core.posteriors.build.build_posterior` (the builder, whether an eigenbasis and the
EFB pass are needed), :mod:`laplace_core.posteriors.sizes` (which methods Lee et al.'s Table 3 counts
from the layer shapes), the run configuration's validation and the curvature passes in
``pipelines`` (which passes a method list requires), and the report (labels, colours,
whether a method models weight correlations, the "Corr" column of Table 3).

Not every row is a Laplace posterior: ``temperature`` (Guo et al. 2017, temperature scaling:
``softmax(f(x; θ*)/T)`` with one scalar ``T`` fitted by NLL on the search split) has
``posterior=False``: no curvature pass, no posterior artifact, one number stored.
:func:`posterior_methods` lists the methods that have a posterior.

Per-layer builders (:mod:`.layer_builders`, named by ``MethodInfo.builder``) take the normalised
pieces of one layer and ``(N, τ, rank, max_l)`` and return its layer posterior. Whole-network
methods (``subnet``, whose covariance couples layers) have no per-layer builder:
``build_posterior`` dispatches them. This module imports no torch: a run configuration is
checked against the registry without it.
"""
from __future__ import annotations

import dataclasses

__all__ = ["MethodInfo", "REGISTRY", "MAP", "method_info", "method_names", "layer_methods",
           "needs_basis", "needs_efb", "table3_methods", "posterior_methods", "TEMPERATURE", "method_label", "method_color", "order_methods"]

#: The row of the un-perturbed network in evaluations and reports (no posterior).
MAP = "map"
#: Temperature scaling (Guo et al. 2017): a calibration baseline without a posterior.
TEMPERATURE = "temperature"


@dataclasses.dataclass(frozen=True)
class MethodInfo:
    """One posterior method.

    name: the registry name (config, artifacts, saved posteriors). label / color: in tables
    and figures. builder: the name of the per-layer builder in :mod:`.layer_builders` (None: a
    whole-network method). needs_basis: the eigendecomposition of ``A`` and ``G``. needs_efb:
    the second pass (per-example gradients in the eigenbasis, ``Λ``). correlations: whether the posterior models weight
    correlations (Lee et al. Table 3, "Corr"). table3: whether its numbers stored follow from
    the layer shapes alone (Table 3's columns; INF's depend on the kept ``L``). reference:
    the paper it comes from. posterior: whether the method is a posterior (built by the
    posterior stage, saved as an artifact); ``False`` for a post-hoc calibration of the MAP
    network (temperature scaling), which stores ``num_stored`` numbers of its own.
    """

    name: str
    label: str
    color: str
    builder: str | None
    needs_basis: bool
    needs_efb: bool
    correlations: bool
    table3: bool
    reference: str
    posterior: bool = True
    num_stored: int | None = None

    @property
    def per_layer(self) -> bool:
        return self.builder is not None


REGISTRY: dict[str, MethodInfo] = {m.name: m for m in (
    MethodInfo("diag", "Diag", "#1f77b4", "build_diag", False, False, False, True, "MacKay 1992; Ritter et al. 2018"),
    MethodInfo("kfac", "KFAC", "#ff7f0e", "build_kfac", True, False, True, True, "Ritter et al. 2018, eq. 9"),
    MethodInfo("kfac_exact", "KFAC (exact)", "#8c564b", "build_kfac_exact", True, False, True, True,
               "Lee et al. 2020, F.3.2"),
    MethodInfo("efb", "EFB", "#2ca02c", "build_efb", True, True, True, True, "George et al. 2018"),
    MethodInfo("inf", "INF", "#d62728", "build_inf", True, True, True, False, "Lee et al. 2020"),
    MethodInfo("subnet", "Subnet", "#9467bd", None, False, False, True, False, "Daxberger et al. 2021"),
    MethodInfo(TEMPERATURE, "Temperature", "#17becf", None, False, False, False, False, "Guo et al. 2017",
               posterior=False, num_stored=1),
)}

_MAP_LABEL, _MAP_COLOR = "MAP", "#444444"


def method_info(name: str) -> MethodInfo:
    """The registry entry for ``name``; ``ValueError`` listing the valid names otherwise."""
    try:
        return REGISTRY[str(name)]
    except KeyError:
        raise ValueError(f"unknown posterior method {name!r}; valid: {', '.join(REGISTRY)}") from None


def method_names() -> tuple[str, ...]:
    """Every method, in registry (and report) order."""
    return tuple(REGISTRY)


def layer_methods() -> tuple[str, ...]:
    """Methods built layer by layer from the curvature statistics."""
    return tuple(n for n, m in REGISTRY.items() if m.per_layer)


def posterior_methods() -> tuple[str, ...]:
    """Methods with a Laplace posterior (every one but post-hoc calibrations such as ``temperature``)."""
    return tuple(n for n, m in REGISTRY.items() if m.posterior)


def table3_methods() -> tuple[str, ...]:
    """Methods whose numbers stored follow from the layer shapes (Table 3's shape columns)."""
    return tuple(n for n, m in REGISTRY.items() if m.table3)


def needs_basis(methods) -> bool:
    """Whether any of ``methods`` needs the eigenbasis of the Kronecker factors."""
    return any(method_info(m).needs_basis for m in methods)


def needs_efb(methods) -> bool:
    """Whether any of ``methods`` needs the EFB pass (``Λ`` in the eigenbasis)."""
    return any(method_info(m).needs_efb for m in methods)


def method_label(name: str) -> str:
    """Display label (``"MAP"`` for the MAP row; unknown names as given)."""
    if name == MAP:
        return _MAP_LABEL
    m = REGISTRY.get(name)
    return m.label if m is not None else str(name)


def method_color(name: str) -> str | None:
    """Figure colour of a method (None for names outside the registry)."""
    if name == MAP:
        return _MAP_COLOR
    m = REGISTRY.get(name)
    return m.color if m is not None else None


def order_methods(names) -> list[str]:
    """``names`` (duplicates dropped) in report order: MAP, temperature scaling (the baseline
    every Laplace row is read against), the registry's order, then any others alphabetically."""
    names = list(dict.fromkeys(names))
    order = (MAP, TEMPERATURE, *(n for n in REGISTRY if n != TEMPERATURE))
    known = [n for n in order if n in names]
    return known + sorted(n for n in names if n not in order)
