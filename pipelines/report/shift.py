"""The distribution-shift sweep in the report: ``eval/<method>/shift.json`` read back, its
mean over corruptions per severity drawn as one line per method (accuracy, NLL, ECE against
severity, as uncertainty-baselines reports ImageNet-C), and the means kept as headline numbers.

``shift.json`` (:mod:`pipelines.evaluation.shift`) holds ``metrics[corruption][severity]`` and
``mean[severity]`` with ``accuracy``, ``nll``, ``ece``, ``brier`` (severities as JSON strings).
"""
from __future__ import annotations

import io
from typing import Any, Mapping

from pipelines.report.methods import method_color, method_label, order_methods
from pipelines.storage.store import RunStore
from pipelines.storage import uris as storage

__all__ = ["SHIFT_METRICS", "load_shift", "shift_headline", "render_shift", "shift_summary_section", "SUMMARY_NOTE"]

#: What the family table says under it (pipelines.evaluation.shift_summary computes it).
SUMMARY_NOTE = ("ImageNet-C's families (noise, blur, weather, digital) and all of its corruptions the sweep ran: "
                "means over corruptions and severities. CE vs MAP: the method's corruption error over MAP's, "
                "averaged over the corruptions (below 1: fewer errors than MAP). mCE (AlexNet): ImageNet-C's mCE, "
                "normalised by AlexNet's published errors, given only for a complete 15 x 5 sweep of a 1,000-class "
                "model, and comparable with published tables only when the test split is ImageNet-1K's validation "
                "set decoded as here. 'partial': not every corruption of the family at every severity 1-5.")

#: (key, axis label) of the panels, in order
SHIFT_METRICS = (("accuracy", "accuracy"), ("nll", "NLL"), ("ece", "ECE"))


def load_shift(store: RunStore, methods) -> dict[str, dict]:
    """``{method: shift.json}`` of the run's store, for the methods that have one."""
    out = {}
    for m in methods:
        uri = storage.join(store.eval_uri(m), "shift.json")
        if store.exists(uri):
            out[m] = store.read_json(uri)
    return {m: out[m] for m in order_methods(out)}


def _curve(doc: Mapping[str, Any], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for sev, vals in sorted((doc.get("mean") or {}).items(), key=lambda kv: int(kv[0])):
        v = (vals or {}).get(key)
        if isinstance(v, (int, float)):
            xs.append(int(sev))
            ys.append(float(v))
    return xs, ys


def shift_headline(doc: Mapping[str, Any]) -> dict[str, float]:
    """``shift_accuracy``, ``shift_nll``, ``shift_ece``: the mean over corruptions and severities
    (only when every severity has its mean)."""
    out = {}
    sevs = list((doc.get("mean") or {}))
    for key, _ in SHIFT_METRICS:
        xs, ys = _curve(doc, key)
        if ys and len(xs) == len(sevs):
            out[f"shift_{key}"] = sum(ys) / len(ys)
    return out


def render_shift(shift_by_method: Mapping[str, Mapping[str, Any]]) -> bytes:
    """PNG: the mean over corruptions of accuracy, NLL and ECE against severity, a line per method."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11.0, 3.4))
    axes = fig.subplots(1, len(SHIFT_METRICS))
    names = ", ".join(next(iter(shift_by_method.values()), {}).get("corruptions") or [])
    fig.suptitle(f"Under distribution shift (mean over: {names})", fontsize=11)
    for ax, (key, label) in zip(axes, SHIFT_METRICS):
        for i, (m, doc) in enumerate(shift_by_method.items()):
            xs, ys = _curve(doc, key)
            if xs:
                ax.plot(xs, ys, marker="o", ms=3.5, lw=1.4, color=method_color(m, i), label=method_label(m))
        ax.set_xlabel("severity", fontsize=9)
        ax.set_ylabel(label, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, frameon=False)
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.16, top=0.85, wspace=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def shift_summary_section(shift_by_method: Mapping[str, Mapping[str, Any]]):
    """The report's section of the per-family shift summaries (``shift.json``'s ``summary``): one row
    per family and method; None when no method has a summary."""
    from pipelines.report.page import Section, Table

    rows, keys = [], []
    methods = [m for m in order_methods(shift_by_method) if isinstance(shift_by_method[m].get("summary"), Mapping)]
    families = list(dict.fromkeys(f for m in methods for f in shift_by_method[m]["summary"]))
    for family in families:
        for m in methods:
            g = shift_by_method[m]["summary"].get(family)
            if not isinstance(g, Mapping):
                continue
            rows.append([family + ("" if g.get("complete") else " (partial)"), method_label(m),
                         _fmt(g.get("accuracy"), pct=True), _fmt(g.get("nll")), _fmt(g.get("ece"), pct=True),
                         _fmt(g.get("ce_vs_map"), digits=3), _fmt(g.get("mce_alexnet"), digits=1)])
            keys.append(f"{family}:{m}")
    if not rows:
        return None
    header = ["Family", "Method", "Accuracy ↑", "NLL ↓", "ECE ↓", "CE vs MAP ↓", "mCE (AlexNet) ↓"]
    return Section("Shift by corruption family", Table(header, rows, "shift-families-table", keys), SUMMARY_NOTE)


def _fmt(v: Any, pct: bool = False, digits: int = 4) -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "—"
    return f"{100 * v:.1f}%" if pct else f"{v:.{digits}f}"
