"""Run report: three figures and one self-contained HTML page (+ the same content in Markdown).

One idea: turn plain data (the metrics dicts of :meth:`laplace_core.metrics.MetricSuite.compute`,
the hyper-parameter search table, a run-summary dict) into figures and pages. Nothing here reads
models, posteriors or Ray objects, so every function is testable with synthetic dicts.

Inputs
------
``metrics_by_method``: ``{method: MetricSuite.compute() dict}``, methods e.g. ``"map"`` (the
deterministic baseline), ``"diag"``, ``"kfac"``, ``"kfac_exact"``, ``"efb"``, ``"inf"``, ``"subnet"``
(shown in that order, other names after them, alphabetically).

``search_table``: one row per (method, N, τ) configuration with columns ``method``, ``log10_n``,
``log10_tau``, objective columns (``nll``, ``ece``, ``accuracy``, ``brier``), ``status`` (``"ok"``
for a configuration that was evaluated; anything else is a failure) and ``reason``. Accepted as a
pandas DataFrame, a pyarrow Table, a list of row dicts or a dict of columns (:func:`search_rows`).

``run_summary`` (every key optional; a key of the wrong type raises ``ValueError``)::

    title            str                  page title (default "infoform report: <model>")
    run_id, created  str                  shown under the title
    config           mapping | str        the run's configuration, shown as YAML in a <details>
    model            str | mapping        e.g. {"name": "resnet18", "weights": "...", "num_params": ...}
    data             str | mapping        e.g. {"train": uri, "test": uri, "ood": uri, "num_classes": 1000}
    versions         mapping[str, str]    package versions
    timings          mapping[str, float]  seconds per stage for the whole run
    method_timings   mapping[method, mapping[stage, float]]  seconds per stage per method (table columns)
    posterior_sizes  mapping[method, {"numbers": int|None, "mb": float|None, "note": str}]
                     (the ``"methods"`` part of ``laplace_core.sizes.SizeReport.to_json()``)
    skipped_images   {"count": int, "examples": [{"path", "reason"} | str]}, or a mapping of such
                     dicts (e.g. {"pass1": ..., "pass2": ...}), which are summed
    clipped_d_entries, clamped_eigenvalues
                     int, or mapping[str, int] (per method / layer; the total is shown with the parts)
    failed_search_configs
                     int or list of failed rows; default: counted from ``search_table``
    chosen           mapping[method, {"log10_n", "log10_tau"} | {"n", "tau"} | (log10_n, log10_tau)]

Conventions shown in the report: ECE names its variant (equal width / equal mass, bin count,
right-closed bins) everywhere it appears; sizes are in MB = 2^20 bytes at 4 bytes per number
(Lee et al. 2020, Table 3); the OOD mean entropy is estimated from the metrics' fixed-edge
histogram (bin centres, error <= half a bin width) unless the dict carries ``entropy_mean_out``.

Figures (matplotlib ``Figure`` objects rendered with the Agg canvas; no pyplot state, no network):

- ``reliability.png``: per method (incl. MAP) accuracy-vs-confidence bars with the gap to the
  diagonal shaded, plus the Maddox et al. (2019) variant used in Lee et al.'s Figure 6:
  confidence − accuracy against confidence per bin, one line per method.
- ``entropy.png``: in-distribution vs OOD normalised-entropy histograms, one panel per method,
  AUROC in each title (Lee et al. Figure 7).
- ``hyper.png``: the search landscape per method over (log10 N, log10 τ), coloured by each
  objective, failed configurations as red crosses, the chosen point starred (Lee et al. Figure 9).

Pages: ``report.html`` embeds the figures as ``data:image/png;base64`` URIs and its CSS inline; it
has no scripts and no external references. ``report.md`` links the PNGs by relative path
(``figures/<name>.png``). All writes go through :mod:`pipelines.storage.uris` (atomic; local or s3://).
"""
from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import json
import math
import re
from typing import Any, Iterable, Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from pipelines.storage import uris as storage

__all__ = [
    "METHOD_ORDER",
    "METHOD_LABELS",
    "FIGURE_NAMES",
    "STATUS_OK",
    "split_failed",
    "SEARCH_REQUIRED_COLUMNS",
    "SEARCH_OBJECTIVES",
    "order_methods",
    "method_label",
    "ece_variants",
    "reliability_points",
    "ood_entropy_means",
    "search_rows",
    "load_eval_metrics",
    "read_search_table",
    "render_reliability",
    "render_entropy",
    "render_hyper",
    "plot_reliability",
    "plot_entropy",
    "plot_hyper",
    "render_html",
    "render_markdown",
    "write_report",
    "write_audit_report",
]

METHOD_ORDER: tuple[str, ...] = ("map", "diag", "kfac", "kfac_exact", "efb", "inf", "subnet")
METHOD_LABELS: dict[str, str] = {
    "map": "MAP", "diag": "Diag", "kfac": "KFAC", "kfac_exact": "KFAC (exact)",
    "efb": "EFB", "inf": "INF", "subnet": "Subnet",
}
#: Whether a posterior models weight correlations (Lee et al. Table 3, "Corr"); None = no posterior.
CORRELATIONS: dict[str, bool | None] = {
    "map": None, "diag": False, "kfac": True, "kfac_exact": True, "efb": True, "inf": True, "subnet": True,
}
FIGURE_NAMES: tuple[str, ...] = ("reliability", "entropy", "hyper")
STATUS_OK = "ok"
SEARCH_REQUIRED_COLUMNS: tuple[str, ...] = ("method", "log10_n", "log10_tau")
#: objective column -> (label, higher is better)
SEARCH_OBJECTIVES: dict[str, tuple[str, bool]] = {
    "nll": ("NLL", False), "accuracy": ("accuracy", True), "ece": ("ECE", False), "brier": ("Brier", False),
}
STAGE_ORDER: tuple[str, ...] = ("data", "curvature", "eigen", "posterior", "search", "evaluate", "report")
BYTES_PER_NUMBER = 4
MB = 2**20
_DPI = 100
_EXAMPLES_SHOWN = 5
_METHOD_COLORS = {
    "map": "#444444", "diag": "#1f77b4", "kfac": "#ff7f0e", "kfac_exact": "#8c564b",
    "efb": "#2ca02c", "inf": "#d62728", "subnet": "#9467bd",
}
_ECE_KEY = re.compile(r"^ece_(equal_width|equal_mass)_(\d+)$")


# --------------------------------------------------------------------------- names and checks
def order_methods(names: Iterable[str]) -> list[str]:
    """Known methods in :data:`METHOD_ORDER`, then the others alphabetically."""
    names = list(dict.fromkeys(names))
    known = [m for m in METHOD_ORDER if m in names]
    return known + sorted(m for m in names if m not in METHOD_ORDER)


def method_label(name: str) -> str:
    return METHOD_LABELS.get(name, str(name))


def _method_color(name: str, i: int) -> str:
    if name in _METHOD_COLORS:
        return _METHOD_COLORS[name]
    extra = ("#17becf", "#bcbd22", "#e377c2", "#7f7f7f")
    return extra[i % len(extra)]


def split_failed(metrics_by_method: Mapping[str, Any], prefix: str = "") -> tuple[dict[str, Any], list[str]]:
    """``(ok, failed)``: the methods whose ``metrics.json`` has no ``status`` or ``status == "ok"``,
    and one ``"<prefix><method>: <status> (<reason>)"`` line per method whose evaluation did not
    finish (it has no numbers to show; the report lists it instead of failing)."""
    if not isinstance(metrics_by_method, Mapping):
        raise ValueError(f"metrics_by_method must be a mapping, got {type(metrics_by_method).__name__}")
    ok: dict[str, Any] = {}
    failed: list[str] = []
    for meth, d in metrics_by_method.items():
        if isinstance(d, Mapping) and d.get("status", STATUS_OK) != STATUS_OK:
            failed.append(f"{prefix}{meth}: {d.get('status')} ({d.get('reason') or 'no reason given'})")
        else:
            ok[meth] = d
    return ok, failed


def _check_metrics(metrics_by_method: Any, allow_empty: bool = False) -> dict[str, Mapping[str, Any]]:
    if not isinstance(metrics_by_method, Mapping) or (not metrics_by_method and not allow_empty):
        raise ValueError("metrics_by_method must be a non-empty mapping {method: MetricSuite.compute() dict}")
    out = {}
    for name in order_methods(metrics_by_method):
        m = metrics_by_method[name]
        if not isinstance(name, str) or not name:
            raise ValueError(f"method names must be non-empty strings, got {name!r}")
        if not isinstance(m, Mapping):
            raise ValueError(f"metrics for method {name!r} must be a dict, got {type(m).__name__}")
        for key in ("accuracy", "nll", "brier"):
            if key not in m:
                raise ValueError(f"metrics for method {name!r} lack {key!r} (not a MetricSuite.compute() dict)")
        out[name] = m
    return out


def ece_variants(metrics: Mapping[str, Any]) -> list[tuple[str, str, int]]:
    """``[(key, strategy, n_bins)]`` for the ECE entries of one metrics dict, equal width first.

    >>> ece_variants({"ece_equal_width_15": 0.1, "ece_equal_mass_15": 0.2})
    [('ece_equal_width_15', 'equal_width', 15), ('ece_equal_mass_15', 'equal_mass', 15)]
    """
    found = []
    for key in metrics:
        mt = _ECE_KEY.match(str(key))
        if mt:
            found.append((key, mt.group(1), int(mt.group(2))))
    return sorted(found, key=lambda t: (t[1] != "equal_width", t[2]))


def _variant_label(strategy: str, n_bins: int) -> str:
    return f"{strategy.replace('_', ' ')}, {n_bins} bins"


def _pick_variant(metrics_by_method: Mapping[str, Mapping[str, Any]], variant: str | None) -> tuple[str, str, int]:
    """The reliability variant shared by all methods: ``(suffix, strategy, n_bins)``."""
    if variant is not None:
        mt = _ECE_KEY.match("ece_" + variant)
        if not mt:
            raise ValueError(f"unknown ECE variant {variant!r}; expected e.g. 'equal_width_15' or 'equal_mass_15'")
        missing = [m for m, d in metrics_by_method.items() if "reliability_" + variant not in d]
        if missing:
            raise ValueError(f"reliability_{variant} missing for method(s) {missing}")
        return variant, mt.group(1), int(mt.group(2))
    common = None
    for d in metrics_by_method.values():
        keys = {k[len("ece_"):] for k, _, _ in ece_variants(d) if "reliability_" + k[len("ece_"):] in d}
        common = keys if common is None else common & keys
    if not common:
        raise ValueError("no reliability_<variant> bin table shared by all methods (e.g. reliability_equal_width_15)")
    first = next(iter(sorted(common, key=lambda s: (not s.startswith("equal_width"), s))))
    mt = _ECE_KEY.match("ece_" + first)
    return first, mt.group(1), int(mt.group(2))


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# --------------------------------------------------------------------------- derived numbers
def reliability_points(metrics: Mapping[str, Any], variant: str = "equal_width_15") -> list[dict[str, float]]:
    """Non-empty bins of ``metrics["reliability_<variant>"]`` as dicts with ``lo``, ``hi``,
    ``count``, ``confidence`` (mean confidence), ``accuracy`` and ``gap = confidence - accuracy``
    (the Maddox et al. y-axis; > 0 means over-confident)."""
    key = "reliability_" + variant
    if key not in metrics:
        raise ValueError(f"metrics lack {key!r}; present: {sorted(k for k in metrics if k.startswith('reliability_'))}")
    pts = []
    for b in metrics[key]:
        if not b.get("count"):
            continue
        conf, acc = float(b["confidence"]), float(b["accuracy"])
        lo = b.get("lo")
        hi = b.get("hi")
        pts.append({"lo": float(lo) if lo is not None else conf, "hi": float(hi) if hi is not None else conf,
                    "count": int(b["count"]), "confidence": conf, "accuracy": acc, "gap": conf - acc})
    return pts


def _hist_mean(hist: Mapping[str, Sequence[float]]) -> float | None:
    edges, counts = list(hist["edges"]), list(hist["counts"])
    total = sum(counts)
    if total == 0:
        return None
    return sum(c * 0.5 * (edges[i] + edges[i + 1]) for i, c in enumerate(counts)) / total


def ood_entropy_means(metrics: Mapping[str, Any]) -> tuple[float | None, float | None, bool]:
    """``(mean in, mean out, out_is_estimate)``: the in-distribution mean normalised entropy
    (exact, ``entropy_mean``) and the OOD mean: ``ood["entropy_mean_out"]`` when present, else
    the mean of the OOD histogram at bin centres (``out_is_estimate = True``; the error is at most
    half a bin width, 0.01 at the default 50 bins). ``None`` when there is no OOD data."""
    mean_in = metrics.get("entropy_mean")
    ood = metrics.get("ood")
    if not isinstance(ood, Mapping):
        return mean_in, None, False
    if _finite(ood.get("entropy_mean_out")):
        return mean_in, float(ood["entropy_mean_out"]), False
    hist = ood.get("entropy_hist_out")
    if not isinstance(hist, Mapping):
        return mean_in, None, False
    return mean_in, _hist_mean(hist), True


# --------------------------------------------------------------------------- search table
def search_rows(table: Any) -> list[dict[str, Any]]:
    """The search table as a list of row dicts (pandas DataFrame, pyarrow Table, list of dicts
    or dict of columns). Raises ``ValueError`` when a required column is missing."""
    if table is None:
        return []
    if hasattr(table, "to_dict") and hasattr(table, "columns") and not isinstance(table, Mapping):  # pandas
        rows = table.to_dict("records")
        cols = [str(c) for c in table.columns]
    elif hasattr(table, "to_pylist") and hasattr(table, "column_names"):  # pyarrow
        rows = table.to_pylist()
        cols = list(table.column_names)
    elif isinstance(table, Mapping):
        cols = list(table)
        lengths = {len(v) for v in table.values()}
        if len(lengths) > 1:
            raise ValueError(f"search table columns have different lengths: {sorted(lengths)}")
        n = lengths.pop() if lengths else 0
        rows = [{c: table[c][i] for c in cols} for i in range(n)]
    elif isinstance(table, Sequence) and not isinstance(table, (str, bytes)):
        rows = [dict(r) for r in table]
        cols = sorted({c for r in rows for c in r})
    else:
        raise ValueError(f"search table must be a DataFrame, pyarrow Table, list of dicts or dict of columns, "
                         f"got {type(table).__name__}")
    if rows:
        missing = [c for c in SEARCH_REQUIRED_COLUMNS if c not in cols]
        if missing:
            raise ValueError(f"search table lacks column(s) {missing}; has {cols}")
    out = []
    for r in rows:
        r = dict(r)
        for c in ("log10_n", "log10_tau", *[k for k in cols if _objective_info(k)]):
            v = r.get(c)
            r[c] = float(v) if v is not None and _is_number(v) else None
        r["method"] = str(r["method"])
        status = r.get("status")
        r["status"] = STATUS_OK if status is None and "status" not in cols else str(status)
        out.append(r)
    return out


def _objective_info(col: str) -> tuple[str, bool] | None:
    """``(label, higher is better)`` for an objective column: ``nll``, ``accuracy``, ``ece``,
    ``brier`` or a named ECE variant such as ``ece_equal_width_15``; None for other columns."""
    if col in SEARCH_OBJECTIVES:
        return SEARCH_OBJECTIVES[col]
    mt = _ECE_KEY.match(col)
    return (f"ECE ({_variant_label(mt.group(1), int(mt.group(2)))})", False) if mt else None


def _is_number(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _failed(row: Mapping[str, Any]) -> bool:
    return row.get("status") != STATUS_OK


def _chosen_point(chosen: Mapping[str, Any] | None, method: str) -> tuple[float, float] | None:
    if not chosen or method not in chosen:
        return None
    c = chosen[method]
    if isinstance(c, Mapping):
        if "log10_n" in c and "log10_tau" in c:
            return float(c["log10_n"]), float(c["log10_tau"])
        if "n" in c and "tau" in c:
            return math.log10(float(c["n"])), math.log10(float(c["tau"]))
        raise ValueError(f"chosen[{method!r}] needs log10_n/log10_tau or n/tau, got keys {sorted(c)}")
    if isinstance(c, Sequence) and len(c) == 2:
        return float(c[0]), float(c[1])
    raise ValueError(f"chosen[{method!r}] must be a dict or a (log10_n, log10_tau) pair, got {c!r}")


# --------------------------------------------------------------------------- loading helpers
def load_eval_metrics(output_uri: str, endpoint_url: str | None = None) -> dict[str, dict]:
    """``{method: metrics}`` from ``<output>/eval/<method>/metrics.json`` (DESIGN §4)."""
    eval_dir = storage.join(output_uri, "eval")
    out = {}
    for name in storage.listdir(eval_dir, endpoint_url):
        uri = storage.join(eval_dir, name, "metrics.json")
        if storage.exists(uri, endpoint_url):
            out[name] = storage.read_json(uri, endpoint_url)
    if not out:
        raise ValueError(f"no eval/<method>/metrics.json under {output_uri}")
    return {m: out[m] for m in order_methods(out)}


def read_search_table(uri: str, endpoint_url: str | None = None) -> list[dict[str, Any]]:
    """A Parquet search table (local or s3://) as row dicts (see :func:`search_rows`)."""
    import pyarrow.parquet as pq

    return search_rows(pq.read_table(io.BytesIO(storage.read_bytes(uri, endpoint_url))))


# --------------------------------------------------------------------------- figures
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
    mbm = _check_metrics(metrics_by_method)
    suffix, strategy, n_bins = _pick_variant(mbm, variant)
    vlabel = _variant_label(strategy, n_bins)
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
        ece = mbm[name].get(f"ece_{suffix}")
        ttl = method_label(name) + (f" — ECE {100 * ece:.2f}%" if _finite(ece) else "")
        ax.set_title(ttl, fontsize=10)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_aspect("equal", adjustable="box")
        ax.tick_params(labelsize=8)
        if i % ncols == 0:
            ax.set_ylabel("accuracy", fontsize=9)
        ax.set_xlabel("confidence", fontsize=9)
    handles = [Patch(color="#4c72b0", label="accuracy per bin"),
               Patch(facecolor=(0.87, 0.52, 0.32, 0.3), hatch="///", edgecolor="#c44e52", label="gap to diagonal"),
               Line2D([0], [0], ls="--", color="0.5", label="perfect calibration")]
    ax = fig.add_subplot(gs[nrows, :])
    ax.axhline(0.0, color="0.5", lw=1, ls="--")
    for i, name in enumerate(methods):
        pts = reliability_points(mbm[name], suffix)
        ax.plot([p["confidence"] for p in pts], [p["gap"] for p in pts], marker="o", ms=4, lw=1.6,
                color=_method_color(name, i), label=method_label(name))
    ax.set_xlim(0, 1)
    ax.set_xlabel("confidence (mean per bin)", fontsize=9)
    ax.set_ylabel("confidence − accuracy", fontsize=9)
    ax.set_title(f"Maddox et al. variant (Lee et al. Fig. 6), {vlabel}: above 0 = over-confident", fontsize=10)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(handles=handles + ax.get_legend_handles_labels()[0], loc="center left",
              bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    return _png(fig)


def render_entropy(metrics_by_method: Mapping[str, Mapping[str, Any]]) -> bytes:
    """PNG bytes of the in-distribution vs OOD normalised-entropy histograms (Lee et al. Fig. 7)."""
    mbm = _check_metrics(metrics_by_method)
    methods = list(mbm)
    nrows, ncols = _grid(len(methods))
    width, height = max(3.4 * ncols + 0.6, 8.0), 2.9 * nrows + 1.1
    fig = Figure(figsize=(width, height))
    fig.suptitle("Normalised predictive entropy H(p)/log C: in-distribution vs OOD", fontsize=12,
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
            dens = [c / total / (edges[k + 1] - edges[k]) for k, c in enumerate(counts)]
            ax.stairs(dens, edges, fill=True, alpha=0.45, color=color)
            ax.stairs(dens, edges, color=color, lw=1.2)
        if ood and _finite(ood.get("auroc")):
            ax.set_title(f"{method_label(name)} — AUROC {ood['auroc']:.3f}", fontsize=10)
        else:
            ax.set_title(f"{method_label(name)} — no OOD data", fontsize=10)
        ax.set_xlim(0, 1)
        ax.set_xlabel("normalised entropy", fontsize=9)
        if i % ncols == 0:
            ax.set_ylabel("density", fontsize=9)
        ax.tick_params(labelsize=8)
    for j in range(len(methods), nrows * ncols):
        axes[j // ncols][j % ncols].set_visible(False)
    fig.legend(handles=[Patch(color="#4c72b0", alpha=0.6, label="in-distribution (test set)"),
                        Patch(color="#c44e52", alpha=0.6, label="out-of-distribution")],
               loc="lower center", bbox_to_anchor=(0.5, 0.0), ncols=2, fontsize=9, frameon=False)
    return _png(fig)


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
    cols = list(dict.fromkeys(c for r in rows for c in r))
    named = [c for c in cols if c not in SEARCH_OBJECTIVES and _objective_info(c)]
    present = [c for c in ("nll", "accuracy") if any(r.get(c) is not None for r in rows)]
    present += [c for c in (named or ["ece"]) if any(r.get(c) is not None for r in rows)]
    present += [c for c in ("brier",) if any(r.get(c) is not None for r in rows)]
    if objectives is None:
        objectives = present[:3]
    else:
        bad = [o for o in objectives if not _objective_info(o)]
        if bad:
            raise ValueError(f"unknown objective(s) {bad}; valid: {list(SEARCH_OBJECTIVES)} or ece_<variant>")
    if not objectives:
        raise ValueError(f"search table has no objective column; expected one of {list(SEARCH_OBJECTIVES)}")
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
    for i, meth in enumerate(methods):
        mrows = [r for r in rows if r["method"] == meth and r["log10_n"] is not None and r["log10_tau"] is not None]
        star = _chosen_point(chosen, meth)
        for j, obj in enumerate(objectives):
            ax = axes[i][j]
            label, higher_better = _objective_info(obj)
            ok = [r for r in mrows if not _failed(r) and r.get(obj) is not None]
            bad = [r for r in mrows if _failed(r) or r.get(obj) is None]
            if ok:
                sc = ax.scatter([r["log10_n"] for r in ok], [r["log10_tau"] for r in ok], c=[r[obj] for r in ok],
                                cmap="viridis" if higher_better else "viridis_r", s=46, marker="s",
                                edgecolors="none")
                cb = fig.colorbar(sc, ax=ax, fraction=0.07, pad=0.03)
                cb.set_label(f"{label} ({'higher' if higher_better else 'lower'} is better)", fontsize=8)
                cb.ax.tick_params(labelsize=7)
            if bad:
                ax.scatter([r["log10_n"] for r in bad], [r["log10_tau"] for r in bad], marker="x", color="red",
                           s=40, lw=1.5)
            if star is not None:
                ax.scatter([star[0]], [star[1]], marker="*", s=260, color="gold", edgecolors="black", lw=1.0,
                           zorder=5)
            ax.set_title(f"{method_label(meth)} — {label}", fontsize=10)
            ax.set_xlabel("log10 N", fontsize=9)
            ax.set_ylabel("log10 τ", fontsize=9)
            ax.tick_params(labelsize=8)
            ax.margins(0.08)
    fig.legend(handles=[Line2D([0], [0], marker="s", ls="", color="#3b528b", label="evaluated configuration"),
                        Line2D([0], [0], marker="x", ls="", color="red", mew=1.5, label="failed configuration"),
                        Line2D([0], [0], marker="*", ls="", color="gold", mec="black", ms=13, label="chosen (N, τ)")],
               loc="lower center", bbox_to_anchor=(0.5, 0.0), ncols=3, fontsize=9, frameon=False)
    return _png(fig)


def plot_reliability(metrics_by_method: Mapping[str, Mapping[str, Any]], path: str, variant: str | None = None,
                     endpoint_url: str | None = None) -> None:
    """Write ``reliability.png`` (see :func:`render_reliability`) to ``path`` (local or s3://)."""
    storage.write_bytes_atomic(path, render_reliability(metrics_by_method, variant), endpoint_url)


def plot_entropy(metrics_by_method: Mapping[str, Mapping[str, Any]], path: str, endpoint_url: str | None = None) -> None:
    """Write ``entropy.png`` (see :func:`render_entropy`) to ``path`` (local or s3://)."""
    storage.write_bytes_atomic(path, render_entropy(metrics_by_method), endpoint_url)


def plot_hyper(search_table: Any, chosen: Mapping[str, Any] | None, path: str,
               objectives: Sequence[str] | None = None, endpoint_url: str | None = None) -> None:
    """Write ``hyper.png`` (see :func:`render_hyper`) to ``path`` (local or s3://)."""
    storage.write_bytes_atomic(path, render_hyper(search_table, chosen, objectives), endpoint_url)


# --------------------------------------------------------------------------- summary normalisation
def _opt_mapping(summary: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    v = summary.get(key)
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ValueError(f"run_summary[{key!r}] must be a mapping, got {type(v).__name__}")
    return v


def _count_with_parts(summary: Mapping[str, Any], key: str) -> tuple[int | None, dict[str, int]]:
    """An int, or a mapping of parts (summed); None when absent."""
    v = summary.get(key)
    if v is None:
        return None, {}
    if isinstance(v, bool) or not isinstance(v, (int, Mapping)):
        raise ValueError(f"run_summary[{key!r}] must be an int or a mapping of ints, got {type(v).__name__}")
    if isinstance(v, int):
        return v, {}
    parts = {}
    for k, x in v.items():
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"run_summary[{key!r}][{k!r}] must be an int, got {x!r}")
        parts[str(k)] = x
    return sum(parts.values()), parts


def _skipped(summary: Mapping[str, Any]) -> tuple[int | None, list[tuple[str, str]]]:
    v = summary.get("skipped_images")
    if v is None:
        return None, []
    if isinstance(v, int) and not isinstance(v, bool):
        return v, []
    if not isinstance(v, Mapping):
        raise ValueError(f"run_summary['skipped_images'] must be an int or a mapping, got {type(v).__name__}")
    parts = [v] if "count" in v else list(v.values())
    total, examples = 0, []
    for p in parts:
        if not isinstance(p, Mapping) or "count" not in p:
            raise ValueError("run_summary['skipped_images'] needs {'count', 'examples'} (or a mapping of those)")
        total += int(p["count"])
        for e in p.get("examples", ()):
            if isinstance(e, Mapping):
                examples.append((str(e.get("path", "")), str(e.get("reason", ""))))
            else:
                examples.append((str(e), ""))
    return total, list(dict.fromkeys(examples))


def _failed_configs(summary: Mapping[str, Any], rows: list[dict[str, Any]]) -> tuple[int | None, list[dict]]:
    v = summary.get("failed_search_configs")
    failed_rows = [r for r in rows if _failed(r)]
    if v is None:
        return (len(failed_rows) if rows else None), failed_rows
    if isinstance(v, int) and not isinstance(v, bool):
        return v, failed_rows
    if isinstance(v, Sequence) and not isinstance(v, (str, bytes)):
        return len(v), [dict(r) for r in v]
    raise ValueError(f"run_summary['failed_search_configs'] must be an int or a list, got {type(v).__name__}")


def _sizes(summary: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for meth, s in _opt_mapping(summary, "posterior_sizes").items():
        if isinstance(s, (int, float)) and not isinstance(s, bool):
            s = {"numbers": int(s)}
        if not isinstance(s, Mapping):
            raise ValueError(f"run_summary['posterior_sizes'][{meth!r}] must be a dict with 'numbers'/'mb'")
        num = s.get("numbers")
        mb = s.get("mb")
        if mb is None and _finite(num):
            mb = num * BYTES_PER_NUMBER / MB
        out[str(meth)] = {"numbers": num, "mb": mb, "note": s.get("note") or ""}
    return out


def _model_name(summary: Mapping[str, Any]) -> str:
    m = summary.get("model")
    if isinstance(m, Mapping):
        return str(m.get("name") or m.get("arch") or "model")
    return str(m) if m else "model"


# --------------------------------------------------------------------------- formatting
def _fmt(v: Any, kind: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    if kind == "pct":
        return f"{100 * v:.2f}%"
    if kind == "int":
        return f"{int(v):,}"
    if kind == "mb":
        return f"{v:,.1f}"
    if kind == "s":
        return f"{v:,.1f}"
    if kind == "3":
        return f"{v:.3f}"
    if kind == "2":
        return f"{v:.2f}"
    return f"{v:.4f}"


def _esc(s: Any) -> str:
    return html.escape(str(s), quote=True)


_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~])")


def _md(s: Any) -> str:
    """Markdown-escape a data string: ``& < >`` as HTML entities (no raw HTML can get through),
    other Markdown punctuation with backslashes (also safe inside table cells); newlines -> spaces."""
    return _MD_SPECIAL.sub(r"\\\1", html.escape(str(s), quote=False)).replace("\n", " ")


def _dump_config(cfg: Any) -> str:
    if cfg is None:
        return ""
    if isinstance(cfg, str):
        return cfg
    try:
        import yaml

        return yaml.safe_dump(json.loads(json.dumps(cfg, default=str)), sort_keys=False, allow_unicode=True)
    except ImportError:  # pragma: no cover - pyyaml is a dependency
        return json.dumps(cfg, indent=2, default=str)


# --------------------------------------------------------------------------- the page model
def _method_rows(mbm: Mapping[str, Mapping[str, Any]], summary: Mapping[str, Any]) -> tuple[list[str], list[list[str]], list[str], list[str]]:
    """Header cells and rows (plain strings) of the per-method table, plus its notes and methods."""
    methods = list(mbm)
    variants = []
    for d in mbm.values():
        for key, strat, nb in ece_variants(d):
            if (key, strat, nb) not in variants:
                variants.append((key, strat, nb))
    sizes = _sizes(summary)
    mt = _opt_mapping(summary, "method_timings")
    for k, v in mt.items():
        if not isinstance(v, Mapping):
            raise ValueError(f"run_summary['method_timings'][{k!r}] must be a mapping stage -> seconds")
    stages = order_stages({s for v in mt.values() for s in v})
    chosen = summary.get("chosen") or {}
    if not isinstance(chosen, Mapping):
        raise ValueError("run_summary['chosen'] must be a mapping method -> (log10_n, log10_tau)")
    has_ood = any(isinstance(d.get("ood"), Mapping) for d in mbm.values())
    header = ["Method", "Accuracy", "NLL"]
    header += [f"ECE ({_variant_label(s, nb)})" for _, s, nb in variants]
    header += ["Brier"]
    if has_ood:
        header += ["OOD AUROC", "Entropy in (mean)", "Entropy OOD (mean)"]
    else:
        header += ["Entropy (mean)"]
    header += ["Numbers stored", "Size (MB)", "Corr", "log10 N", "log10 τ"]
    header += [f"{s} (s)" for s in stages]
    rows = []
    notes = []
    est = False
    for name in methods:
        d = mbm[name]
        r = [method_label(name), _fmt(d.get("accuracy"), "pct"), _fmt(d.get("nll"), "4")]
        r += [_fmt(d.get(k), "pct") for k, _, _ in variants]
        r += [_fmt(d.get("brier"), "4")]
        mean_in, mean_out, is_est = ood_entropy_means(d)
        if has_ood:
            ood = d.get("ood") if isinstance(d.get("ood"), Mapping) else {}
            r += [_fmt(ood.get("auroc"), "3"), _fmt(mean_in, "3"),
                  ("≈" if is_est and mean_out is not None else "") + _fmt(mean_out, "3")]
            est = est or is_est
        else:
            r += [_fmt(mean_in, "3")]
        s = sizes.get(name, {})
        r += [_fmt(s.get("numbers"), "int"), _fmt(s.get("mb"), "mb")]
        corr = CORRELATIONS.get(name)
        r += ["—" if corr is None else ("yes" if corr else "no")]
        pt = _chosen_point(chosen, name)
        r += [_fmt(pt[0], "2") if pt else "—", _fmt(pt[1], "2") if pt else "—"]
        r += [_fmt(mt.get(name, {}).get(st), "s") for st in stages]
        rows.append(r)
        if s.get("note"):
            notes.append(f"{method_label(name)} size: {s['note']}")
    if variants:
        notes.insert(0, "ECE = Σ_b (n_b/N)|conf_b − acc_b| over right-closed confidence bins (lo, hi]; "
                        "the variants named in the header are not comparable with each other.")
    notes.append(f"Size: numbers stored × {BYTES_PER_NUMBER} bytes, MB = 2^20 bytes (Lee et al. 2020, Table 3). "
                 "Corr: whether the posterior models weight correlations.")
    if est:
        notes.append("≈: OOD mean entropy estimated from the metrics' histogram at bin centres "
                     "(error at most half a bin width).")
    return header, rows, notes, methods


def order_stages(stages: Iterable[str]) -> list[str]:
    stages = list(dict.fromkeys(stages))
    return [s for s in STAGE_ORDER if s in stages] + sorted(s for s in stages if s not in STAGE_ORDER)


def _counts(summary: Mapping[str, Any], rows: list[dict[str, Any]]) -> list[tuple[str, str, list[str]]]:
    """``[(label, value, detail lines)]`` of the data-quality / numerical counts."""
    out = []
    n, examples = _skipped(summary)
    out.append(("Skipped images (undecodable or unreadable)", _fmt(n, "int"),
                [f"{p} — {r}" if r else p for p, r in examples[:_EXAMPLES_SHOWN]]))
    for key, label in (("clipped_d_entries", "Clipped D entries (INF diagonal correction)"),
                       ("clamped_eigenvalues", "Clamped eigenvalues (tiny negatives set to 0)")):
        total, parts = _count_with_parts(summary, key)
        lines = [f"{k}: {v:,}" for k, v in parts.items() if v]
        clip = summary.get("inf_clipping") if key == "clipped_d_entries" else None
        if isinstance(clip, Mapping):
            lines.append(f"INF at the chosen N = {clip['n_data']:.3g}, τ = {clip['prior_precision']:.3g}: "
                         f"{clip['clipped_D_fraction']:.2%} of D clipped, diagonal relative error "
                         f"{clip['diag_rel_error']:.3g}")
        out.append((label, _fmt(total, "int"), lines))
    nf, failed = _failed_configs(summary, rows)
    lines = []
    for r in failed[:_EXAMPLES_SHOWN]:
        where = ", ".join(f"{k}={r[k]:.2f}" if isinstance(r.get(k), float) else f"{k}={r.get(k)}"
                          for k in ("log10_n", "log10_tau") if k in r)
        lines.append(f"{method_label(str(r.get('method', '?')))} ({where}): {r.get('reason') or r.get('status') or ''}")
    out.append(("Failed search configurations", _fmt(nf, "int"), lines))
    return out


def _kv(obj: Any) -> list[tuple[str, str]]:
    if obj is None:
        return []
    if isinstance(obj, Mapping):
        return [(str(k), v if isinstance(v, str) else json.dumps(v, default=str)) for k, v in obj.items()]
    return [("", str(obj))]


# --------------------------------------------------------------------------- HTML
_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0;color:#1d2433;background:#fff}
main{max-width:1320px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:1.6em;margin:.4em 0 .1em}h2{font-size:1.25em;margin:1.4em 0 .4em;border-bottom:1px solid #dde;padding-bottom:.2em}
h3{font-size:1.05em;margin:1em 0 .3em}
.meta{color:#556;font-size:.9em;margin:0 0 1em}
table{border-collapse:collapse;font-size:.86em;margin:.4em 0}
th,td{border:1px solid #ccd;padding:3px 6px;text-align:right;white-space:nowrap}
th{background:#eef1f6;text-align:center;white-space:normal;vertical-align:bottom;min-width:3.2em}td:first-child,th:first-child{text-align:left}
tbody tr:nth-child(even){background:#f8f9fb}
table.kv td{text-align:left;white-space:normal;word-break:break-all}table.kv td:first-child{font-weight:600;white-space:nowrap}
.scroll{overflow-x:auto}
.notes{font-size:.82em;color:#445;margin:.3em 0 1em;padding-left:1.2em}
figure{margin:1em 0 1.6em}figure img{max-width:100%;height:auto;border:1px solid #e3e6ec;display:block}
figcaption{font-size:.86em;color:#445;margin-top:.3em}
details{margin:.6em 0}summary{cursor:pointer;font-weight:600}
pre{background:#f5f6f8;border:1px solid #e3e6ec;padding:8px;overflow:auto;font-size:.8em;max-height:480px}
ul.counts li{margin:.25em 0}ul.counts ul{font-size:.85em;color:#445}code{font-size:.92em;word-break:break-all}
"""

_CAPTIONS = {
    "reliability": "Reliability: accuracy against confidence per bin with the gap to the diagonal shaded, "
                   "and the Maddox et al. (2019) variant (confidence − accuracy per bin, one line per method) "
                   "as in Lee et al. (2020), Figure 6.",
    "entropy": "Normalised predictive entropy of the in-distribution test set and the OOD set per method, "
               "OOD AUROC (entropy as the score) in each title; as in Lee et al. (2020), Figure 7.",
    "hyper": "Hyper-parameter search over (log10 N, log10 τ) per method and objective; red crosses: failed "
             "configurations, star: the chosen (N, τ); as in Lee et al. (2020), Figure 9.",
}


def _html_table(header: list[str], rows: list[list[str]], table_id: str | None = None,
                row_keys: list[str] | None = None) -> str:
    tid = f' id="{_esc(table_id)}"' if table_id else ""
    out = [f'<div class="scroll"><table{tid}><thead><tr>']
    out += [f"<th>{_esc(h)}</th>" for h in header]
    out.append("</tr></thead><tbody>")
    for i, r in enumerate(rows):
        key = f' data-key="{_esc(row_keys[i])}"' if row_keys else ""
        out.append(f"<tr{key}>" + "".join(f"<td>{_esc(c)}</td>" for c in r) + "</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def _html_kv(pairs: list[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    return ('<table class="kv"><tbody>'
            + "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in pairs)
            + "</tbody></table>")


def _html_figure(name: str, png: bytes, caption: str | None) -> str:
    data = base64.b64encode(png).decode("ascii")
    cap = caption if caption is not None else _CAPTIONS.get(name, name)
    return (f'<figure id="fig-{_esc(name)}"><img src="data:image/png;base64,{data}" alt="{_esc(name)} figure">'
            f"<figcaption>{_esc(cap)}</figcaption></figure>")


def _html_counts(counts: list[tuple[str, str, list[str]]]) -> str:
    out = ['<ul class="counts">']
    for label, value, lines in counts:
        out.append(f"<li><b>{_esc(label)}:</b> {_esc(value)}")
        if lines:
            out.append("<ul>" + "".join(f"<li><code>{_esc(x)}</code></li>" for x in lines) + "</ul>")
        out.append("</li>")
    out.append("</ul>")
    return "".join(out)


def _page(title: str, body: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{_esc(title)}</title><style>{_CSS}</style></head>\n<body><main>\n"
            + "\n".join(body) + "\n</main></body></html>\n")


def _title(summary: Mapping[str, Any]) -> str:
    return str(summary.get("title") or f"infoform report: {_model_name(summary)}")


def _meta_line(summary: Mapping[str, Any]) -> str:
    parts = []
    if summary.get("run_id"):
        parts.append(f"run {summary['run_id']}")
    parts.append(f"created {summary.get('created') or _dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")
    return " · ".join(parts)


def _stage_rows(summary: Mapping[str, Any]) -> list[list[str]]:
    t = _opt_mapping(summary, "timings")
    return [[s, _fmt(t[s], "s") if _finite(t[s]) else str(t[s])] for s in order_stages(t)]


def render_html(run_summary: Mapping[str, Any], metrics_by_method: Mapping[str, Mapping[str, Any]],
                search_table: Any = None, figures: Mapping[str, bytes] | None = None,
                failed: Sequence[str] = ()) -> str:
    """The self-contained report page (figures given as PNG bytes are inlined as data URIs);
    ``failed``: lines from :func:`split_failed`, listed under the table (``metrics_by_method``
    may then be empty)."""
    if not isinstance(run_summary, Mapping):
        raise ValueError(f"run_summary must be a mapping, got {type(run_summary).__name__}")
    mbm = _check_metrics(metrics_by_method, allow_empty=bool(failed))
    rows = search_rows(search_table)
    header, trows, notes, methods = _method_rows(mbm, run_summary)
    notes += [f"Evaluation failed, not in the table: {f}" for f in failed] + _search_notes(rows)
    body = [f"<h1>{_esc(_title(run_summary))}</h1>", f'<p class="meta">{_esc(_meta_line(run_summary))}</p>']
    body.append('<section id="run"><h2>Run</h2>')
    body.append("<h3>Model</h3>" + _html_kv(_kv(run_summary.get("model"))))
    if run_summary.get("data") is not None:
        body.append("<h3>Data</h3>" + _html_kv(_kv(run_summary.get("data"))))
    cfg = _dump_config(run_summary.get("config"))
    if cfg:
        body.append(f"<details><summary>Configuration (YAML)</summary><pre>{_esc(cfg)}</pre></details>")
    if run_summary.get("versions"):
        body.append("<details><summary>Versions</summary>" + _html_kv(_kv(_opt_mapping(run_summary, "versions")))
                    + "</details>")
    body.append("</section>")
    body.append('<section id="methods"><h2>Results per method</h2>')
    body.append(_html_table(header, trows, "methods-table", methods))
    body.append('<ul class="notes">' + "".join(f"<li>{_esc(n)}</li>" for n in notes) + "</ul>")
    srows = _stage_rows(run_summary)
    if srows:
        body.append("<h3>Time per stage (whole run)</h3>" + _html_table(["Stage", "Seconds"], srows, "stages-table"))
    body.append("</section>")
    if figures:
        body.append('<section id="figures"><h2>Figures</h2>')
        body += [_html_figure(n, png, None) for n, png in figures.items()]
        body.append("</section>")
    body.append('<section id="counts"><h2>Data and numerical issues</h2>')
    body.append(_html_counts(_counts(run_summary, rows)))
    body.append("</section>")
    return _page(_title(run_summary), body)


# --------------------------------------------------------------------------- Markdown
def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(_md(h) for h in header) + " |",
             "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(_md(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _md_kv(pairs: list[tuple[str, str]]) -> str:
    return "\n".join(f"- **{_md(k)}**: {_md(v)}" if k else f"- {_md(v)}" for k, v in pairs)


def _md_counts(counts: list[tuple[str, str, list[str]]]) -> str:
    out = []
    for label, value, lines in counts:
        out.append(f"- **{_md(label)}**: {_md(value)}")
        out += [f"  - {_md(x)}" for x in lines]
    return "\n".join(out)


def render_markdown(run_summary: Mapping[str, Any], metrics_by_method: Mapping[str, Mapping[str, Any]],
                    search_table: Any = None, figure_links: Mapping[str, str] | None = None,
                    failed: Sequence[str] = ()) -> str:
    """The report in Markdown; ``figure_links`` maps figure names to (relative) links;
    ``failed`` as in :func:`render_html`."""
    if not isinstance(run_summary, Mapping):
        raise ValueError(f"run_summary must be a mapping, got {type(run_summary).__name__}")
    mbm = _check_metrics(metrics_by_method, allow_empty=bool(failed))
    rows = search_rows(search_table)
    header, trows, notes, _ = _method_rows(mbm, run_summary)
    notes += [f"Evaluation failed, not in the table: {f}" for f in failed] + _search_notes(rows)
    out = [f"# {_md(_title(run_summary))}", "", f"_{_md(_meta_line(run_summary))}_", "", "## Run", "", "### Model", "",
           _md_kv(_kv(run_summary.get("model")))]
    if run_summary.get("data") is not None:
        out += ["", "### Data", "", _md_kv(_kv(run_summary.get("data")))]
    cfg = _dump_config(run_summary.get("config"))
    if cfg:
        fence = "~~~~" if "```" in cfg else "```"
        out += ["", "<details><summary>Configuration (YAML)</summary>", "", fence + "yaml",
                cfg.replace("~~~~", "~ ~ ~ ~").rstrip("\n"), fence, "", "</details>"]
    if run_summary.get("versions"):
        out += ["", "### Versions", "", _md_kv(_kv(_opt_mapping(run_summary, "versions")))]
    out += ["", "## Results per method", "", _md_table(header, trows), ""]
    out += [f"- {_md(n)}" for n in notes]
    srows = _stage_rows(run_summary)
    if srows:
        out += ["", "### Time per stage (whole run)", "", _md_table(["Stage", "Seconds"], srows)]
    if figure_links:
        out += ["", "## Figures", ""]
        for name, link in figure_links.items():
            out += [f"![{_md(name)}]({link.replace(' ', '%20').replace(')', '%29')})", "",
                    f"_{_md(_CAPTIONS.get(name, name))}_", ""]
    out += ["", "## Data and numerical issues", "", _md_counts(_counts(run_summary, rows)), ""]
    return "\n".join(out)


# --------------------------------------------------------------------------- writing
def _relative_link(output: str, uri: str) -> str:
    prefix = output.rstrip("/") + "/"
    return uri[len(prefix):] if uri.startswith(prefix) else uri


def _scored(rows: list[dict]) -> bool:
    """Whether any search row carries an objective value (failed configurations have none)."""
    return any(r.get(c) is not None for r in rows for c in SEARCH_OBJECTIVES)


def _search_notes(rows: list[dict]) -> list[str]:
    """One note when the search ran but no configuration could be scored (no search figure then)."""
    if not rows or _scored(rows):
        return []
    reasons = [str(r.get("reason")) for r in rows if r.get("reason")]
    why = f" (first reason: {reasons[0]})" if reasons else ""
    return [f"Search: none of the {len(rows)} (method, configuration) pairs could be scored{why}; "
            "no search figure. Widen or move the (N, τ) ranges (search.log10_n, search.log10_tau)."]


def _render_standard(mbm: Mapping[str, Mapping[str, Any]], summary: Mapping[str, Any], rows: list[dict],
                     skip: Iterable[str] = ()) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    skip = set(skip)
    if "reliability" not in skip:
        out["reliability"] = render_reliability(mbm)
    if "entropy" not in skip:
        out["entropy"] = render_entropy(mbm)
    if "hyper" not in skip and rows and _scored(rows):
        chosen = summary.get("chosen") if isinstance(summary.get("chosen"), Mapping) else None
        out["hyper"] = render_hyper(rows, chosen)
    return out


def write_report(output_dir_or_uri: str, run_summary: Mapping[str, Any],
                 metrics_by_method: Mapping[str, Mapping[str, Any]], search_table: Any = None,
                 figures: Mapping[str, str] | None = None, endpoint_url: str | None = None) -> dict[str, str]:
    """Write ``report.html``, ``report.md`` and ``figures/<name>.png`` under ``output_dir_or_uri``.

    ``figures`` maps figure names to existing PNG paths/URIs that are used (inlined, linked) as
    they are; the standard figures not given are rendered from the data (``hyper`` only when
    the search table has rows). Returns ``{"html", "md", <figure name>: uri}``.
    """
    if not isinstance(run_summary, Mapping):
        raise ValueError(f"run_summary must be a mapping, got {type(run_summary).__name__}")
    ok, failed = split_failed(metrics_by_method)
    mbm = _check_metrics(ok, allow_empty=bool(failed))
    rows = search_rows(search_table)
    if not isinstance(output_dir_or_uri, str) or not output_dir_or_uri.strip("/"):
        raise ValueError(f"output must be a directory path or URI, got {output_dir_or_uri!r}")
    out = output_dir_or_uri.rstrip("/")
    paths: dict[str, str] = {}
    pngs: dict[str, bytes] = {}
    given = dict(figures or {})
    rendered = _render_standard(mbm, run_summary, rows, skip=given) if mbm else {}
    for name in FIGURE_NAMES:
        if name in rendered:
            uri = storage.join(out, "figures", f"{name}.png")
            storage.write_bytes_atomic(uri, rendered[name], endpoint_url)
            paths[name], pngs[name] = uri, rendered[name]
        elif name in given:
            paths[name], pngs[name] = given[name], storage.read_bytes(given[name], endpoint_url)
    for name, uri in given.items():
        if name not in pngs:
            paths[name], pngs[name] = uri, storage.read_bytes(uri, endpoint_url)
    page = render_html(run_summary, mbm, rows, pngs, failed=failed)
    md = render_markdown(run_summary, mbm, rows, {n: _relative_link(out, u) for n, u in paths.items()}, failed=failed)
    paths["html"] = storage.join(out, "report.html")
    paths["md"] = storage.join(out, "report.md")
    storage.write_bytes_atomic(paths["html"], page.encode("utf-8"), endpoint_url)
    storage.write_bytes_atomic(paths["md"], md.encode("utf-8"), endpoint_url)
    return paths


# --------------------------------------------------------------------------- several models
_TABLE3_METHODS = ("diag", "kfac", "kfac_exact", "efb", "inf", "subnet")


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"


def render_comparison(per_model: Mapping[str, tuple[Mapping[str, Any], Mapping[str, Mapping[str, Any]]]]) -> bytes:
    """PNG bytes: grouped bars (one group per model, one bar per method) of NLL, ECE (first
    variant), OOD AUROC and posterior size in MB (log scale)."""
    models = list(per_model)
    methods = order_methods(m for _, mbm in per_model.values() for m in mbm)
    ece_key = None
    for _, mbm in per_model.values():
        for d in mbm.values():
            v = ece_variants(d)
            if v:
                ece_key = ece_key or v[0]
    panels = [("nll", "NLL (lower is better)"),
              (ece_key[0] if ece_key else None,
               f"ECE, {_variant_label(ece_key[1], ece_key[2])} (lower is better)" if ece_key else "ECE"),
              ("auroc", "OOD AUROC (higher is better)"), ("mb", "posterior size, MB (log scale)")]
    fig = Figure(figsize=(max(11.0, 2.2 * len(models) * 2 + 2), 7.0), layout="constrained")
    fig.suptitle("Comparison across models", fontsize=12)
    axes = fig.subplots(2, 2, squeeze=False).ravel()
    width = 0.8 / max(len(methods), 1)
    for ax, (key, label) in zip(axes, panels):
        for k, meth in enumerate(methods):
            xs, ys = [], []
            for i, model in enumerate(models):
                summary, mbm = per_model[model]
                if key == "mb":
                    v = _sizes(summary).get(meth, {}).get("mb")
                elif meth not in mbm or key is None:
                    v = None
                elif key == "auroc":
                    ood = mbm[meth].get("ood")
                    v = ood.get("auroc") if isinstance(ood, Mapping) else None
                else:
                    v = mbm[meth].get(key)
                if _finite(v):
                    xs.append(i - 0.4 + (k + 0.5) * width)
                    ys.append(v * 100 if key and key.startswith("ece_") else v)
            ax.bar(xs, ys, width=width, color=_method_color(meth, k), label=method_label(meth))
        ax.set_xticks(range(len(models)), [str(m) for m in models], fontsize=8)
        ax.set_title(label + (" [%]" if key and key.startswith("ece_") else ""), fontsize=10)
        ax.tick_params(labelsize=8)
        if key == "mb":
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    handles = [Patch(color=_method_color(m, k), label=method_label(m)) for k, m in enumerate(methods)]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(methods), 7), fontsize=9, frameon=False)
    return _png(fig)


def write_audit_report(output: str, per_model: Mapping[str, tuple[Mapping[str, Any], Mapping[str, Mapping[str, Any]]]],
                       search_tables: Mapping[str, Any] | None = None, title: str | None = None,
                       endpoint_url: str | None = None) -> dict[str, str]:
    """Several models in one comparison report: ``audit.html`` + ``audit.md`` under ``output``.

    ``per_model``: ``{model_name: (run_summary, metrics_by_method)}``; ``search_tables``:
    optional ``{model_name: search table}``. The page holds the Table-3-style size table
    (one row per model, numbers stored / MB / Corr per method), one metrics table with a row per
    (model, method), the comparison figure (``figures/comparison.png``), and per model its
    reliability / entropy (/ hyper) figures (``figures/<model>/<name>.png``) and counts.
    Returns ``{"html", "md", "comparison", "<model>/<figure>": uri, ...}``.
    """
    if not isinstance(per_model, Mapping) or not per_model:
        raise ValueError("per_model must be a non-empty mapping {model: (run_summary, metrics_by_method)}")
    checked: dict[str, tuple[Mapping[str, Any], dict[str, Mapping[str, Any]]]] = {}
    failed: list[str] = []  # "model/method: reason" of evaluations that did not finish
    for model, pair in per_model.items():
        if not (isinstance(pair, Sequence) and len(pair) == 2 and isinstance(pair[0], Mapping)
                and isinstance(pair[1], Mapping)):
            raise ValueError(f"per_model[{model!r}] must be a (run_summary dict, metrics_by_method dict) pair")
        ok, f = split_failed(pair[1], prefix=f"{model}/")
        failed += f
        checked[str(model)] = (pair[0], _check_metrics(ok) if ok else {})
    safe = {m: _safe_name(m) for m in checked}
    if len(set(safe.values())) != len(safe):
        raise ValueError(f"model names collide after making them path-safe: {safe}")
    if not isinstance(output, str) or not output.strip("/"):
        raise ValueError(f"output must be a directory path or URI, got {output!r}")
    out = output.rstrip("/")
    search_tables = dict(search_tables or {})
    paths: dict[str, str] = {}
    comp = render_comparison(checked)
    paths["comparison"] = storage.join(out, "figures", "comparison.png")
    storage.write_bytes_atomic(paths["comparison"], comp, endpoint_url)

    # Table 3: one row per model, (numbers, MB, corr) per method
    all_methods = order_methods(m for s, _ in checked.values() for m in _sizes(s))
    t3_methods = [m for m in all_methods if m != "map"]
    t3_header = ["Model"]
    for m in t3_methods:
        corr = CORRELATIONS.get(m)
        t3_header.append(f"{method_label(m)}: numbers (MB)" + ("" if corr is None else f", corr: {'yes' if corr else 'no'}"))
    t3_rows = []
    for model, (summary, _) in checked.items():
        sz = _sizes(summary)
        r = [model]
        for m in t3_methods:
            s = sz.get(m, {})
            r.append("—" if s.get("numbers") is None else f"{_fmt(s.get('numbers'), 'int')} ({_fmt(s.get('mb'), 'mb')})")
        t3_rows.append(r)
    # metrics: one row per (model, method)
    m_header, m_rows, m_keys, notes = None, [], [], []
    for model, (summary, mbm) in checked.items():
        header, rows, n, methods = _method_rows(mbm, summary)
        h = ["Model"] + header
        if m_header is None:
            m_header = h
        elif h != m_header:  # different columns (e.g. OOD only for some): align by header names
            m_header = m_header + [c for c in h if c not in m_header]
        for meth, r in zip(methods, rows):
            m_rows.append(dict(zip(h, [model] + r)))
            m_keys.append(f"{model}/{meth}")
        notes += [x for x in n if x not in notes]
    m_table = [[r.get(c, "—") for c in m_header] for r in m_rows]
    notes += [f"Evaluation failed, not in the table: {f}" for f in failed]

    page_title = title or "infoform comparison: " + ", ".join(checked)
    body = [f"<h1>{_esc(page_title)}</h1>",
            f'<p class="meta">{_esc(_meta_line({}))} · {len(checked)} models</p>',
            '<section id="sizes"><h2>Posterior sizes (Lee et al. 2020, Table 3)</h2>',
            _html_table(t3_header, t3_rows, "sizes-table", list(checked)),
            "</section>",
            '<section id="methods"><h2>Results per model and method</h2>',
            _html_table(m_header, m_table, "methods-table", m_keys),
            '<ul class="notes">' + "".join(f"<li>{_esc(n)}</li>" for n in notes) + "</ul></section>",
            '<section id="figures"><h2>Comparison</h2>',
            _html_figure("comparison", comp, "NLL, ECE, OOD AUROC and posterior size per model and method."),
            "</section>"]
    md = [f"# {_md(page_title)}", "", "## Posterior sizes (Lee et al. 2020, Table 3)", "", _md_table(t3_header, t3_rows),
          "", "## Results per model and method", "", _md_table(m_header, m_table), ""]
    md += [f"- {_md(n)}" for n in notes]
    md += ["", "## Comparison", "", f"![comparison]({_relative_link(out, paths['comparison'])})", ""]
    for model, (summary, mbm) in checked.items():
        rows = search_rows(search_tables.get(model))
        figs = _render_standard(mbm, summary, rows) if mbm else {}
        body.append(f'<section class="model" id="model-{_esc(safe[model])}"><h2>{_esc(model)}</h2>')
        body.append(_html_kv(_kv(summary.get("data")) if summary.get("data") is not None else []))
        cfg = _dump_config(summary.get("config"))
        if cfg:
            body.append(f"<details><summary>Configuration (YAML)</summary><pre>{_esc(cfg)}</pre></details>")
        md += [f"## {_md(model)}", ""]
        for name, png in figs.items():
            uri = storage.join(out, "figures", safe[model], f"{name}.png")
            storage.write_bytes_atomic(uri, png, endpoint_url)
            paths[f"{model}/{name}"] = uri
            body.append(_html_figure(name, png, None))
            md += [f"![{_md(model)} {name}]({_relative_link(out, uri)})", ""]
        counts = _counts(summary, rows)
        body.append(_html_counts(counts))
        md += [_md_counts(counts), ""]
        body.append("</section>")
    paths["html"] = storage.join(out, "audit.html")
    paths["md"] = storage.join(out, "audit.md")
    storage.write_bytes_atomic(paths["html"], _page(page_title, body).encode("utf-8"), endpoint_url)
    storage.write_bytes_atomic(paths["md"], "\n".join(md).encode("utf-8"), endpoint_url)
    return paths
