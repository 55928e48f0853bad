"""The page model: what the report and the audit page show, as plain dataclasses of strings.

Built once from the run's metrics, summary and search table (:func:`build_report_page`) or from
several models' (:func:`build_audit_page`); the Jinja2 templates under ``templates/`` render the
same model to HTML and to Markdown (:mod:`pipelines.report.render`), so both formats show the
same sections, tables and numbers. Every cell is already formatted text here; escaping belongs
to the templates.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from pipelines.report.inputs import (BYTES_PER_NUMBER, chance_line, chosen_point, count_with_parts, ece_variants,
                                     failed_configs, is_finite, model_name, ood_entropy_means, opt_mapping,
                                     order_stages, posterior_sizes, scored, shows_predictive, skipped_images,
                                     temperature_line, timings_and_chosen, variant_label)
from pipelines.report.methods import CORRELATIONS, method_label, order_methods
from pipelines.report.edges import edge_notes
from pipelines.report.oodsets import OOD_SETS_NOTE, ood_sets_table
from pipelines.report.practice import OOD_NOTE, SELECTIVE_NOTE, ood_table, selective_table
from pipelines.report.verdict import paired_table, sample_line, summary_table, verdict_sentences

__all__ = ["CAPTIONS", "Table", "FigureRef", "Count", "ReportPage", "Section", "ModelSection", "AuditPage", "figure_ref",
           "build_report_page", "model_section", "build_audit_page"]

_EXAMPLES_SHOWN = 5
#: Caption per figure name (a figure without one is captioned with its name).
CAPTIONS = {
    "reliability": "Reliability: accuracy against confidence per bin with the gap to the diagonal shaded, the "
                   "95% (Wilson) interval of each bin's accuracy, and the per-bin counts (grey bars, right axis, "
                   "the number of images on top); below, the Maddox et al. (2019) variant (confidence − accuracy "
                   "per bin, one line per method) as in Lee et al. (2020), Figure 6.",
    "entropy": "Normalised predictive entropy of the in-distribution test set and the OOD set per method as "
               "overlaid empirical CDFs (both sets visible whatever their spread), OOD AUROC (entropy as the "
               "score) in each title; the data of Lee et al. (2020), Figure 7.",
    "risk_coverage": "Selective prediction: the error rate of the most confident images kept, against the share "
                     "kept (coverage), one line per method, AURC in the legend.",
    "shift": "Distribution shift (ImageNet-C-style corruptions of the test split, Hendrycks & Dietterich 2019): "
             "accuracy, NLL and ECE averaged over the corruptions, against severity, one line per method.",
    "trend": "A scheduled audit's headline metrics over its runs (the history under the audit root), one line per method with "
             "its 95% bootstrap interval shaded; the last point is this run.",
    "hyper": "Hyper-parameter search over (log10 N, log10 τ) per method and objective, the colour scale "
             "clipped to the 10–90% range of each panel (arrows on the colour bar when clipped); red crosses: "
             "failed configurations (when any), star: the chosen (N, τ); as in Lee et al. (2020), Figure 9.",
}
KeyValues = list[tuple[str, str]]


# --------------------------------------------------------------------------- the model
@dataclass
class Table:
    """A table of text cells; ``id`` and one ``keys`` entry per row become HTML attributes."""
    header: list[str]
    rows: list[list[str]]
    id: str | None = None
    keys: list[str] | None = None
    marked: list[tuple[int, int]] | None = None  # (row, column) cells shown bold: the best values


@dataclass
class FigureRef:
    """A figure: PNG bytes (inlined in HTML) and/or a link (Markdown), its caption and alt text."""
    name: str
    caption: str
    alt: str
    png: bytes | None = None
    link: str | None = None


@dataclass
class Count:
    """One data-quality or numerical count, with detail lines (examples, parts)."""
    label: str
    value: str
    lines: list[str] = field(default_factory=list)


@dataclass
class ReportPage:
    title: str
    meta: str
    model: KeyValues
    data: KeyValues | None  # None: no data section
    config: str  # YAML, "" for none
    versions: KeyValues
    methods: Table
    notes: list[str]
    stages: Table | None
    figures: list[FigureRef]
    counts: list[Count]
    summary: Table | None = None  # the verdict first: headline metrics with intervals
    verdict: list[str] = field(default_factory=list)
    sample: str = ""  # n, resamples, what "significant" means
    paired: Table | None = None  # paired differences against MAP and temperature scaling
    practice: list["Section"] = field(default_factory=list)  # OOD per score, selective prediction


@dataclass
class Section:
    """A titled table with a note (the OOD and selective-prediction tables)."""
    title: str
    table: Table
    note: str


@dataclass
class ModelSection:
    """One model of the audit page."""
    name: str
    anchor: str
    data: KeyValues
    config: str
    figures: list[FigureRef]
    counts: list[Count]


@dataclass
class AuditPage:
    title: str
    meta: str
    sizes: Table
    methods: Table
    notes: list[str]
    comparison: FigureRef
    models: list[ModelSection]
    summary: Table | None = None
    verdict: list[str] = field(default_factory=list)
    sample: str = ""  # the report's summary macro reads these; the audit's per-model pages carry them
    paired: Table | None = None


def figure_ref(name: str, png: bytes | None = None, link: str | None = None, caption: str | None = None,
               alt: str | None = None) -> FigureRef:
    """A :class:`FigureRef` captioned from :data:`CAPTIONS` unless given."""
    return FigureRef(name=name, caption=caption if caption is not None else CAPTIONS.get(name, name),
                     alt=alt if alt is not None else name, png=png, link=link)


# --------------------------------------------------------------------------- formatting
_FORMATS: dict[str, Callable[[Any], str]] = {
    "pct": lambda v: f"{100 * v:.2f}%", "int": lambda v: f"{int(v):,}", "mb": lambda v: f"{v:,.1f}",
    "s": lambda v: f"{v:,.1f}", "3": lambda v: f"{v:.3f}", "2": lambda v: f"{v:.2f}", "4": lambda v: f"{v:.4f}",
}


def _fmt(v: Any, kind: str) -> str:
    """``v`` as a table cell (kinds in :data:`_FORMATS`); "—" for a missing or non-finite number."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return _FORMATS[kind](v)


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


def _readable(v: Any) -> str:
    """A cell a reader reads: numbers as numbers, lists joined, nothing as JSON."""
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "no", None: "—"}[v]
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_readable(x) for x in v) if v else "—"
    return str(v)


def _kv(obj: Any, prefix: str = "") -> KeyValues:
    """Key/value rows; nested mappings become dotted keys (``train.num_files``)."""
    if obj is None:
        return []
    if not isinstance(obj, Mapping):
        return [("", str(obj))]
    return [row for k, v in obj.items() for row in _kv_entry(f"{prefix}{k}", v)]


def _kv_entry(key: str, v: Any) -> KeyValues:
    """The rows of one entry: a nested mapping (or list of mappings) under dotted keys, else one row."""
    if isinstance(v, Mapping) and v:
        return _kv(v, f"{key}.")
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, Mapping) for x in v):
        return [row for i, x in enumerate(v) for row in _kv(x, f"{key}[{i}].")]
    return [(key, v if isinstance(v, str) else _readable(v))]


def _summary(run_summary: Mapping[str, Any], model: str | None = None) -> tuple[Table | None, list[str]]:
    """The verdict-first summary table and sentences (:mod:`pipelines.report.verdict`), the
    temperature fallback line (the row fell back to ``T = 1``) or the fit's note (few mistakes) last."""
    results = run_summary.get("results")
    if not isinstance(results, Mapping) or not results:
        return None, []
    header, rows, marked, keys = summary_table(results)
    if not rows:
        return None, []
    notes = [line] if (line := temperature_line(run_summary.get("temperature"))) else []
    sentences = [c for c in [chance_line(run_summary)] if c] + verdict_sentences(
        results, run_summary.get("posterior_sizes") or {}, notes, marks(run_summary))
    return Table(header, rows, "summary-table", keys, marked), sentences


def _paired(run_summary: Mapping[str, Any]) -> tuple[Table | None, str]:
    """The paired-differences table and the line saying what the intervals rest on."""
    results = run_summary.get("results")
    if not isinstance(results, Mapping) or not results:
        return None, ""
    got = paired_table(results)
    table = None if got is None or not got[1] else Table(got[0], got[1], "paired-table", got[2])
    return table, sample_line(results)


def _practice(mbm: Mapping[str, Mapping[str, Any]]) -> list[Section]:
    """The OOD-per-score and selective-prediction tables (:mod:`pipelines.report.practice`)."""
    out = []
    for title, fn, note, tid in (("OOD sets and groups", ood_sets_table, OOD_SETS_NOTE, "ood-sets-table"),
                                 ("OOD detection per score", ood_table, OOD_NOTE, "ood-table"),
                                 ("Selective prediction", selective_table, SELECTIVE_NOTE, "selective-table")):
        got = fn(mbm)
        if got is not None:
            out.append(Section(title, Table(got[0], got[1], tid, got[2]), note))
    return out


def _title(summary: Mapping[str, Any]) -> str:
    return str(summary.get("title") or f"infoform report: {model_name(summary)}")


def _meta_line(summary: Mapping[str, Any]) -> str:
    parts = []
    if summary.get("run_id"):
        parts.append(f"run {summary['run_id']}")
    parts.append(f"created {summary.get('created') or _dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")
    return " · ".join(parts)


def _stage_rows(summary: Mapping[str, Any]) -> list[list[str]]:
    t = opt_mapping(summary, "timings")
    return [[s, _fmt(t[s], "s") if is_finite(t[s]) else str(t[s])] for s in order_stages(t)]


def marks(summary: Mapping[str, Any]) -> dict[str, str]:
    """``method -> "no configuration of <method> improved validation NLL over MAP (...)"`` of a run
    summary (run.json's ``search.not_better_than_map``; issue #38)."""
    srch = summary.get("search") if isinstance(summary.get("search"), Mapping) else {}
    got = srch.get("not_better_than_map")
    return {str(k): str(v) for k, v in got.items() if v} if isinstance(got, Mapping) else {}


# --------------------------------------------------------------------------- sections
def _method_rows(mbm: Mapping[str, Mapping[str, Any]], summary: Mapping[str, Any]) -> tuple[list[str], list[list[str]], list[str], list[str]]:
    """Header cells and rows (plain strings) of the per-method table, plus its notes and methods."""
    methods = list(mbm)
    variants = []
    for d in mbm.values():
        for key, strat, nb in ece_variants(d):
            if (key, strat, nb) not in variants:
                variants.append((key, strat, nb))
    sizes = posterior_sizes(summary)
    mt, stages, chosen = timings_and_chosen(summary)
    has_ood = any(isinstance(d.get("ood"), Mapping) for d in mbm.values())
    header = ["Method", "Accuracy", "NLL"]
    header += [f"ECE ({variant_label(s, nb)})" for _, s, nb in variants]
    header += ["Brier"]
    if has_ood:
        header += ["OOD AUROC", "Entropy in (mean)", "Entropy OOD (mean)"]
    else:
        header += ["Entropy (mean)"]
    header += ["Numbers stored", "Size (MB)", "Corr", "log10 N", "log10 τ"]
    show_pred = shows_predictive(summary, mbm)
    header += ["Predictive"] if show_pred else []
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
        pt = chosen_point(chosen, name)
        r += [_fmt(pt[0], "2") if pt else "—", _fmt(pt[1], "2") if pt else "—"]
        r += [str(d.get("pred_type") or "—") if pt else "—"] if show_pred else []
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


def _split_lines(skipped: Any) -> list[str]:
    """``split: n (pass a, pass b)`` per split of a per-split ``skipped_images`` mapping."""
    if not isinstance(skipped, Mapping) or "count" in skipped:
        return []
    return [f"{k}: {d['count']:,}" + (f" ({', '.join(f'{p} {c}' for p, c in d['passes'].items())})"
                                       if d.get("passes") else "")
            for k, d in skipped.items() if isinstance(d, Mapping) and d.get("count")]


def _counts(summary: Mapping[str, Any], rows: list[dict[str, Any]]) -> list[Count]:
    """The data-quality / numerical counts, with detail lines."""
    out = []
    n, examples = skipped_images(summary)
    out.append(Count("Skipped images (undecodable or unreadable)", _fmt(n, "int"),
                     _split_lines(summary.get("skipped_images"))
                     + [f"{p} — {r}" if r else p for p, r in examples[:_EXAMPLES_SHOWN]]))
    ignored = summary.get("ignored_files")
    if isinstance(ignored, Mapping):
        out.append(Count("Ignored files (not an image suffix; data.extensions adds suffixes)",
                         _fmt(sum(int(d.get("count", 0)) for d in ignored.values()), "int"),
                         [f"{k}: {d['count']:,} ({', '.join(map(str, d.get('examples', [])))}"
                          f"{', ...' if d['count'] > len(d.get('examples', [])) else ''})"
                          for k, d in ignored.items() if d.get("count")]))
    for key, label in (("clipped_d_entries", "Clipped D entries (INF diagonal correction)"),
                       ("clamped_eigenvalues", "Clamped eigenvalues (tiny negatives set to 0)")):
        total, parts = count_with_parts(summary, key)
        lines = [f"{k}: {v:,}" for k, v in parts.items() if v]
        clip = summary.get("inf_clipping") if key == "clipped_d_entries" else None
        if isinstance(clip, Mapping):
            lines.append(f"INF at the chosen N = {clip['n_data']:.3g}, τ = {clip['prior_precision']:.3g}: "
                         f"{clip['clipped_D_fraction']:.2%} of D clipped, diagonal relative error "
                         f"{clip['diag_rel_error']:.3g}")
        out.append(Count(label, _fmt(total, "int"), lines))
    nf, failed = failed_configs(summary, rows)
    lines = []
    for r in failed[:_EXAMPLES_SHOWN]:
        where = ", ".join(f"{k}={r[k]:.2f}" if isinstance(r.get(k), float) else f"{k}={r.get(k)}"
                          for k in ("log10_n", "log10_tau") if k in r)
        lines.append(f"{method_label(str(r.get('method', '?')))} ({where}): {r.get('reason') or r.get('status') or ''}")
    out.append(Count("Failed search configurations", _fmt(nf, "int"), lines))
    return out


def _search_notes(rows: list[dict]) -> list[str]:
    """One note when the search ran but no configuration could be scored (no search figure then)."""
    if not rows or scored(rows):
        return []
    reasons = [str(r.get("reason")) for r in rows if r.get("reason")]
    why = f" (first reason: {reasons[0]})" if reasons else ""
    return [f"Search: none of the {len(rows)} (method, configuration) pairs could be scored{why}; "
            "no search figure. Widen or move the (N, τ) ranges (search.log10_n, search.log10_tau)."]


# --------------------------------------------------------------------------- one run
def build_report_page(run_summary: Mapping[str, Any], mbm: Mapping[str, Mapping[str, Any]], rows: list[dict],
                      figures: Sequence[FigureRef] = (), failed: Sequence[str] = ()) -> ReportPage:
    """The report of one run: ``mbm`` checked metrics (:func:`~pipelines.report.inputs.check_metrics`),
    ``rows`` the search rows, ``failed`` the lines of :func:`~pipelines.report.inputs.split_failed`
    (listed under the table). Raises ``ValueError`` for a malformed ``run_summary``."""
    if not isinstance(run_summary, Mapping):
        raise ValueError(f"run_summary must be a mapping, got {type(run_summary).__name__}")
    header, trows, notes, methods = _method_rows(mbm, run_summary)
    notes += [f"Evaluation failed, not in the table: {f}" for f in failed] + _search_notes(rows)
    cfg = run_summary.get("config") if isinstance(run_summary.get("config"), Mapping) else {}
    chosen = run_summary.get("chosen") if isinstance(run_summary.get("chosen"), Mapping) else {}
    notes += [f"Search: {line}" for line in edge_notes(chosen, cfg.get("search"))]
    marked = marks(run_summary)
    notes += [f"Search: {line}; its test row is shown for reference, not as the method's improvement."
              for line in marked.values()]
    trows = [[r[0] + (" (not better than MAP on validation)" if m in marked else ""), *r[1:]]
             for m, r in zip(methods, trows)]
    srows = _stage_rows(run_summary)
    summary, verdict = _summary(run_summary)
    paired, sample = _paired(run_summary)
    return ReportPage(summary=summary, verdict=verdict, paired=paired, sample=sample, practice=_practice(mbm),
        title=_title(run_summary), meta=_meta_line(run_summary), model=_kv(run_summary.get("model")),
        data=_kv(run_summary.get("data")) if run_summary.get("data") is not None else None,
        config=_dump_config(run_summary.get("config")),
        versions=_kv(opt_mapping(run_summary, "versions")) if run_summary.get("versions") else [],
        methods=Table(header, trows, "methods-table", methods), notes=notes,
        stages=Table(["Stage", "Seconds"], srows, "stages-table") if srows else None,
        figures=list(figures), counts=_counts(run_summary, rows))


# --------------------------------------------------------------------------- several models
Models = Mapping[str, tuple[Mapping[str, Any], Mapping[str, Mapping[str, Any]]]]


def _sizes_table(models: Models) -> Table:
    """Lee et al. Table 3: one row per model, numbers stored (MB) per method, "Corr" in the header."""
    methods = [m for m in order_methods(m for s, _ in models.values() for m in posterior_sizes(s)) if m != "map"]
    header = ["Model"]
    for m in methods:
        corr = CORRELATIONS.get(m)
        header.append(f"{method_label(m)}: numbers (MB)" + ("" if corr is None else f", corr: {'yes' if corr else 'no'}"))
    rows = []
    for model, (summary, _) in models.items():
        sz = posterior_sizes(summary)
        r = [model]
        for m in methods:
            s = sz.get(m, {})
            r.append("—" if s.get("numbers") is None else f"{_fmt(s.get('numbers'), 'int')} ({_fmt(s.get('mb'), 'mb')})")
        rows.append(r)
    return Table(header, rows, "sizes-table", list(models))


def _methods_table(models: Models) -> tuple[Table, list[str]]:
    """One row per (model, method), columns aligned by header name; and the tables' notes."""
    header: list[str] | None = None
    rows: list[dict[str, str]] = []
    keys: list[str] = []
    notes: list[str] = []
    for model, (summary, mbm) in models.items():
        h, mrows, n, methods = _method_rows(mbm, summary)
        h = ["Model"] + h
        if header is None:
            header = h
        elif h != header:  # different columns (e.g. OOD only for some)
            header = header + [c for c in h if c not in header]
        for meth, r in zip(methods, mrows):
            rows.append(dict(zip(h, [model] + r)))
            keys.append(f"{model}/{meth}")
        notes += [x for x in n if x not in notes]
    header = header or []
    return Table(header, [[r.get(c, "—") for c in header] for r in rows], "methods-table", keys), notes


def _audit_summary(models: Models) -> tuple[Table | None, list[str]]:
    """One summary table for every model (rows ``model · metric``) and each model's sentences."""
    header: list[str] | None = None
    rows: list[list[str]] = []
    marked: list[tuple[int, int]] = []
    keys: list[str] = []
    verdict: list[str] = []
    for model, (summary, _) in models.items():
        t, sentences = _summary(summary)
        if t is None:
            continue
        h = ["Model · metric"] + t.header[1:]
        if header is None:
            header = h
        elif h != header:  # other methods for this model: its own header row would be needed; align by name
            header = header + [c for c in h if c not in header]
        for i, r in enumerate(t.rows):
            cells = dict(zip(h, [f"{model} · {r[0]}"] + r[1:]))
            rows.append(cells)  # type: ignore[arg-type]
            keys.append(f"{model}:{t.keys[i]}")
        marked += [(len(rows) - len(t.rows) + r, h[c]) for r, c in (t.marked or [])]  # type: ignore[misc]
        verdict += [f"{model}: {s}" for s in sentences]
    if header is None:
        return None, []
    table_rows = [[r.get(c, "—") for c in header] for r in rows]  # type: ignore[union-attr]
    marks = [(r, header.index(name)) for r, name in marked]  # type: ignore[arg-type]
    return Table(header, table_rows, "summary-table", keys, marks), verdict


def model_section(name: str, anchor: str, summary: Mapping[str, Any], rows: list[dict],
                  figures: Sequence[FigureRef]) -> ModelSection:
    """One model of the audit page: its data, configuration, figures and counts."""
    return ModelSection(name=name, anchor=anchor,
                        data=_kv(summary.get("data")) if summary.get("data") is not None else [],
                        config=_dump_config(summary.get("config")), figures=list(figures),
                        counts=_counts(summary, rows))


def build_audit_page(models: Models, comparison: FigureRef, sections: Sequence[ModelSection],
                     failed: Sequence[str] = (), title: str | None = None) -> AuditPage:
    """The comparison page of several models: ``models`` ``{name: (run_summary, checked metrics)}``,
    ``failed`` the ``"model/method: reason"`` lines of evaluations that did not finish."""
    methods, notes = _methods_table(models)
    notes += [f"Evaluation failed, not in the table: {f}" for f in failed]
    summary, verdict = _audit_summary(models)
    return AuditPage(summary=summary, verdict=verdict,title=title or "infoform comparison: " + ", ".join(models),
                     meta=f"{_meta_line({})} · {len(models)} models", sizes=_sizes_table(models), methods=methods,
                     notes=notes, comparison=comparison, models=list(sections))
