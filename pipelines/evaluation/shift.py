"""The distribution-shift sweep: every method on the test split under ImageNet-C-style corruptions.

For each corruption ``c`` and severity ``s`` of ``evaluate.shift`` (:class:`pipelines.config.schema.ShiftSpec`),
the test split is decoded again with ``c`` at ``s`` applied to every image inside the Ray
Data decode tasks (before normalisation, each image's noise keyed by its path and the run's
evaluation seed: :mod:`pipelines.ingest.corruptions`, :func:`pipelines.ingest.batches.build_dataset`),
and MAP, every posterior at the search's ``(N, τ)`` and the ``temperature`` row are scored on
it with the same predictive, samples and ECE as the clean evaluation
(:func:`pipelines.evaluation.evaluate.evaluate_shard`). One round of actors does the whole
sweep (:class:`ShiftWorker`: the model and posteriors are loaded once): actor ``i`` takes the
``i``-th ``streaming_split`` iterator of every corrupted dataset and evaluates them in turn;
the driver merges each dataset's accumulators over the actors.

Artifact per method, ``<output>/eval/<method>/shift.json``::

    {"method", "corruptions": [...], "severities": [...], "ece_variant", "seed",
     "metrics": {corruption: {severity: {"accuracy", "nll", "ece", "brier", "count"}}},
     "mean":    {severity: {"accuracy", "nll", "ece", "brier"}},   # mean over the corruptions
     "summary": {family | "all": {"accuracy", "nll", "ece", "brier", "ce_vs_map", "corruptions", "complete"}}}
     # + "mce_alexnet" in "all" for a complete sweep of a 1,000-class model

(severities as strings, JSON keys). ``"mean"`` is the unweighted mean over the corruptions
at each severity, as uncertainty-baselines reports ImageNet-C NLL/ECE; a severity where a
method failed on some corruption has no mean (``null``) and the failure's reason in
``metrics``. ``"summary"``: per ImageNet-C family and over all its corruptions run, the means
over corruptions and severities and the corruption error relative to MAP
(:mod:`pipelines.evaluation.shift_summary`).
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from pipelines.evaluation.actors import ActorProgress, run_actors
from pipelines.evaluation.chunks import valid_batches
from laplace_core.metrics.bootstrap import bootstrap_means
from pipelines.evaluation.evaluate import EvalWorker, evaluate_shard, merge_worker_results
from pipelines.evaluation.predictors import MAP, model_ref
from pipelines.evaluation.shift_summary import shift_summary
from pipelines.evaluation.runtime import EvalConfig, eval_uri
from pipelines.storage import uris as storage
from pipelines.storage.store import RunStore

__all__ = ["SHIFT_METRICS", "ShiftWorker", "evaluate_shift", "shift_means", "shift_file"]

#: The metrics kept per (corruption, severity).
SHIFT_METRICS = ("accuracy", "nll", "ece", "brier")


class ShiftWorker(EvalWorker):
    """Ray actor of the sweep: ``run(*shards)`` evaluates one shard of each corrupted dataset in
    turn and returns, per dataset, the JSON-able accumulators (as :class:`EvalWorker` does)."""

    def run(self, *shards: Any, actor_index: int = 0) -> dict[str, Any]:
        if self.init_error is not None:
            return {"init_error": self.init_error}
        out = []
        for j, shard in enumerate(shards):
            it, _ = valid_batches(shard, self.cfg.batch_size)
            it = self.watched(it)
            prog = ActorProgress("shift", actor_index, self.cfg, splits=(f"dataset {j + 1}/{len(shards)}",))
            acc, info = evaluate_shard(self.model, self.posteriors, it, None, self.cfg, progress=prog,
                                       temperature=self.temperature)
            out.append({"accumulators": {m: a.to_json() for m, a in acc.items()}, "seconds": info["seconds"],
                        "failed": info["failed"], "examples": info["examples"]})
        return {"datasets": out}


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
    store: RunStore = RunStore(),
    hyper: Mapping[str, Sequence[float]] | None = None,
    temperature: float | None = None,
) -> dict[str, dict[str, Any]]:
    """The sweep (module docstring): ``test_source`` (a ``DatasetIndex`` of the test split)
    decoded with ``data_cfg`` under each ``(corruption, severity)``; returns ``method ->``
    the ``shift.json`` document, written under the store's output when it has one."""
    from laplace_core.posteriors.methods import TEMPERATURE
    from pipelines.ingest.batches import build_dataset
    from pipelines.ingest.corruptions import check_corruption

    corruptions, severities = list(corruptions), [int(s) for s in severities]
    pairs = [(c, s) for c in corruptions for s in severities]
    for c, s in pairs:
        check_corruption(c, s)
    uris = dict(posterior_uris)
    methods = [MAP, *uris, *([TEMPERATURE] if temperature is not None else [])]
    t0 = time.perf_counter()
    datasets = [build_dataset(test_source, data_cfg, corruption=(c, s, cfg.seed)) for c, s in pairs]
    results = run_actors(ShiftWorker, (model_ref(model_spec), uris, dict(hyper) if hyper else None, cfg,
                                       store, temperature), datasets, cfg)
    per: dict[str, dict[str, dict[str, Any]]] = {}
    cells = []
    for j, (c, s) in enumerate(pairs):
        merged = merge_worker_results([r["datasets"][j] for r in results], methods, cfg)
        cells.append({m: e["accumulator"].per_image for m, e in merged.items() if e["failed"] is None})
        for m, e in merged.items():
            if e["failed"] is None:
                r = e["accumulator"].compute(cfg.ece_mode)
                row = {key: r.get(key) for key in (*SHIFT_METRICS, "count")}
            else:
                row = {"status": "failed", "reason": e["failed"]}
            per.setdefault(m, {}).setdefault(c, {})[str(s)] = row
        acc = per[MAP][c][str(s)].get("accuracy")
        print(f"[shift] {c} severity {s}: MAP accuracy {'failed' if acc is None else f'{acc:.3f}'}", flush=True)
    print(f"[shift] {len(pairs)} corrupted test sets evaluated in {time.perf_counter() - t0:.0f} s", flush=True)
    intervals = bootstrap_means(cells, cfg.bootstrap, cfg.seed, (MAP, TEMPERATURE), ece_bins=cfg.ece_bins,
                                ece_mode=cfg.ece_mode)
    imagenet_1k = model_ref(model_spec).get("num_classes") == 1000
    out: dict[str, dict[str, Any]] = {}
    for m, metrics in per.items():
        doc = {"method": m, "corruptions": corruptions, "severities": severities,
               "ece_variant": f"ece_{cfg.ece_mode}_{cfg.ece_bins}", "seed": cfg.seed,
               "metrics": metrics, "mean": shift_means(metrics, severities),
               "summary": shift_summary(metrics, per[MAP], severities, imagenet_1k), "intervals": intervals.get(m)}
        out[m] = doc
        if store.output is not None:
            store.write_json_atomic(shift_file(store.output, m), doc)
    return out
