"""The verdict a report opens with: per headline metric the best method and its change
against MAP, in one table with the best value marked, and a few sentences generated from
the numbers (is the model calibrated, does a cheap fix already do it, what the posterior
costs).

Input: the run summary's ``results`` (``{method: headline}``, as ``run.json`` stores them:
``accuracy``, ``nll``, ``ece``, ``brier``, ``ood_auroc``, and under a shift sweep
``shift_accuracy``, ``shift_nll``, ``shift_ece``: means over corruptions and severities) and
its ``posterior_sizes`` (numbers stored per method).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from pipelines.report.methods import method_label, order_methods

__all__ = ["METRICS", "Metric", "summary_table", "verdict_sentences"]

MAP, TEMPERATURE = "map", "temperature"


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    higher_is_better: bool
    percent: bool = False  # shown as a percentage
    digits: int = 3

    def fmt(self, v: float) -> str:
        return f"{100 * v:.1f}%" if self.percent else f"{v:.{self.digits}f}"

    def delta(self, v: float, ref: float) -> str:
        d = v - ref
        return f"{100 * d:+.1f} pts" if self.percent else f"{d:+.{self.digits}f}"


#: The headline metrics, in the order the summary shows them.
METRICS: tuple[Metric, ...] = (
    Metric("accuracy", "Accuracy", True, percent=True),
    Metric("nll", "NLL", False),
    Metric("ece", "ECE", False, percent=True),
    Metric("brier", "Brier", False, digits=4),
    Metric("ood_auroc", "OOD AUROC", True),
    Metric("shift_accuracy", "Accuracy under shift (mean)", True, percent=True),
    Metric("shift_nll", "NLL under shift (mean)", False),
    Metric("shift_ece", "ECE under shift (mean)", False, percent=True),
)


def _value(results: Mapping[str, Any], method: str, key: str) -> float | None:
    r = results.get(method)
    if not isinstance(r, Mapping) or r.get("status", "ok") != "ok":
        return None
    v = r.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _best(results: Mapping[str, Any], methods: list[str], m: Metric, exclude=()) -> tuple[str, float] | None:
    vals = [(meth, v) for meth in methods if meth not in exclude and (v := _value(results, meth, m.key)) is not None]
    if not vals:
        return None
    return (max if m.higher_is_better else min)(vals, key=lambda x: x[1])


def summary_table(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]], list[tuple[int, int]], list[str]]:
    """``(header, rows, marked cells (row, column), row keys)``: one row per headline metric that
    some method has, one column per method (MAP first), then the best method and its change
    against MAP. The best value of each row is marked."""
    methods = order_methods(k for k, r in results.items() if isinstance(r, Mapping))
    header = ["Metric", *(method_label(m) for m in methods), "Best", "Change vs MAP"]
    rows, marked, keys = [], [], []
    for m in METRICS:
        if all(_value(results, meth, m.key) is None for meth in methods):
            continue
        best = _best(results, methods, m)
        ref = _value(results, MAP, m.key)
        cells = [m.label]
        for j, meth in enumerate(methods):
            v = _value(results, meth, m.key)
            cells.append("—" if v is None else m.fmt(v))
            if best is not None and meth == best[0]:
                marked.append((len(rows), j + 1))
        cells.append(method_label(best[0]) if best else "—")
        cells.append("—" if best is None or ref is None else m.delta(best[1], ref))
        rows.append(cells)
        keys.append(m.key)
    return header, rows, marked, keys


def _numbers(sizes: Mapping[str, Any], method: str) -> float | None:
    s = sizes.get(method) if isinstance(sizes, Mapping) else None
    n = s.get("numbers") if isinstance(s, Mapping) else None
    return float(n) if isinstance(n, (int, float)) and n > 0 else None


def verdict_sentences(results: Mapping[str, Any], sizes: Mapping[str, Any] | None = None) -> list[str]:
    """Two to four sentences from the numbers: what the best posterior does to ECE (and at what
    size against the diagonal), what temperature scaling alone reaches, NLL, OOD and shift."""
    sizes = sizes or {}
    methods = order_methods(k for k, r in results.items() if isinstance(r, Mapping))
    laplace = [m for m in methods if m not in (MAP, TEMPERATURE)]
    out = []
    by_key = {m.key: m for m in METRICS}
    ece = by_key["ece"]
    map_ece, best = _value(results, MAP, "ece"), _best(results, laplace, ece)
    if best is not None and map_ece is not None:
        if best[1] < map_ece:
            s = f"{method_label(best[0])} lowers ECE from {ece.fmt(map_ece)} (MAP) to {ece.fmt(best[1])}"
        else:
            s = (f"No posterior lowers ECE below MAP's {ece.fmt(map_ece)}; the closest, "
                 f"{method_label(best[0])}, reaches {ece.fmt(best[1])}")
        nb, nd = _numbers(sizes, best[0]), _numbers(sizes, "diag")
        if nb is not None and nd is not None and best[0] != "diag":
            s += f" at {nb / nd:.2f}x the diagonal's size"
        t = _value(results, TEMPERATURE, "ece")
        s += f"; temperature scaling alone reaches {ece.fmt(t)}." if t is not None else "."
        out.append(s)
    for key in ("nll", "ood_auroc", "shift_ece"):
        m = by_key[key]
        ref, b = _value(results, MAP, key), _best(results, [x for x in methods if x != MAP], m)
        if b is None or ref is None:
            continue
        better = b[1] > ref if m.higher_is_better else b[1] < ref
        if better:
            out.append(f"Best {m.label}: {method_label(b[0])}, {m.fmt(b[1])} against MAP's {m.fmt(ref)}.")
        else:
            out.append(f"No method improves on MAP's {m.label} ({m.fmt(ref)}).")
    return out
