"""Run report: figures and one self-contained HTML page (+ the same content in Markdown), and
the audit page that compares several models.

One idea: turn plain data (the metrics dicts of :meth:`laplace_core.metrics.suite.MetricSuite.compute`,
the hyper-parameter search table, a run-summary dict) into figures and pages. Nothing here reads
models, posteriors or Ray objects, so every function is testable with synthetic dicts.

Modules, in the order the data flows:

- :mod:`~pipelines.report.methods`  method order, labels, colours, the "Corr" column (one small table)
- :mod:`~pipelines.report.load`     ``load_eval_metrics``, ``read_search_table`` from a run's output
- :mod:`~pipelines.report.inputs`   checks and normalises the inputs below
- :mod:`~pipelines.report.figures`  matplotlib PNG renderers (reliability, entropy, hyper, comparison)
- :mod:`~pipelines.report.page`     the page model: sections, tables, figures, key-value lists, counts
- :mod:`~pipelines.report.render`   the Jinja2 templates (``templates/``) -> HTML and Markdown
- :mod:`~pipelines.report.write`    ``write_report``, ``write_audit_report``

Inputs
------
``metrics_by_method``: ``{method: MetricSuite.compute() dict}``, methods e.g. ``"map"`` (the
deterministic baseline), ``"diag"``, ``"kfac"``, ``"kfac_exact"``, ``"efb"``, ``"inf"``, ``"subnet"``
(shown in that order, other names after them, alphabetically). A dict with ``status != "ok"``
is an evaluation that did not finish: listed under the table, not shown.

``search_table``: one row per (method, N, τ) configuration with columns ``method``, ``log10_n``,
``log10_tau``, objective columns (``nll``, ``ece``, ``accuracy``, ``brier``), ``status`` (``"ok"``
for a configuration that was evaluated; anything else is a failure) and ``reason``. Accepted as a
pandas DataFrame, a pyarrow Table, a list of row dicts or a dict of columns
(:func:`~pipelines.report.inputs.search_rows`).

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
                     (the ``"methods"`` part of ``laplace_core.posteriors.sizes.SizeReport.to_json()``)
    skipped_images   {"count": int, "examples": [{"path", "reason"} | str]}, or a mapping of such
                     dicts (e.g. {"pass1": ..., "pass2": ...}), which are summed
    clipped_d_entries, clamped_eigenvalues
                     int, or mapping[str, int] (per method / layer; the total is shown with the parts)
    inf_clipping     {"n_data", "prior_precision", "clipped_D_fraction", "diag_rel_error"}
    failed_search_configs
                     int or list of failed rows; default: counted from ``search_table``
    chosen           mapping[method, {"log10_n", "log10_tau"} | {"n", "tau"} | (log10_n, log10_tau)]

Conventions shown in the report: ECE names its variant (equal width / equal mass, bin count,
right-closed bins) everywhere it appears; sizes are in MB = 2^20 bytes at 4 bytes per number
(Lee et al. 2020, Table 3); the OOD mean entropy is estimated from the metrics' fixed-edge
histogram (bin centres, error <= half a bin width) unless the dict carries ``entropy_mean_out``.

Pages: ``report.html`` embeds the figures as ``data:image/png;base64`` URIs and its CSS inline; it
has no scripts and no external references. ``report.md`` links the PNGs by relative path
(``figures/<name>.png``). All writes go through :mod:`pipelines.storage.uris` (atomic; local or s3://).
"""
