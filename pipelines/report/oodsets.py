"""The report's table of the named OOD sets and their groups (issue 39): per set and group, score and
method, OpenOOD's AUROC, FPR@95, AUPR-In and AUPR-Out with their 95% bootstrap intervals. Input: the
checked metrics per method (``metrics.json``: ``ood_scores["per_set"]`` and ``intervals``;
:mod:`laplace_core.metrics.oodsets`)."""
from __future__ import annotations

import math
from typing import Any, Mapping

from laplace_core.metrics.oodsets import OPENOOD_METRICS, metric_key
from pipelines.report.methods import method_label
from pipelines.report.practice import OOD_SCORE_LABELS

__all__ = ["OOD_SETS_NOTE", "ood_sets_table", "per_set_of", "flat_set_metrics", "set_metric_label", "SET_BASES"]

#: the headline key of each OpenOOD metric (entropy score) before ``@<set or group>``; higher is better?
SET_BASES = {"ood_auroc": ("OOD AUROC", True), "ood_fpr95": ("OOD FPR@95", False),
             "ood_aupr_in": ("OOD AUPR-In", True), "ood_aupr_out": ("OOD AUPR-Out", True)}

OOD_SETS_NOTE = ("OOD sets as OpenOOD v1.5 reports them: each set on its own, and each group (near, far) as the "
                 "unweighted mean over its sets. AUROC (the same whichever class is positive), higher is better; "
                 "FPR@95: the share of the OOD images accepted as in-distribution at the threshold that keeps 95% "
                 "of the test images (ID positive), lower is better; AUPR-In: average precision with the test "
                 "images positive; AUPR-Out: with the OOD images positive; both higher is better. Brackets: 95% "
                 "bootstrap intervals, each set resampled on its own.")
_HEAD = {"auroc": "AUROC ↑", "fpr95": "FPR@95 ↓", "aupr_in": "AUPR-In ↑", "aupr_out": "AUPR-Out ↑"}


def per_set_of(d: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A method's ``ood_scores["per_set"]`` (:func:`laplace_core.metrics.oodsets.set_summary`), or None."""
    o = d.get("ood_scores")
    p = o.get("per_set") if isinstance(o, Mapping) else None
    return p if isinstance(p, Mapping) else None


def _cell(v: Any, ci: Any, pct: bool) -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        return "—"
    f = (lambda x: f"{100 * x:.1f}%") if pct else (lambda x: f"{x:.3f}")
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(isinstance(x, (int, float)) for x in ci):
        return f"{f(v)} [{f(ci[0])}, {f(ci[1])}]"
    return f(v)


def _entries(per: Mapping[str, Any]) -> list[tuple[str, str, Mapping[str, Any]]]:
    """``(where, label, block)`` for every set, then every group."""
    out = [(n, f"{n}" + (f" ({s['group']})" if s.get("group") else ""), s) for n, s in (per.get("sets") or {}).items()]
    out += [(g, f"{g}-OOD mean ({', '.join(s.get('sets') or [])})", s) for g, s in (per.get("groups") or {}).items()]
    return out


def ood_sets_table(mbm: Mapping[str, Mapping[str, Any]]) -> tuple[list[str], list[list[str]], list[str]] | None:
    """``(header, rows, keys)``: one row per set or group, score and method; None without per-set metrics."""
    have = {m: per_set_of(d) for m, d in mbm.items()}
    have = {m: p for m, p in have.items() if p is not None}
    if not have:
        return None
    header = ["OOD set", "Score", "Method", *(_HEAD[k] for k in OPENOOD_METRICS)]
    rows, keys = [], []
    first = next(iter(have.values()))
    for where, label, _ in _entries(first):
        for score, lab in OOD_SCORE_LABELS.items():
            for m, per in have.items():
                block = {w: b for w, _, b in _entries(per)}.get(where) or {}
                vals = block.get(score)
                if not isinstance(vals, Mapping):
                    continue
                iv = mbm[m].get("intervals") if isinstance(mbm[m].get("intervals"), Mapping) else {}
                ci = iv.get("ci") or {}
                rows.append([label, lab, method_label(m),
                             *(_cell(vals.get(k), ci.get(metric_key(k, where, score)), k == "fpr95")
                               for k in OPENOOD_METRICS)])
                keys.append(m)
    return header, rows, keys


def flat_set_metrics(r: Mapping[str, Any]) -> dict[str, float]:
    """The entropy score's metrics per set and group as headline keys (``ood_auroc@letters``,
    ``ood_fpr95@far``, ...: :func:`laplace_core.metrics.oodsets.metric_key`) of one method's metrics."""
    per = per_set_of(r)
    if per is None:
        return {}
    out = {}
    for where, _, block in _entries(per):
        vals = block.get("entropy")
        if isinstance(vals, Mapping):
            out.update({metric_key(k, where): vals[k] for k in OPENOOD_METRICS if k in vals})
    return out


def set_metric_label(key: str, groups: tuple[str, ...] = ("near", "far")) -> tuple[str, bool] | None:
    """``(label, higher is better)`` of a per-set headline key, e.g. ``OOD AUROC (letters)``; None otherwise."""
    base, at, where = key.partition("@")
    if not at or base not in SET_BASES or not where:
        return None
    label, up = SET_BASES[base]
    # FPR@95 counts OOD images accepted (ID positive, OpenOOD), the pooled one test images flagged: said
    positive = "; ID positive" if base == "ood_fpr95" else ""
    return f"{label} ({where}{'-OOD mean' if where in groups else ''}{positive})", up
