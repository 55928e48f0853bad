"""The method facts the report shows (order, labels, colours, the "Corr" column), read from
the one method registry, :mod:`laplace_core.posteriors.methods`; the report reads them only from here."""
from __future__ import annotations

from laplace_core.posteriors import methods as registry
from laplace_core.posteriors.methods import MAP, order_methods

__all__ = ["METHOD_ORDER", "CORRELATIONS", "order_methods", "method_label", "method_color"]

#: Shown in this order; other names after them, alphabetically. ``"map"`` is the deterministic baseline.
METHOD_ORDER: tuple[str, ...] = (MAP, *registry.method_names())
#: Whether a posterior models weight correlations (Lee et al. Table 3, "Corr"); None = no posterior.
CORRELATIONS: dict[str, bool | None] = {MAP: None, **{n: m.correlations for n, m in registry.REGISTRY.items()}}
_EXTRA_COLORS = ("#17becf", "#bcbd22", "#e377c2", "#7f7f7f")


def method_label(name: str) -> str:
    return registry.method_label(name)


def method_color(name: str, i: int) -> str:
    """The method's colour in every figure; an unknown method (the ``i``-th shown) gets one of a few extras."""
    return registry.method_color(name) or _EXTRA_COLORS[i % len(_EXTRA_COLORS)]
