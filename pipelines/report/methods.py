"""The method names as the report shows them: order, labels, colours, the "Corr" column.

One small table on purpose: the report reads method facts only from here, so pointing these
names at a method registry later changes this file and nothing else in :mod:`pipelines.report`.
"""
from __future__ import annotations

from typing import Iterable

__all__ = ["METHOD_ORDER", "METHOD_LABELS", "CORRELATIONS", "order_methods", "method_label", "method_color"]

#: Shown in this order; other names after them, alphabetically. ``"map"`` is the deterministic baseline.
METHOD_ORDER: tuple[str, ...] = ("map", "diag", "kfac", "kfac_exact", "efb", "inf", "subnet")
METHOD_LABELS: dict[str, str] = {
    "map": "MAP", "diag": "Diag", "kfac": "KFAC", "kfac_exact": "KFAC (exact)",
    "efb": "EFB", "inf": "INF", "subnet": "Subnet",
}
#: Whether a posterior models weight correlations (Lee et al. Table 3, "Corr"); None = no posterior.
CORRELATIONS: dict[str, bool | None] = {
    "map": None, "diag": False, "kfac": True, "kfac_exact": True, "efb": True, "inf": True, "subnet": True,
}
_METHOD_COLORS = {
    "map": "#444444", "diag": "#1f77b4", "kfac": "#ff7f0e", "kfac_exact": "#8c564b",
    "efb": "#2ca02c", "inf": "#d62728", "subnet": "#9467bd",
}
_EXTRA_COLORS = ("#17becf", "#bcbd22", "#e377c2", "#7f7f7f")


def order_methods(names: Iterable[str]) -> list[str]:
    """Known methods in :data:`METHOD_ORDER`, then the others alphabetically."""
    names = list(dict.fromkeys(names))
    known = [m for m in METHOD_ORDER if m in names]
    return known + sorted(m for m in names if m not in METHOD_ORDER)


def method_label(name: str) -> str:
    return METHOD_LABELS.get(name, str(name))


def method_color(name: str, i: int) -> str:
    """The method's colour in every figure; an unknown method (the ``i``-th shown) gets one of a few extras."""
    if name in _METHOD_COLORS:
        return _METHOD_COLORS[name]
    return _EXTRA_COLORS[i % len(_EXTRA_COLORS)]
