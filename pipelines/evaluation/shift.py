"""The distribution-shift sweep: every method on the test split under ImageNet-C-style corruptions.

For each corruption ``c`` and severity ``s`` of ``evaluate.shift`` (:class:`pipelines.config.schema.ShiftSpec`),
the test split is decoded again with ``c`` at ``s`` applied to every image inside the Ray
Data decode tasks (before normalisation, each image's noise keyed by its path and the run's
evaluation seed: :mod:`pipelines.ingest.corruptions`, :func:`pipelines.ingest.batches.build_dataset`),
and :func:`pipelines.evaluation.evaluate.evaluate` scores MAP, every posterior at the search's
``(N, τ)`` and the ``temperature`` row on it, on the same actor engine, with the same
predictive, samples and ECE as the clean evaluation (one round of actors per ``(c, s)``).

Artifact per method, ``<output>/eval/<method>/shift.json``::

    {"method", "corruptions": [...], "severities": [...], "ece_variant", "seed",
     "metrics": {corruption: {severity: {"accuracy", "nll", "ece", "brier", "count"}}},
     "mean":    {severity: {"accuracy", "nll", "ece", "brier"}}}   # mean over the corruptions

(severities as strings, JSON keys). ``"mean"`` is the unweighted mean over the corruptions
at each severity, as uncertainty-baselines reports ImageNet-C NLL/ECE; a severity where a
method failed on some corruption has no mean (``null``) and the failure's reason in
``metrics``.
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from pipelines.evaluation.evaluate import evaluate
from pipelines.evaluation.runtime import EvalConfig, eval_uri
from pipelines.storage import uris as storage

__all__ = ["SHIFT_METRICS", "evaluate_shift", "shift_means", "shift_file"]

#: The metrics kept per (corruption, severity).
SHIFT_METRICS = ("accuracy", "nll", "ece", "brier")


def shift_file(output: str, method: str) -> str:
    """``<output>/eval/<method>/shift.json``."""
    return storage.join(eval_uri(output, method), "shift.json")


def shift_means(metrics: Mapping[str, Mapping[str, Mapping[str, Any]]], severities: Sequence[int]
                ) -> dict[str, dict[str, float] | None]:
    """Mean over the corruptions of each of :data:`SHIFT_METRICS`, per severity (None where a
    corruption at that severity has no result)."""
    out: dict[str, dict[str, float] | None] = {}
    for s in severities:
        rows = [metrics[c].get(str(s)) for c in metrics]
        if not rows or any(r is None or r.get("status", "ok") != "ok" for r in rows):
            out[str(s)] = None
            continue
        out[str(s)] = {k: sum(float(r[k]) for r in rows) / len(rows) for k in SHIFT_METRICS}
    return out


def evaluate_shift(
    model_spec: Any,
    posterior_uris: Mapping[str, str],
    test_source: Any,
    data_cfg: Any,
    cfg: EvalConfig,
    corruptions: Sequence[str],
    severities: Sequence[int],
    *,
    output: str | None = None,
    hyper: Mapping[str, Sequence[float]] | None = None,
    temperature: float | None = None,
    endpoint_url: str | None = None,
) -> dict[str, dict[str, Any]]:
    """The sweep (module docstring): ``test_source`` (a ``DatasetIndex`` of the test split)
    decoded with ``data_cfg`` under each ``(corruption, severity)``; returns ``method ->``
    the ``shift.json`` document, written under ``output`` when given."""
    from pipelines.ingest.batches import build_dataset
    from pipelines.ingest.corruptions import check_corruption

    corruptions, severities = list(corruptions), [int(s) for s in severities]
    for c in corruptions:
        for s in severities:
            check_corruption(c, s)
    per: dict[str, dict[str, dict[str, Any]]] = {}
    k, n, t0 = 0, len(corruptions) * len(severities), time.perf_counter()
    for c in corruptions:
        for s in severities:
            ds = build_dataset(test_source, data_cfg, corruption=(c, s, cfg.seed))
            res = evaluate(model_spec, posterior_uris, ds, None, cfg, hyper=hyper, temperature=temperature,
                           endpoint_url=endpoint_url)
            for m, r in res.items():
                row = {key: r.get(key) for key in (*SHIFT_METRICS, "count")}
                if r.get("status") != "ok":
                    row = {"status": "failed", "reason": r.get("reason", "")}
                per.setdefault(m, {}).setdefault(c, {})[str(s)] = row
            k += 1
            acc = res["map"].get("accuracy")
            print(f"[shift] {c} severity {s} ({k}/{n}): MAP accuracy "
                  f"{'failed' if acc is None else f'{acc:.3f}'}, {time.perf_counter() - t0:.0f} s", flush=True)
    out: dict[str, dict[str, Any]] = {}
    for m, metrics in per.items():
        doc = {"method": m, "corruptions": corruptions, "severities": severities,
               "ece_variant": f"ece_{cfg.ece_mode}_{cfg.ece_bins}", "seed": cfg.seed,
               "metrics": metrics, "mean": shift_means(metrics, severities)}
        out[m] = doc
        if output is not None:
            storage.write_json_atomic(shift_file(output, m), doc, endpoint_url)
    return out
