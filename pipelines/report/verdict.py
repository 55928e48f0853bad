"""The verdict a report opens with: the headline metrics with their 95% intervals, the paired
differences against MAP and against temperature scaling, and sentences that claim a difference
only where the paired interval excludes 0.

Input: the run summary's ``results`` (``{method: headline}``, as ``run.json`` stores them:
``accuracy``, ``nll``, ``ece``, ``brier``, ``aurc``, ``ood_auroc``, ``ood_fpr95``, ``ood_aupr``,
under a shift sweep ``shift_accuracy``, ``shift_nll``, ``shift_ece``; and ``intervals``, the
paired bootstrap of :func:`laplace_core.metrics.bootstrap.bootstrap`: ``n``, ``ci`` per metric,
``paired[ref][metric]`` with ``diff``, ``lo``, ``hi``, ``significant``).

"Significant" (``docs/design.md``, "Intervals"): the 95% percentile interval of the paired
bootstrap difference over the same test images excludes 0. Otherwise the sentence says
"no significant difference at n = ...". Equal values are ties, never a "best".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

from pipelines.report.methods import method_label, order_methods

__all__ = ["METRICS", "Metric", "metrics_of", "shown_metrics", "summary_table", "paired_table", "sample_line", "verdict_sentences"]

MAP, TEMPERATURE = "map", "temperature"
#: The most decimals a value of the report gets (:meth:`Metric.shown_for`).
MAX_DECIMALS = 5


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    higher_is_better: bool
    percent: bool = False  # shown as a percentage
    digits: int = 3  # decimals (of the percentage when ``percent``)

    @property
    def direction(self) -> str:
        return "↑ higher" if self.higher_is_better else "↓ lower"

    def shown_for(self, values: Any) -> "Metric":
        """This metric with enough decimals that the smallest non-zero of ``values`` shows two
        significant figures (at most :data:`MAX_DECIMALS`): a converged model's NLLs of 0.0047 and
        0.0054 read "0.005" and "0.005" at three, and a difference of +0.0007 that excludes 0 read
        "+0.001 ... worse" or "+0.000 ... worse"; a tie is then judged at the precision shown. A row
        of the summary passes its point values, a paired difference the largest end of its interval."""
        scale = 100.0 if self.percent else 1.0
        small = min((abs(scale * v) for v in values if _finite(v) and v != 0), default=None)
        if small is None:
            return self
        need = min(MAX_DECIMALS, 1 - math.floor(math.log10(small)))
        return self if need <= self.digits else replace(self, digits=need)

    def fmt(self, v: float) -> str:
        return f"{100 * v:.{self.digits}f}%" if self.percent else f"{v:.{self.digits}f}"

    def fmt_ci(self, v: float, ci: Any) -> str:
        if not (isinstance(ci, (list, tuple)) and len(ci) == 2 and all(_finite(x) for x in ci)):
            return self.fmt(v)
        # no-break spaces inside the bracket: a narrow cell breaks only between value and interval
        d = self.digits
        if self.percent:
            return f"{100 * v:.{d}f}% [{100 * ci[0]:.{d}f},\u00a0{100 * ci[1]:.{d}f}]"
        return f"{v:.{d}f} [{ci[0]:.{d}f},\u00a0{ci[1]:.{d}f}]"

    def delta(self, v: float, ref: float) -> str:
        d = v - ref
        return f"{100 * d:+.{self.digits}f} pts" if self.percent else f"{d:+.{self.digits}f}"

    def fmt_diff(self, p: Mapping[str, Any]) -> str:
        """A paired difference with its interval, e.g. ``-2.3 pts [-3.1, -1.5]``, with the decimals
        its own numbers need (:meth:`shown_for`)."""
        m = self.shown_for([max(abs(p["diff"]), abs(p["lo"]), abs(p["hi"]))])  # the interval's scale
        s, d = (100.0 if self.percent else 1.0), m.digits
        unit = " pts" if self.percent else ""
        return f"{s * p['diff']:+.{d}f}{unit} [{s * p['lo']:+.{d}f}, {s * p['hi']:+.{d}f}]"

    def better(self, p: Mapping[str, Any]) -> bool | None:
        """True / False when the paired interval excludes 0 (better / worse), None otherwise."""
        if not p.get("significant"):
            return None
        return (p["lo"] > 0) == self.higher_is_better


#: The headline metrics, in the order the summary shows them.
METRICS: tuple[Metric, ...] = (
    Metric("accuracy", "Accuracy", True, percent=True, digits=1),
    Metric("nll", "NLL", False),
    Metric("ece", "ECE", False, percent=True, digits=1),
    Metric("brier", "Brier", False, digits=4),
    Metric("aurc", "AURC", False, digits=4),
    Metric("ood_auroc", "OOD AUROC", True),
    Metric("ood_fpr95", "OOD FPR at 95% TPR (OOD positive)", False, percent=True, digits=1),  # ID flagged; per set: OpenOOD's
    Metric("ood_aupr", "OOD AUPR", True),
    Metric("shift_accuracy", "Accuracy under shift (mean)", True, percent=True, digits=1),
    Metric("shift_nll", "NLL under shift (mean)", False),
    Metric("shift_ece", "ECE under shift (mean)", False, percent=True, digits=1),
)


def metrics_of(results: Mapping[str, Any]) -> tuple[Metric, ...]:
    """:data:`METRICS`, then the per-OOD-set and per-group metrics some method of ``results`` has
    (``ood_auroc@letters``, ...: :func:`pipelines.report.oodsets.set_metric_label`), in their order."""
    from pipelines.report.oodsets import set_metric_label

    extra: dict[str, Metric] = {}
    for r in results.values():
        for k in (r if isinstance(r, Mapping) else {}):
            got = set_metric_label(k) if isinstance(k, str) and k not in extra else None
            if got is not None:
                pct = k.startswith("ood_fpr95@")
                extra[k] = Metric(k, got[0], got[1], percent=pct, digits=1 if pct else 3)
    return METRICS + tuple(extra.values())


def shown_metrics(results: Mapping[str, Any]) -> tuple[Metric, ...]:
    """:func:`metrics_of` as the report's tables and verdict show them: with a single OOD set its
    AUROC and AUPR-Out are the pooled OOD AUROC and AUPR (the same images, score and positive
    class), so only its FPR@95 and AUPR-In (ID positive, OpenOOD's convention) are added."""
    metrics = metrics_of(results)
    sets = {m.key.partition("@")[2] for m in metrics if "@" in m.key}
    if len(sets) != 1:
        return metrics
    return tuple(m for m in metrics if "@" not in m.key or m.key.partition("@")[0] not in _POOLED_TWINS)


#: Per-set keys equal to a pooled headline metric when there is one OOD set (the same images, score and class).
_POOLED_TWINS = ("ood_auroc", "ood_aupr_out")


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _ok(results: Mapping[str, Any], method: str) -> Mapping[str, Any] | None:
    r = results.get(method)
    return r if isinstance(r, Mapping) and r.get("status", "ok") == "ok" else None


def _value(results: Mapping[str, Any], method: str, key: str) -> float | None:
    r = _ok(results, method)
    v = None if r is None else r.get(key)
    return float(v) if _finite(v) else None


def _intervals(results: Mapping[str, Any], method: str) -> Mapping[str, Any]:
    r = _ok(results, method)
    iv = None if r is None else r.get("intervals")
    return iv if isinstance(iv, Mapping) else {}


def _paired(results: Mapping[str, Any], method: str, ref: str, key: str) -> Mapping[str, Any] | None:
    p = (_intervals(results, method).get("paired") or {}).get(ref, {}).get(key)
    return p if isinstance(p, Mapping) and all(_finite(p.get(k)) for k in ("diff", "lo", "hi")) else None


def _methods(results: Mapping[str, Any]) -> list[str]:
    return order_methods(k for k, r in results.items() if isinstance(r, Mapping))


def _best(results: Mapping[str, Any], methods: list[str], m: Metric) -> list[str]:
    """The methods with the best value as shown (equal shown values are a tie)."""
    vals = {meth: v for meth in methods if (v := _value(results, meth, m.key)) is not None}
    if not vals:
        return []
    top = (max if m.higher_is_better else min)(vals.values())
    return [meth for meth, v in vals.items() if m.fmt(v) == m.fmt(top)]


def summary_table(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]], list[tuple[int, int]], list[str]]:
    """``(header, rows, marked cells (row, column), row keys)``: one row per headline metric that
    some method has, its better direction, one column per method (MAP first, then temperature
    scaling) with the value and its 95% interval, then the best method(s): tied values are a tie,
    all marked; a row gets more decimals while a difference against MAP that the verdict claims
    would read as a tie. The paired differences are :func:`paired_table`'s."""
    methods = _methods(results)
    header = ["Metric", "Better", *(method_label(m) for m in methods), "Best"]
    rows, marked, keys = [], [], []
    for m in shown_metrics(results):
        if all(_value(results, meth, m.key) is None for meth in methods):
            continue
        m = m.shown_for(_row_numbers(results, methods, m.key))
        # more decimals while a difference the verdict claims against MAP would read as a tie
        ref = _value(results, MAP, m.key)
        claimed = [v for meth in methods if meth != MAP and (v := _value(results, meth, m.key)) is not None
                   and (p := _paired(results, meth, MAP, m.key)) is not None and m.better(p) is not None]
        while ref is not None and m.digits < MAX_DECIMALS and any(m.fmt(v) == m.fmt(ref) for v in claimed):
            m = replace(m, digits=m.digits + 1)
        best = _best(results, methods, m)
        cells = [m.label, m.direction]
        for j, meth in enumerate(methods):
            v = _value(results, meth, m.key)
            ci = (_intervals(results, meth).get("ci") or {}).get(m.key)
            cells.append("—" if v is None else m.fmt_ci(v, ci))
            if meth in best:
                marked.append((len(rows), j + 2))
        if len(best) > 1:
            have = [meth for meth in methods if _value(results, meth, m.key) is not None]
            cells.append("all tied" if len(best) == len(have) else " = ".join(method_label(b) for b in best) + " (tie)")
        else:
            cells.append(_best_cell(results, best[0], m) if best else "—")
        rows.append(cells)
        keys.append(m.key)
    return header, rows, marked, keys


def _row_numbers(results: Mapping[str, Any], methods: list[str], key: str) -> list[float]:
    """The point values of metric ``key`` over ``methods`` (a row of the summary)."""
    return [v for meth in methods if (v := _value(results, meth, key)) is not None]


def _best_cell(results: Mapping[str, Any], meth: str, m: Metric) -> str:
    """The best method as shown; "(n.s. vs MAP)" after it where its paired difference against MAP
    does not exclude 0: the highest point value alone is no claim that it is better."""
    p = None if meth == MAP else _paired(results, meth, MAP, m.key)
    return method_label(meth) + ("" if p is None or m.better(p) else " (n.s. vs MAP)")


def paired_table(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]], list[str]] | None:
    """``(header, rows, keys)``: one row per (method, reference) pair, MAP and temperature scaling
    the references, one column per metric: the paired difference (method − reference) with its
    95% interval and "better" / "worse" where the interval excludes 0, "n.s." otherwise. None
    when the run has no paired intervals."""
    methods = _methods(results)
    keys_m = [m for m in shown_metrics(results) if any(_paired(results, a, b, m.key) for a in methods for b in (MAP, TEMPERATURE))]
    if not keys_m:
        return None
    header = ["Difference", *(f"{m.label} ({m.direction.split()[0]})" for m in keys_m)]
    rows, keys = [], []
    for ref in (MAP, TEMPERATURE):
        for meth in methods:
            if meth in (MAP, ref) or (ref == TEMPERATURE and meth == MAP):
                continue
            cells = [f"{method_label(meth)} − {method_label(ref)}"]
            for m in keys_m:
                p = _paired(results, meth, ref, m.key)
                if p is None:
                    cells.append("—")
                    continue
                b = m.better(p)
                cells.append(f"{m.fmt_diff(p)} " + {True: "better", False: "worse", None: "n.s."}[b])
            if any(c != "—" for c in cells[1:]):
                rows.append(cells)
                keys.append(f"{meth}-{ref}")
    return header, rows, keys


def sample_line(results: Mapping[str, Any]) -> str:
    """What the intervals rest on: n, the OOD n, resamples and seed (one line)."""
    iv = next((_intervals(results, m) for m in _methods(results) if _intervals(results, m)), None)
    if not iv:
        return "No intervals in this run (re-run the evaluation to get them): differences are not tested."
    ood = f" and {iv['n_ood']:,} OOD images" if iv.get("n_ood") else ""
    sets = next((_sets_line(results[m]) for m in _methods(results) if _sets_line(results[m])), "")
    ood += sets
    return (f"n = {iv['n']:,} test images{ood}. Brackets: 95% intervals from {iv['resamples']:,} paired bootstrap "
            f"resamples over the same images (seed {iv['seed']}); a difference is significant only where its "
            f"paired interval excludes 0.")


def _sets_line(r: Any) -> str:
    """`` (letters 60, noise 40)``: each named OOD set's images, or ``""``."""
    from pipelines.report.oodsets import per_set_of

    per = per_set_of(r) if isinstance(r, Mapping) else None
    sets = (per or {}).get("sets") or {}
    return " (" + ", ".join(f"{n} {s.get('n_out', 0):,}" for n, s in sets.items()) + ")" if sets else ""


def _against(results: Mapping[str, Any], meth: str, ref: str, n: int) -> str | None:
    """``"vs MAP: better NLL, ECE; worse Accuracy; no significant difference at n = ... in ..."`` (the
    differences with their intervals are :func:`paired_table`'s)."""
    better, worse, same = [], [], []
    for m in shown_metrics(results):
        p = _paired(results, meth, ref, m.key)
        if p is None:
            continue
        b = m.better(p)
        (better if b else worse if b is False else same).append(m.label)
    if not (better or worse or same):
        return None
    parts = []
    if better:
        parts.append("better " + ", ".join(better))
    if worse:
        parts.append("worse " + ", ".join(worse))
    if same and not (better or worse):
        parts.append(f"no significant difference at n = {n:,} on any metric")
    elif same:
        parts.append(f"no significant difference at n = {n:,} in " + ", ".join(same))
    return f"vs {method_label(ref)}: " + "; ".join(parts)


def _point_sentences(results: Mapping[str, Any]) -> list[str]:
    """Without intervals: the point values only, and that no difference is claimed."""
    out = []
    methods = _methods(results)
    for key in ("ece", "nll"):
        m = next(x for x in METRICS if x.key == key)
        best, ref = _best(results, methods, m), _value(results, MAP, key)
        if best and ref is not None:
            out.append(f"Lowest {m.label}: {' = '.join(method_label(b) for b in best)}, "
                       f"{m.fmt(_value(results, best[0], key))} against MAP's {m.fmt(ref)} "
                       "(no interval: no difference is claimed).")
    return out


def verdict_sentences(results: Mapping[str, Any], sizes: Mapping[str, Any] | None = None,
                      notes: list[str] | None = None, marks: Mapping[str, str] | None = None) -> list[str]:
    """One sentence per method against MAP (and each Laplace row against temperature scaling),
    claiming "better" / "worse" only where the paired interval excludes 0; then ``notes`` (e.g.
    the temperature fallback line). Without intervals: the point values and no claim. ``marks``:
    method -> "no configuration of <method> improved validation NLL over MAP (...)"
    (:meth:`pipelines.evaluation.search.SearchResult.marks`): such a method's sentence opens with
    its mark, and its test row is read as a reference, not as the method's improvement."""
    methods = _methods(results)
    marks = marks or {}
    out = []
    for meth in methods:
        if meth == MAP:
            continue
        n = int(_intervals(results, meth).get("n") or 0)
        parts = [s for ref in (MAP, TEMPERATURE) if ref != meth and (s := _against(results, meth, ref, n))]
        mark = f"{marks[meth][0].upper()}{marks[meth][1:]}; its test row is shown for reference: " if marks.get(meth) else ""
        if parts or mark:
            out.append(mark + f"{method_label(meth)} " + ("; ".join(parts) or "has no paired test interval") + ".")
    if not out:
        out = _point_sentences(results)
    return out + list(notes or [])
