"""The report's figures as PNG bytes: reliability, entropy, hyper-parameter search, and the
comparison across models of the audit page.

matplotlib ``Figure`` objects rendered with the Agg canvas (no pyplot state, no network):

- ``reliability.png``: per method (incl. MAP) accuracy-vs-confidence bars with the gap to the
  diagonal shaded, plus the Maddox et al. (2019) variant used in Lee et al.'s Figure 6:
  confidence − accuracy against confidence per bin, one line per method.
- ``entropy.png``: in-distribution vs OOD normalised-entropy histograms, one panel per method,
  AUROC in each title (Lee et al. Figure 7).
- ``risk_coverage.png``: selective prediction (:mod:`pipelines.report.practice`);
- ``hyper.png``: the search landscape per method over (log10 N, log10 τ), coloured by each
  objective, failed configurations as red crosses, the chosen point starred (Lee et al. Figure 9).
- ``comparison.png`` (audit page): NLL, ECE, OOD AUROC and posterior size per model and method.
"""
from __future__ import annotations

import io
import math
from typing import Any, Iterable, Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from pipelines.report.inputs import (SEARCH_OBJECTIVES, check_metrics, chosen_point, ece_variants, failed_row,
                                     is_finite, objective_info, pick_variant, posterior_sizes, reliability_points,
                                     scored, search_rows, variant_label)
from pipelines.report.methods import method_color, method_label, order_methods
from pipelines.storage.store import RunStore

__all__ = ["FIGURE_NAMES", "render_reliability", "render_entropy", "render_hyper", "render_comparison",
           "render_standard", "plot_reliability", "plot_entropy", "plot_hyper"]

FIGURE_NAMES: tuple[str, ...] = ("reliability", "entropy", "risk_coverage", "hyper")

_DPI = 100


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI)  # Figure.savefig uses the Agg canvas for PNG
    return buf.getvalue()


def _margins(width: float, height: float, left: float, right: float, bottom: float, top: float,
             **kw: float) -> dict[str, float]:
    """GridSpec keywords for margins given in inches (fixed layout: constrained layout costs
    seconds per figure, mostly in measuring tick labels)."""
    return dict(left=left / width, right=1 - right / width, bottom=bottom / height, top=1 - top / height, **kw)


def _grid(n: int, max_cols: int = 4) -> tuple[int, int]:
    ncols = max(1, min(n, max_cols))
    return math.ceil(n / ncols), ncols


def render_reliability(metrics_by_method: Mapping[str, Mapping[str, Any]], variant: str | None = None) -> bytes:
    """PNG bytes of the reliability figure (see module docstring). ``variant`` e.g.
    ``"equal_width_15"``; default: the equal-width variant present for every method."""
    mbm = check_metrics(metrics_by_method)
    suffix, strategy, n_bins = pick_variant(mbm, variant)
    vlabel = variant_label(strategy, n_bins)
    methods = list(mbm)
    nrows, ncols = _grid(len(methods))
    width, height = max(3.2 * ncols + 2.6, 9.0), 3.2 * nrows + 4.0
    fig = Figure(figsize=(width, height))
    gs = fig.add_gridspec(nrows + 1, ncols, height_ratios=[1.0] * nrows + [1.2],
                          **_margins(width, height, 0.75, 1.9, 0.6, 0.55, wspace=0.3, hspace=0.45))
    fig.suptitle(f"Reliability (ECE variant: {vlabel}, right-closed bins (lo, hi])", fontsize=12,
                 y=1 - 0.1 / height)
    for i, name in enumerate(methods):
        ax = fig.add_subplot(gs[i // ncols, i % ncols])
        pts = reliability_points(mbm[name], suffix)
        ax.plot([0, 1], [0, 1], ls="--", color="0.5", lw=1)
        for p in pts:
            bw = max(p["hi"] - p["lo"], 1e-3)
            ax.bar(p["lo"], p["accuracy"], width=bw, align="edge", color="#4c72b0", edgecolor="white", lw=0.5)
            ax.bar(p["lo"], abs(p["gap"]), bottom=min(p["accuracy"], p["confidence"]), width=bw, align="edge",
                   facecolor=(0.87, 0.52, 0.32, 0.3), hatch="///", edgecolor="#c44e52", lw=0.6)
        _bin_counts_and_intervals(ax, pts)
        ece = mbm[name].get(f"ece_{suffix}")
        ttl = method_label(name) + (f" — ECE {100 * ece:.2f}%" if is_finite(ece) else "")
        ax.set_title(ttl, fontsize=10)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_aspect("equal", adjustable="box")
        ax.tick_params(labelsize=8)
        if i % ncols == 0:
            ax.set_ylabel("accuracy", fontsize=9)
        ax.set_xlabel("confidence", fontsize=9)
    handles = [Patch(color="#4c72b0", label="accuracy per bin"),
               Line2D([0], [0], color="black", lw=1, marker="_", label="95% interval (Wilson)"),
               Patch(color="0.55", alpha=0.5, label="images per bin"),
               Patch(facecolor=(0.87, 0.52, 0.32, 0.3), hatch="///", edgecolor="#c44e52", label="gap to diagonal"),
               Line2D([0], [0], ls="--", color="0.5", label="perfect calibration")]
    ax = fig.add_subplot(gs[nrows, :])
    ax.axhline(0.0, color="0.5", lw=1, ls="--")
    for i, name in enumerate(methods):
        pts = reliability_points(mbm[name], suffix)
        ax.plot([p["confidence"] for p in pts], [p["gap"] for p in pts], marker="o", ms=4, lw=1.6,
                color=method_color(name, i), label=method_label(name))
    ax.set_xlim(0, 1)
    ax.set_xlabel("confidence (mean per bin)", fontsize=9)
    ax.set_ylabel("confidence − accuracy", fontsize=9)
    ax.set_title(f"Maddox et al. variant (Lee et al. Fig. 6), {vlabel}: above 0 = over-confident", fontsize=10)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(handles=handles + ax.get_legend_handles_labels()[0], loc="center left",
              bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    return _png(fig)


def wilson(k: float, n: float, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score 95% interval of a proportion ``k / n``."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, c - h), min(1.0, c + h)


def _bin_counts_and_intervals(ax: Any, pts: list[dict[str, float]]) -> None:
    """Per bin of a reliability panel: the Wilson interval of its accuracy (error bar) and its
    image count (grey bars in the panel's lower quarter, right axis, the number on top)."""
    if not pts:
        return
    for p in pts:
        lo, hi = wilson(p["accuracy"] * p["count"], p["count"])
        mid = (p["lo"] + p["hi"]) / 2
        ax.plot([mid, mid], [lo, hi], color="black", lw=0.9)
    axc = ax.inset_axes([0.0, 0.0, 1.0, 0.24])  # the panel's lower quarter
    axc.patch.set_alpha(0.0)
    axc.set_xlim(0, 1)
    axc.set_xticks([])
    for side in ("top", "left", "bottom"):
        axc.spines[side].set_visible(False)
    axc.yaxis.tick_right()
    top = max(p["count"] for p in pts)
    for p in pts:
        bw = max(p["hi"] - p["lo"], 1e-3)
        axc.bar(p["lo"], p["count"], width=bw, align="edge", color="0.55", alpha=0.5, edgecolor="none")
        axc.text(p["lo"] + bw / 2, p["count"], str(p["count"]), ha="center", va="bottom", fontsize=5.5,
                 color="0.25")
    axc.set_ylim(0, 1.3 * top)
    axc.set_yticks([top])
    axc.tick_params(labelsize=6, colors="0.4")


def render_entropy(metrics_by_method: Mapping[str, Mapping[str, Any]]) -> bytes:
    """PNG bytes of the in-distribution vs OOD normalised-entropy histograms (Lee et al. Fig. 7)."""
    mbm = check_metrics(metrics_by_method)
    methods = list(mbm)
    nrows, ncols = _grid(len(methods))
    width, height = max(3.4 * ncols + 0.6, 8.0), 2.9 * nrows + 1.1
    fig = Figure(figsize=(width, height))
    fig.suptitle("Normalised predictive entropy H(p)/log C: in-distribution vs OOD, cumulative (ECDF)", fontsize=12,
                 y=1 - 0.1 / height)
    axes = fig.subplots(nrows, ncols, squeeze=False, gridspec_kw=_margins(width, height, 0.65, 0.2, 0.95, 0.55,
                                                                          wspace=0.28, hspace=0.5))
    for i, name in enumerate(methods):
        ax = axes[i // ncols][i % ncols]
        m = mbm[name]
        ood = m.get("ood") if isinstance(m.get("ood"), Mapping) else None
        h_in = ood["entropy_hist_in"] if ood else m.get("entropy_hist")
        for hist, color, lab in ((h_in, "#4c72b0", "in"), (ood["entropy_hist_out"] if ood else None, "#c44e52", "out")):
            if not isinstance(hist, Mapping):
                continue
            edges, counts = list(hist["edges"]), list(hist["counts"])
            total = sum(counts)
            if total == 0:
                continue
            cum, run = [0.0], 0
            for c in counts:
                run += c
                cum.append(run / total)
            ax.plot(edges, cum, color=color, lw=1.6, drawstyle="default")
        exact = (m.get("ood_scores") or {}).get("entropy") if isinstance(m.get("ood_scores"), Mapping) else None
        auroc = exact.get("auroc") if isinstance(exact, Mapping) else (ood or {}).get("auroc")
        if ood and is_finite(auroc):
            ax.set_title(f"{method_label(name)} — AUROC {auroc:.3f}", fontsize=10)
        else:
            ax.set_title(f"{method_label(name)} — no OOD data", fontsize=10)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_xlabel("normalised entropy", fontsize=9)
        if i % ncols == 0:
            ax.set_ylabel("share of images ≤ x (ECDF)", fontsize=9)
        ax.tick_params(labelsize=8)
    for j in range(len(methods), nrows * ncols):
        axes[j // ncols][j % ncols].set_visible(False)
    fig.legend(handles=[Line2D([0], [0], color="#4c72b0", lw=1.6, label="in-distribution (test set)"),
                        Line2D([0], [0], color="#c44e52", lw=1.6, label="out-of-distribution")],
               loc="lower center", bbox_to_anchor=(0.5, 0.0), ncols=2, fontsize=9, frameon=False)
    return _png(fig)


def _hyper_objectives(rows: Sequence[Mapping[str, Any]], objectives: Sequence[str] | None) -> list[str]:
    """The objective columns of :func:`render_hyper`: ``objectives`` checked, or the first 3 present."""
    cols = list(dict.fromkeys(c for r in rows for c in r))
    named = [c for c in cols if c not in SEARCH_OBJECTIVES and objective_info(c)]
    present = [c for c in ("nll", "accuracy") if any(r.get(c) is not None for r in rows)]
    present += [c for c in (named or ["ece"]) if any(r.get(c) is not None for r in rows)]
    present += [c for c in ("brier",) if any(r.get(c) is not None for r in rows)]
    if objectives is None:
        objectives = present[:3]
    else:
        bad = [o for o in objectives if not objective_info(o)]
        if bad:
            raise ValueError(f"unknown objective(s) {bad}; valid: {list(SEARCH_OBJECTIVES)} or ece_<variant>")
    if not objectives:
        raise ValueError(f"search table has no objective column; expected one of {list(SEARCH_OBJECTIVES)}")
    return list(objectives)


def _hyper_panel(fig: Any, ax: Any, meth: str, mrows: Sequence[Mapping[str, Any]], obj: str,
                 star: tuple[float, float] | None) -> set[str]:
    """One method's configurations coloured by one objective (with its colour bar), the failed
    ones as red crosses and the chosen one as a star; returns the markers drawn ("failed", "chosen")."""
    happened: set[str] = set()
    label, higher_better = objective_info(obj)
    ok = [r for r in mrows if not failed_row(r) and r.get(obj) is not None]
    bad = [r for r in mrows if failed_row(r) or r.get(obj) is None]
    if ok:
        vals = [float(r[obj]) for r in ok]
        lo, hi = _clip_range(vals)
        sc = ax.scatter([r["log10_n"] for r in ok], [r["log10_tau"] for r in ok], c=vals,
                        cmap="viridis" if higher_better else "viridis_r", s=46, marker="s",
                        edgecolors="none", vmin=lo, vmax=hi)
        clipped = min(vals) < lo or max(vals) > hi
        cb = fig.colorbar(sc, ax=ax, fraction=0.07, pad=0.03, extend="both" if clipped else "neither")
        cb.set_label(f"{label} ({'higher' if higher_better else 'lower'} is better)"
                     + (", clipped to 10–90%" if clipped else ""), fontsize=8)
        cb.ax.tick_params(labelsize=7)
    if bad:
        happened.add("failed")
        ax.scatter([r["log10_n"] for r in bad], [r["log10_tau"] for r in bad], marker="x", color="red",
                   s=40, lw=1.5)
    if star is not None:
        happened.add("chosen")
        ax.scatter([star[0]], [star[1]], marker="*", s=260, color="gold", edgecolors="black", lw=1.0,
                   zorder=5)
    ax.set_title(f"{method_label(meth)} — {label}", fontsize=10)
    ax.set_xlabel("log10 N", fontsize=9)
    ax.set_ylabel("log10 τ", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.margins(0.08)
    return happened


def render_hyper(search_table: Any, chosen: Mapping[str, Any] | None = None,
                 objectives: Sequence[str] | None = None) -> bytes:
    """PNG bytes of the search landscape: one row per method, one panel per objective column
    (default: the first 3 present of ``nll``, ``accuracy``, ECE, ``brier``; a column named by its
    ECE variant, e.g. ``ece_equal_width_15``, is preferred over a bare ``ece`` and labelled with
    the variant, a bare ``ece`` is labelled "ECE" as the table does not say which), points at
    (log10 N, log10 τ) coloured by the objective (colour bar; bright = better), failed
    configurations as red crosses, the chosen point as a star (Lee et al. Fig. 9)."""
    rows = search_rows(search_table)
    if not rows:
        raise ValueError("search table is empty: nothing to plot")
    objectives = _hyper_objectives(rows, objectives)
    methods = order_methods(r["method"] for r in rows)
    nr, nc = len(methods), len(objectives)
    # Fixed margins in inches instead of constrained layout: with a colour bar per panel the
    # layout solver dominates the run time (seconds per figure).
    width, height = 4.3 * nc + 0.4, 3.0 * nr + 1.2
    fig = Figure(figsize=(width, height))
    fig.suptitle("Hyper-parameter search: prior precision τ and data-size scale N", fontsize=12,
                 y=1 - 0.12 / height)
    axes = fig.subplots(nr, nc, squeeze=False, gridspec_kw=dict(
        left=0.75 / width, right=1 - 0.6 / width, bottom=0.95 / height, top=1 - 0.65 / height,
        wspace=0.6, hspace=0.62))
    happened: set[str] = set()
    for i, meth in enumerate(methods):
        mrows = [r for r in rows if r["method"] == meth and r["log10_n"] is not None and r["log10_tau"] is not None]
        star = chosen_point(chosen, meth)
        for j, obj in enumerate(objectives):
            happened |= _hyper_panel(fig, axes[i][j], meth, mrows, obj, star)
    handles = [Line2D([0], [0], marker="s", ls="", color="#3b528b", label="evaluated configuration")]
    if "failed" in happened:
        handles.append(Line2D([0], [0], marker="x", ls="", color="red", mew=1.5, label="failed configuration"))
    if "chosen" in happened:
        handles.append(Line2D([0], [0], marker="*", ls="", color="gold", mec="black", ms=13, label="chosen (N, τ)"))
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncols=len(handles), fontsize=9,
               frameon=False)
    return _png(fig)


def _clip_range(vals: Sequence[float]) -> tuple[float, float]:
    """The colour range of a search panel: the 10th to 90th percentile of its values (a few bad
    configurations do not stretch the scale); the full range when that is degenerate."""
    v = sorted(vals)
    q = lambda f: v[min(len(v) - 1, max(0, round(f * (len(v) - 1))))]  # noqa: E731
    lo, hi = q(0.1), q(0.9)
    return (lo, hi) if hi > lo else (v[0], v[-1])


def plot_reliability(metrics_by_method: Mapping[str, Mapping[str, Any]], path: str, variant: str | None = None,
                     store: RunStore = RunStore()) -> None:
    """Write ``reliability.png`` (see :func:`render_reliability`) to ``path`` (local or s3://)."""
    store.write_bytes_atomic(path, render_reliability(metrics_by_method, variant))


def plot_entropy(metrics_by_method: Mapping[str, Mapping[str, Any]], path: str, store: RunStore = RunStore()) -> None:
    """Write ``entropy.png`` (see :func:`render_entropy`) to ``path`` (local or s3://)."""
    store.write_bytes_atomic(path, render_entropy(metrics_by_method))


def plot_hyper(search_table: Any, chosen: Mapping[str, Any] | None, path: str,
               objectives: Sequence[str] | None = None, store: RunStore = RunStore()) -> None:
    """Write ``hyper.png`` (see :func:`render_hyper`) to ``path`` (local or s3://)."""
    store.write_bytes_atomic(path, render_hyper(search_table, chosen, objectives))


def render_standard(mbm: Mapping[str, Mapping[str, Any]], summary: Mapping[str, Any], rows: list[dict],
                    skip: Iterable[str] = ()) -> dict[str, bytes]:
    """``{name: PNG bytes}`` of the standard figures not in ``skip`` (``risk_coverage`` only when the
    metrics have the selective-prediction curve, ``hyper`` only when a search row was scored), in
    :data:`FIGURE_NAMES` order."""
    out: dict[str, bytes] = {}
    skip = set(skip)
    if "reliability" not in skip:
        out["reliability"] = render_reliability(mbm)
    if "entropy" not in skip:
        out["entropy"] = render_entropy(mbm)
    if "risk_coverage" not in skip:
        from pipelines.report.practice import render_risk_coverage

        png = render_risk_coverage(mbm)
        if png is not None:
            out["risk_coverage"] = png
    if "hyper" not in skip and rows and scored(rows):
        chosen = summary.get("chosen") if isinstance(summary.get("chosen"), Mapping) else None
        out["hyper"] = render_hyper(rows, chosen)
    return out


def _comparison_value(summary: Mapping[str, Any], mbm: Mapping[str, Mapping[str, Any]], meth: str,
                      key: str | None) -> Any:
    """One bar of :func:`render_comparison`: the method's posterior size in MB (``key="mb"``), its
    OOD AUROC, or its metric ``key``; None when the model has no such number."""
    if key == "mb":
        return posterior_sizes(summary).get(meth, {}).get("mb")
    if meth not in mbm or key is None:
        return None
    if key == "auroc":
        ood = mbm[meth].get("ood")
        return ood.get("auroc") if isinstance(ood, Mapping) else None
    return mbm[meth].get(key)


def render_comparison(per_model: Mapping[str, tuple[Mapping[str, Any], Mapping[str, Mapping[str, Any]]]]) -> bytes:
    """PNG bytes: grouped bars (one group per model, one bar per method) of NLL, ECE (first
    variant), OOD AUROC and posterior size in MB (log scale)."""
    models = list(per_model)
    methods = order_methods(m for _, mbm in per_model.values() for m in mbm)
    ece_key = next((v[0] for _, mbm in per_model.values() for d in mbm.values() if (v := ece_variants(d))), None)
    panels = [("nll", "NLL (lower is better)"),
              (ece_key[0] if ece_key else None,
               f"ECE, {variant_label(ece_key[1], ece_key[2])} (lower is better)" if ece_key else "ECE"),
              ("auroc", "OOD AUROC (higher is better)"), ("mb", "posterior size, MB (log scale)")]
    fig = Figure(figsize=(max(11.0, 2.2 * len(models) * 2 + 2), 7.0), layout="constrained")
    fig.suptitle("Comparison across models", fontsize=12)
    axes = fig.subplots(2, 2, squeeze=False).ravel()
    width = 0.8 / max(len(methods), 1)
    for ax, (key, label) in zip(axes, panels):
        for k, meth in enumerate(methods):
            xs, ys = [], []
            for i, model in enumerate(models):
                v = _comparison_value(*per_model[model], meth, key)
                if is_finite(v):
                    xs.append(i - 0.4 + (k + 0.5) * width)
                    ys.append(v * 100 if key and key.startswith("ece_") else v)
            ax.bar(xs, ys, width=width, color=method_color(meth, k), label=method_label(meth))
        ax.set_xticks(range(len(models)), [str(m) for m in models], fontsize=8)
        ax.set_title(label + (" [%]" if key and key.startswith("ece_") else ""), fontsize=10)
        ax.tick_params(labelsize=8)
        if key == "mb":
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    handles = [Patch(color=method_color(m, k), label=method_label(m)) for k, m in enumerate(methods)]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(methods), 7), fontsize=9, frameon=False)
    return _png(fig)
