"""The metrics practitioners read beside the headline table: OOD detection per score and
selective prediction (abstaining on the least confident images), as tables and the
risk–coverage figure. Input: the checked metrics per method (``metrics.json``: ``ood_scores``
and ``selective``, :mod:`laplace_core.metrics.bootstrap` / :mod:`laplace_core.metrics.selective`)."""
from __future__ import annotations

import io
import math
from typing import Any, Mapping

from pipelines.report.methods import method_color, method_label

__all__ = ["OOD_SCORE_LABELS", "ood_table", "selective_table", "render_risk_coverage"]

OOD_SCORE_LABELS = {"entropy": "entropy", "max_prob": "max probability", "mutual_information": "mutual information"}
OOD_NOTE = ("OOD detection over all OOD sets together: the OOD images are the positive class; a score ranks an image as OOD when its "
            "predictive entropy or mutual information (the epistemic part, MC and GLM predictives only) is high, "
            "or its maximum probability is low. AUROC and AUPR: higher is better; FPR at 95% TPR: the share of "
            "test images flagged when 95% of the OOD images are, lower is better. Exact, ties as scikit-learn.")
SELECTIVE_NOTE = ("Selective prediction: keep the most confident share of the test images (confidence = maximum "
                  "probability; tied confidences kept or dropped together). AURC: area under the risk–coverage "
                  "curve, lower is better; accuracy at 90% / 95% coverage: of the kept images, higher is better.")


def _f(v: Any, kind: str = "3") -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        return "—"
    return f"{100 * v:.1f}%" if kind == "pct" else f"{v:.{kind}f}"


def ood_table(mbm: Mapping[str, Mapping[str, Any]]) -> tuple[list[str], list[list[str]], list[str]] | None:
    """``(header, rows, methods)``: AUROC, FPR at 95% TPR and AUPR per score and method; None
    when no method has per-score OOD metrics."""
    have = {m: d["ood_scores"] for m, d in mbm.items() if isinstance(d.get("ood_scores"), Mapping)}
    if not have:
        return None
    scores = [s for s in OOD_SCORE_LABELS if any(isinstance(o.get(s), Mapping) for o in have.values())]
    header = ["Method"]
    for s in scores:
        lab = OOD_SCORE_LABELS[s]
        header += [f"AUROC ({lab}) ↑", f"FPR@95%TPR ({lab}) ↓", f"AUPR ({lab}) ↑"]
    rows = []
    for m, o in have.items():
        r = [method_label(m)]
        for s in scores:
            x = o.get(s) if isinstance(o.get(s), Mapping) else {}
            r += [_f(x.get("auroc")), _f(x.get("fpr_at_95_tpr"), "pct"), _f(x.get("aupr"))]
        rows.append(r)
    return header, rows, list(have)


def selective_table(mbm: Mapping[str, Mapping[str, Any]]) -> tuple[list[str], list[list[str]], list[str]] | None:
    """``(header, rows, methods)``: AURC and the accuracy at 90% / 95% coverage per method."""
    have = {m: d["selective"] for m, d in mbm.items() if isinstance(d.get("selective"), Mapping)}
    if not have:
        return None
    header = ["Method", "AURC ↓", "Accuracy at 90% coverage ↑", "Accuracy at 95% coverage ↑", "Accuracy (100%) ↑"]
    rows = [[method_label(m), _f(s.get("aurc"), "4"), _f(s.get("acc_at_90"), "pct"), _f(s.get("acc_at_95"), "pct"),
             _f(mbm[m].get("accuracy"), "pct")] for m, s in have.items()]
    return header, rows, list(have)


def render_risk_coverage(mbm: Mapping[str, Mapping[str, Any]]) -> bytes | None:
    """PNG: risk (error rate of the kept images) against coverage, one line per method, AURC in
    the legend; None when no method has a curve."""
    from matplotlib.figure import Figure

    curves = {m: d["selective"] for m, d in mbm.items()
              if isinstance(d.get("selective"), Mapping) and isinstance(d["selective"].get("curve"), Mapping)}
    if not curves:
        return None
    fig = Figure(figsize=(8.0, 4.2))
    ax = fig.add_subplot(1, 1, 1)
    for i, (m, s) in enumerate(curves.items()):
        c = s["curve"]
        ax.plot(c["coverage"], c["risk"], lw=1.6, color=method_color(m, i),
                label=f"{method_label(m)} (AURC {_f(s.get('aurc'), '4')})")
    for q in (0.9, 0.95):
        ax.axvline(q, color="0.6", lw=0.8, ls=":")
    ax.set_xlim(0, 1.0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("coverage (share of test images kept, most confident first)", fontsize=9)
    ax.set_ylabel("risk (error rate of the kept images)", fontsize=9)
    ax.set_title("Selective prediction: risk–coverage (lower is better; dotted: 90% and 95% coverage)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=8)
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.13, top=0.9)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()
