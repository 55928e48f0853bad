"""Write the reports: ``report.html`` + ``report.md`` + ``figures/`` of one run, and
``audit.html`` + ``audit.md`` comparing several models.

Each function checks its inputs, builds the page model once (:mod:`pipelines.report.page`),
renders the figures (:mod:`pipelines.report.figures`) and the two templates
(:mod:`pipelines.report.render`). All writes go through the run's store
(:class:`pipelines.storage.store.RunStore`: atomic; local or s3://).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

from pipelines.report.figures import FIGURE_NAMES, render_comparison, render_standard
from pipelines.report.inputs import check_metrics, search_rows, split_failed
from pipelines.report.page import build_audit_page, build_report_page, figure_ref, model_section
from pipelines.report.render import render_audit_html, render_audit_markdown, render_html, render_markdown
from pipelines.storage import uris as storage
from pipelines.storage.store import RunStore

__all__ = ["write_report", "write_audit_report"]


def _relative_link(output: str, uri: str) -> str:
    prefix = output.rstrip("/") + "/"
    return uri[len(prefix):] if uri.startswith(prefix) else uri


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"


def _output(output: Any) -> str:
    if not isinstance(output, str) or not output.strip("/"):
        raise ValueError(f"output must be a directory path or URI, got {output!r}")
    return output.rstrip("/")


def write_report(store: RunStore, run_summary: Mapping[str, Any],
                 metrics_by_method: Mapping[str, Mapping[str, Any]], search_table: Any = None,
                 figures: Mapping[str, str] | None = None, sections: Sequence[Any] = ()) -> dict[str, str]:
    """Write ``report.html``, ``report.md`` and ``figures/<name>.png`` under the store's output.
    ``sections`` (:class:`~pipelines.report.page.Section`) are shown after the OOD and
    selective-prediction tables (e.g. the history of a scheduled audit, :mod:`pipelines.report.history`).

    ``figures`` maps figure names to existing PNG paths/URIs that are used (inlined, linked) as
    they are; the standard figures not given are rendered from the data (``hyper`` only when
    the search table has rows). Methods whose ``metrics.json`` says ``status != "ok"`` are listed
    under the table. Returns ``{"html", "md", <figure name>: uri}``.
    """
    if not isinstance(run_summary, Mapping):
        raise ValueError(f"run_summary must be a mapping, got {type(run_summary).__name__}")
    ok, failed = split_failed(metrics_by_method)
    mbm = check_metrics(ok, allow_empty=bool(failed))
    rows = search_rows(search_table)
    out = _output(store.output)
    page = build_report_page(run_summary, mbm, rows, failed=failed)  # checks the summary before any write
    paths: dict[str, str] = {}
    pngs: dict[str, bytes] = {}
    given = dict(figures or {})
    rendered = render_standard(mbm, run_summary, rows, skip=given) if mbm else {}
    for name in FIGURE_NAMES:
        if name in rendered:
            uri = storage.join(out, "figures", f"{name}.png")
            store.write_bytes_atomic(uri, rendered[name])
            paths[name], pngs[name] = uri, rendered[name]
        elif name in given:
            paths[name], pngs[name] = given[name], store.read_bytes(given[name])
    for name, uri in given.items():
        if name not in pngs:
            paths[name], pngs[name] = uri, store.read_bytes(uri)
    page = dataclasses.replace(page, figures=[figure_ref(n, png=pngs[n], link=_relative_link(out, u))
                                              for n, u in paths.items()], practice=page.practice + list(sections))
    paths["html"] = storage.join(out, "report.html")
    paths["md"] = storage.join(out, "report.md")
    store.write_bytes_atomic(paths["html"], render_html(page).encode("utf-8"))
    store.write_bytes_atomic(paths["md"], render_markdown(page).encode("utf-8"))
    return paths


def write_audit_report(store: RunStore, per_model: Mapping[str, tuple[Mapping[str, Any], Mapping[str, Mapping[str, Any]]]],
                       search_tables: Mapping[str, Any] | None = None, title: str | None = None,
                       model_figures: Mapping[str, Mapping[str, str]] | None = None) -> dict[str, str]:
    """Several models in one comparison report: ``audit.html`` + ``audit.md`` under the store's output.

    ``per_model``: ``{model_name: (run_summary, metrics_by_method)}``; ``search_tables``:
    optional ``{model_name: search table}``. The page holds the Table-3-style size table
    (one row per model, numbers stored / MB / Corr per method), one metrics table with a row per
    (model, method), the comparison figure (``figures/comparison.png``), and per model its
    reliability / entropy (/ hyper) figures (``figures/<model>/<name>.png``) and counts.
    ``model_figures``: ``{model: {figure name: existing PNG URI}}`` shown in that model's section too
    (e.g. the scheduled audit's ``trend``, :mod:`pipelines.report.history`).
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
        checked[str(model)] = (pair[0], check_metrics(ok) if ok else {})
    safe = {m: _safe_name(m) for m in checked}
    if len(set(safe.values())) != len(safe):
        raise ValueError(f"model names collide after making them path-safe: {safe}")
    out = _output(store.output)
    search_tables = dict(search_tables or {})
    paths: dict[str, str] = {}
    comp = render_comparison(checked)
    paths["comparison"] = storage.join(out, "figures", "comparison.png")
    store.write_bytes_atomic(paths["comparison"], comp)
    sections = []
    for model, (summary, mbm) in checked.items():
        rows = search_rows(search_tables.get(model))
        figs = []
        for name, png in (render_standard(mbm, summary, rows) if mbm else {}).items():
            uri = storage.join(out, "figures", safe[model], f"{name}.png")
            store.write_bytes_atomic(uri, png)
            paths[f"{model}/{name}"] = uri
            figs.append(figure_ref(name, png=png, link=_relative_link(out, uri), alt=f"{model} {name}"))
        for name, uri in (model_figures or {}).get(model, {}).items():
            paths[f"{model}/{name}"] = uri
            figs.append(figure_ref(name, png=store.read_bytes(uri), link=_relative_link(out, uri),
                                   alt=f"{model} {name}"))
        sections.append(model_section(model, safe[model], summary, rows, figs))
    comparison = figure_ref("comparison", png=comp, link=_relative_link(out, paths["comparison"]),
                            caption="NLL, ECE, OOD AUROC and posterior size per model and method.")
    page = build_audit_page(checked, comparison, sections, failed=failed, title=title)
    paths["html"] = storage.join(out, "audit.html")
    paths["md"] = storage.join(out, "audit.md")
    store.write_bytes_atomic(paths["html"], render_audit_html(page).encode("utf-8"))
    store.write_bytes_atomic(paths["md"], render_audit_markdown(page).encode("utf-8"))
    return paths
