"""The history of a scheduled audit: ``<root>/history/*.parquet`` and the trend on the report
(docs/scheduled-audits.md).

Each run with ``schedule.history`` (``--history ROOT``) writes one row per (model, method): when
(UTC), the run's output URI, the model, the method, a fingerprint of the evaluation data (test
split and OOD set: location and listing), the run its fitted stages were read from, and every
headline metric (:data:`pipelines.report.verdict.METRICS`) with its 95% bootstrap interval
(``<metric>_lo``, ``<metric>_hi``) and the images behind it (``n``, ``n_ood``); each named OOD set's and
group's metrics as columns ``ood_auroc@<set or group>`` (and ``_lo`` / ``_hi``; issue 39).

The history is append-only: each run and model owns one immutable object,
``ROOT/history/<model>--<run folder>--<hash>.parquet`` (:func:`run_object_uri`), written once
with an atomic write (:func:`pipelines.storage.uris.write_bytes_atomic`: a local temporary file
and ``os.replace``; on S3 one PUT). No run reads or rewrites another run's object, so runs
appending at the same moment lose nothing; a re-submitted run writes the same name and so
replaces its own rows only. :func:`read_history` reads every object as one table. An older root
holding the single file ``ROOT/history.parquet`` is still read (its rows under the objects'), and
the first run that appends migrates it: one object per run and model, then the file is removed.

With two or more runs of the model in the history, the report shows :func:`render_trend` (each
metric over the runs, one line per method, the interval shaded) and a table of the change since the
first and since the previous run (:func:`trend_parts`).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import io
import re
from typing import Any, Mapping, Sequence

from pipelines.report.methods import method_color, method_label, order_methods
from pipelines.report.page import Section, Table
from pipelines.report.verdict import METRICS, metrics_of
from pipelines.storage import uris as storage

__all__ = ["HISTORY_FILE", "HISTORY_DIR", "history_uri", "history_dir", "run_object_uri", "data_fingerprint",
           "run_rows", "read_history", "append_run", "migrate_legacy", "render_trend", "trend_parts", "audit_trends"]

#: The single file of older roots (read, and migrated by the first run that appends).
HISTORY_FILE = "history.parquet"
#: The folder of the append-only history: one object per run and model.
HISTORY_DIR = "history"
_TEXT = ("run", "model", "method", "data_fingerprint", "reused_from")
_COUNTS = ("n", "n_ood", "test_images", "ood_images")


def history_uri(root: str) -> str:
    """The older single-file history (``<root>/history.parquet``)."""
    return storage.join(root, HISTORY_FILE)


def history_dir(root: str) -> str:
    """The folder of the append-only history (``<root>/history``)."""
    return storage.join(root, HISTORY_DIR)


def _slug(text: str, limit: int = 40) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._")[:limit] or "run"


def run_object_uri(root: str, run: str, model: str | None) -> str:
    """The object holding the rows of ``run`` (its output URI) and ``model``: readable parts and a
    hash of both, so two runs never share a name and a re-submitted run finds its own."""
    key = hashlib.sha256(f"{run}\0{model}".encode()).hexdigest()[:16]
    folder = str(run).rstrip("/").rsplit("/", 1)[-1]
    return storage.join(history_dir(root), f"{_slug(str(model))}--{_slug(folder)}--{key}.parquet")


def _schema():
    import pyarrow as pa

    fields = [pa.field("date", pa.timestamp("us", tz="UTC"))] + [pa.field(k, pa.string()) for k in _TEXT]
    fields += [pa.field(k, pa.int64()) for k in _COUNTS]
    for m in METRICS:
        fields += [pa.field(m.key, pa.float64()), pa.field(f"{m.key}_lo", pa.float64()),
                   pa.field(f"{m.key}_hi", pa.float64())]
    return pa.schema(fields)


def data_fingerprint(splits: Any) -> str:
    """The evaluation data's fingerprint: where the test split and the OOD set are, and their
    listings (relative paths and labels; a listing alone is the same for a copy of the images)."""
    ood = getattr(splits, "ood", None)
    parts = [splits.test] + ([o.index for o in getattr(splits, "oods", ())] or ([] if ood is None else [ood]))
    text = "|".join(f"{getattr(p, 'root', '')}:{p.fingerprint}" for p in parts)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


def run_rows(summary: Mapping[str, Any], splits: Any, when: _dt.datetime) -> list[dict[str, Any]]:
    """One row per evaluated method of a run summary (``run.json``'s shape)."""
    rows = []
    reused = (summary.get("reused") or {}).get("search")
    ood = getattr(splits, "ood", None)
    for method, head in (summary.get("results") or {}).items():
        if not isinstance(head, Mapping) or head.get("status") not in (None, "ok"):
            continue
        iv = head.get("intervals") if isinstance(head.get("intervals"), Mapping) else {}
        row: dict[str, Any] = {"date": when, "run": summary.get("output"),
                               "model": (summary.get("model") or {}).get("name"), "method": method,
                               "data_fingerprint": data_fingerprint(splits), "reused_from": reused,
                               "n": iv.get("n"), "n_ood": iv.get("n_ood"), "test_images": len(splits.test),
                               "ood_images": sum(len(o.index) for o in getattr(splits, "oods", ()))
                               or (None if ood is None else len(ood))}
        for m in metrics_of({method: head}):  # the headline metrics, then each OOD set's and group's
            ci = (iv.get("ci") or {}).get(m.key)
            lo, hi = (ci if isinstance(ci, (list, tuple)) and len(ci) == 2 else (None, None))
            row.update({m.key: _number(head.get(m.key)), f"{m.key}_lo": _number(lo), f"{m.key}_hi": _number(hi)})
        rows.append(row)
    return rows


def _merged_schema(fields: Sequence[Any] = ()):
    """The history's columns, plus the columns of an older layout (they stay)."""
    schema = _schema()
    for f in fields:
        if schema.get_field_index(f.name) < 0:
            schema = schema.append(f)
    return schema


def _table_bytes(rows: Sequence[Mapping[str, Any]], extra: Sequence[Any] = ()) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    named = sorted({k for r in rows for k in r if "@" in k})  # per OOD set / group (issue 39): float columns
    extra = [*extra, *(pa.field(k, pa.float64()) for k in named)]
    pq.write_table(pa.Table.from_pylist(list(rows), schema=_merged_schema(extra)), buf)
    return buf.getvalue()


def _read_legacy(root: str, store: Any):
    """The older single file as a pyarrow Table (None when absent)."""
    import pyarrow.parquet as pq

    try:
        return pq.read_table(io.BytesIO(storage.read_bytes(history_uri(root), store)))
    except FileNotFoundError:
        return None


def _read_objects(root: str, store: Any) -> list[Any]:
    """Every run object under ``<root>/history`` as a pyarrow Table (temporary files skipped)."""
    import pyarrow.parquet as pq

    folder = history_dir(root)
    names = [n for n in storage.listdir(folder, store) if n.endswith(".parquet") and not n.startswith(".")]
    raw = storage.read_many([storage.join(folder, n) for n in names], store)
    return [pq.read_table(io.BytesIO(b)) for b in raw.values()]


def read_history(root: str, store: Any = None):
    """Every row under ``root`` as one pyarrow Table in date order (None when there is none yet):
    the run objects, and the older single file's rows of the runs and models no object holds."""
    import pyarrow as pa

    legacy, tables = _read_legacy(root, store), _read_objects(root, store)
    rows = [r for t in tables for r in t.to_pylist()]
    if legacy is not None:
        held = {(r.get("run"), r.get("model")) for r in rows}
        rows = [r for r in legacy.to_pylist() if (r.get("run"), r.get("model")) not in held] + rows
    if legacy is None and not tables:
        return None
    extra = [f for t in ([legacy] if legacy is not None else []) + tables for f in t.schema]
    return pa.Table.from_pylist(sorted(rows, key=lambda r: r["date"]), schema=_merged_schema(extra))


def migrate_legacy(root: str, store: Any = None, log: Any = print) -> int:
    """Move an older ``<root>/history.parquet`` into one object per run and model (an object that
    exists already, a newer write of that run, is kept), then remove the file; returns the objects
    written (0: nothing to migrate). Safe to run by several runs at once: each writes the same
    objects, and a file already removed by another is no error."""
    legacy = _read_legacy(root, store)
    if legacy is None:
        return 0
    groups: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for r in legacy.to_pylist():
        groups.setdefault((r.get("run"), r.get("model")), []).append(r)
    written = 0
    for (run, model), rows in groups.items():
        uri = run_object_uri(root, str(run), model)
        if not storage.exists(uri, store):
            storage.write_bytes_atomic(uri, _table_bytes(rows, legacy.schema), store)
            written += 1
    storage.remove(history_uri(root), options=store)
    log(f"history: migrated {history_uri(root)} to {len(groups)} object(s) under {history_dir(root)}")
    return written


def append_run(root: str, summary: Mapping[str, Any], splits: Any, store: Any = None,
               when: _dt.datetime | None = None, log: Any = print) -> int:
    """Write the run's rows as its own object (replacing that object when the run was submitted
    before), after migrating an older single-file history; returns the rows now held."""
    new = run_rows(summary, splits, when or _dt.datetime.now(_dt.timezone.utc))
    model = (summary.get("model") or {}).get("name")
    migrate_legacy(root, store, log=log)
    uri = run_object_uri(root, str(summary.get("output")), model)
    storage.write_bytes_atomic(uri, _table_bytes(new), store)
    table = read_history(root, store)
    rows = table.to_pylist() if table is not None else []
    runs = len({r["run"] for r in rows if r.get("model") == model})
    log(f"history: {len(new)} row(s) of this run written to {uri} ({runs} run(s) of this model)")
    return len(rows)


def _runs(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The runs in date order (first appearance)."""
    out: list[str] = []
    for r in sorted(rows, key=lambda r: r["date"]):
        if r["run"] not in out:
            out.append(r["run"])
    return out


def _metrics(rows: Sequence[Mapping[str, Any]]):
    return [m for m in METRICS if any(_number(r.get(m.key)) is not None for r in rows)]


def render_trend(rows: Sequence[Mapping[str, Any]]) -> bytes:
    """PNG: each headline metric over the runs (x: run date), one line per method, interval shaded."""
    from matplotlib.figure import Figure

    runs = _runs(rows)
    dates = {r["run"]: r["date"] for r in rows}
    metrics = _metrics(rows)
    ncols = min(4, max(1, len(metrics)))
    nrows = -(-len(metrics) // ncols)
    fig = Figure(figsize=(3.6 * ncols + 1.6, 2.9 * nrows + 0.9))
    fig.subplots_adjust(left=0.07, right=0.84, bottom=0.16 / nrows, top=1 - 0.5 / (2.9 * nrows + 0.9),
                        wspace=0.35, hspace=0.55)
    methods = order_methods({r["method"] for r in rows})
    labels = [(dates[u].strftime("%Y-%m-%d") if hasattr(dates[u], "strftime") else str(dates[u]))
              + "\n" + str(u).rstrip("/").rsplit("/", 1)[-1] for u in runs]  # the date and the run's folder
    for k, m in enumerate(metrics):
        ax = fig.add_subplot(nrows, ncols, k + 1)
        for i, meth in enumerate(methods):
            by_run = {r["run"]: r for r in rows if r["method"] == meth}
            xs = [j for j, u in enumerate(runs) if u in by_run and _number(by_run[u].get(m.key)) is not None]
            if not xs:
                continue
            ys = [by_run[runs[j]][m.key] for j in xs]
            color = method_color(meth, i)
            ax.plot(xs, ys, marker="o", ms=3, color=color, label=method_label(meth))
            lo = [by_run[runs[j]].get(f"{m.key}_lo") for j in xs]
            hi = [by_run[runs[j]].get(f"{m.key}_hi") for j in xs]
            if all(_number(v) is not None for v in lo + hi):
                ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0)
        ax.set_title(f"{m.label} ({m.direction})", fontsize=9)
        ax.set_xticks(range(len(runs)), labels, rotation=30, fontsize=7, ha="right")
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(alpha=0.3)
    handles, names = fig.axes[0].get_legend_handles_labels() if fig.axes else ([], [])
    fig.legend(handles, names, loc="center right", fontsize=8, frameon=False)
    fig.suptitle(f"Headline metrics over {len(runs)} runs", fontsize=11)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _change_rows(rows: Sequence[Mapping[str, Any]], this_run: str) -> list[list[str]]:
    runs = _runs(rows)
    this = this_run if this_run in runs else runs[-1]
    idx = runs.index(this)
    first, prev = runs[0], runs[idx - 1] if idx > 0 else None
    out = []
    for meth in order_methods({r["method"] for r in rows}):
        by_run = {r["run"]: r for r in rows if r["method"] == meth}
        if this not in by_run:
            continue
        for m in _metrics(rows):
            v = _number(by_run[this].get(m.key))
            if v is None:
                continue

            def change(ref: str | None) -> str:
                w = None if ref is None or ref not in by_run else _number(by_run[ref].get(m.key))
                return "—" if w is None or ref == this else f"{m.delta(v, w)} (from {m.fmt(w)})"
            ci = [by_run[this].get(f"{m.key}_lo"), by_run[this].get(f"{m.key}_hi")]
            out.append([method_label(meth), m.label, m.fmt_ci(v, ci), change(prev), change(first)])
    return out


def trend_parts(root: str | None, output: str, model: str, store: Any = None) -> tuple[dict[str, str], list[Section]]:
    """The report's trend figure (written to ``<output>/figures/trend.png``) and change table, when
    the history holds two or more runs of ``model``; ``({}, [])`` otherwise."""
    table = read_history(root, store) if root else None
    rows = [r for r in (table.to_pylist() if table is not None else []) if r.get("model") == model]
    runs = _runs(rows)
    if len(runs) < 2:
        return {}, []
    from pipelines.storage.layout import figure_uri

    uri = figure_uri(output, "trend")
    storage.write_bytes_atomic(uri, render_trend(rows), store)
    section = Section(title=f"Over time: {len(runs)} runs in {history_dir(root)}",
                      table=Table(["Method", "Metric", "This run [95% CI]", "Since the previous run",
                                   "Since the first run"], _change_rows(rows, output), "trend-table"),
                      note=f"First run {runs[0]}; the figure 'trend' shows every run. A change is a difference of "
                           "point estimates on different data: compare it with the intervals.")
    return {"trend": uri}, [section]


def audit_trends(output: str, models: Sequence[str], store: Any = None) -> dict[str, dict[str, str]]:
    """``{model: {"trend": uri}}`` for the models of an audit whose own report drew a trend
    (``<output>/models/<model>/figures/trend.png``), for the audit page's model sections."""
    from pipelines.storage.layout import figure_uri, model_dir

    found = {m: figure_uri(model_dir(output, m), "trend") for m in models}
    return {m: {"trend": uri} for m, uri in found.items() if storage.exists(uri, store)}
