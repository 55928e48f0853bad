"""The job: ``curvature -> posterior -> search -> evaluate -> report`` for one or several models.

Each stage ends by writing ``<output>/stages/<stage>.json`` (atomically): its summary and
a fingerprint of the settings it depends on. A stage whose marker exists with the same
fingerprint is skipped (``force`` redoes it), so a re-submitted job resumes where the
last one stopped; inside the curvature stage, each pass resumes from its newest checkpoint
(:mod:`pipelines.distributed`). A marker with a *different* fingerprint is an error:
the output already holds a run with other settings (use a new ``--output`` or
``--force STAGE``), never a silent mix. ``run.json`` is assembled from the markers, so a
fully skipped re-run reproduces it.

An audit (``models:`` with several entries) runs the same stages per model under
``<output>/models/<name>/`` and writes one comparison report (``audit.html`` + ``audit.md``,
:func:`pipelines.report.write.write_audit_report`) and a top-level ``run.json`` listing the models,
their outputs, posterior sizes and headline results.
"""
from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from pipelines.cli.counts import skipped_images, skipped_lines
from pipelines.cli.model_run import ModelRun, forget_placement, read_search
from pipelines.ingest.plan import DataPlan, config_plan
from pipelines.cli.stages import fingerprint, log
from pipelines.config.load import to_dict
from pipelines.config.schema import STAGES, ModelSpec, RunConfig
from pipelines.storage import layout
from pipelines.storage import uris as storage
from pipelines.storage.store import RunStore

__all__ = ["RunResult", "run", "verdict_lines"]




@dataclass(frozen=True)
class RunResult:
    output: str
    report_path: str
    summary: dict[str, Any]


def _versions() -> dict[str, str]:
    import ray
    import torch
    import torchvision

    import laplace_core

    return {"python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
            "ray": ray.__version__, "infoform": laplace_core.__version__}


def _run_model(cfg: RunConfig, spec: ModelSpec, store: RunStore, plan: DataPlan,
               ensure_ray: Callable[[], None]) -> dict[str, Any]:
    """All stages for one model under ``store``'s output; returns the run summary (also written as run.json)."""
    t_start = time.perf_counter()
    model_run = ModelRun(cfg, spec, store, plan, ensure_ray)
    stages = model_run.run_all()
    summary = _summary(cfg, model_run.spec, model_run.model_info, model_run.data_info, model_run.results, store)
    summary["timings"]["total_this_run"] = time.perf_counter() - t_start
    summary["reused"] = model_run.reuse.reused  # stage -> the earlier run it was read from (pipelines.cli.reuse)
    for line in skipped_lines(summary["skipped_images"]):
        log(line)
    if stages.evaluate.summary is not None:
        if cfg.schedule.history:  # one row per method in <history>/history/ (its own object), before the report's trend
            from pipelines.report.history import append_run

            append_run(cfg.schedule.history, summary, model_run.splits, model_run.store.options, log=log)
        model_run.report(stages.evaluate, summary)
    store.write_json_atomic(store.run_json_uri(), _stable_run_json(summary))
    return summary


def _inf_clipping(posteriors: dict[str, Any], chosen: dict[str, Any], store: RunStore) -> dict[str, Any] | None:
    """INF's clipped ``D`` entries and diagonal error at the chosen ``(N, τ)`` (None without both)."""
    uri, c = (posteriors.get("inf") or {}).get("uri"), chosen.get("inf")
    if not uri or not c:
        return None
    from pipelines.passes.posterior import inf_clipping_at

    try:
        return inf_clipping_at(uri, 10.0 ** c["log10_n"], 10.0 ** c["log10_tau"], store)
    except Exception as e:  # a report detail: never fail the run over it
        log(f"INF clipping at the chosen (N, tau) not computed: {type(e).__name__}: {e}")
        return None


def _temperature(fit: dict[str, Any] | None) -> dict[str, Any] | None:
    """The temperature fit the report shows: ``T`` used, the fit's ``T`` and the fallback line."""
    if not fit:
        return None
    from pipelines.evaluation.temperature import with_fallback

    fit = with_fallback(fit) if "fallback" not in fit else fit
    return {k: fit.get(k) for k in ("temperature", "temperature_fit", "fallback", "count", "errors", "note")}


def _summary(cfg: RunConfig, spec: ModelSpec, model_info, data_info, results: dict[str, Any], store: RunStore):
    curv = results.get("curvature") or {}
    post = results.get("posterior") or {}
    srch = results.get("search") or {}
    evl = results.get("evaluate") or {}
    posteriors = post.get("posteriors") or {}
    sizes = {m: {"numbers": p.get("num_stored"), "note": f"rank {cfg.posterior.rank}" if m == "inf" else
                 f"S = {p.get('subnet_size')} of {p.get('d_total')} weights" if m == "subnet" else ""}
             for m, p in posteriors.items()}
    skipped = skipped_images(results)
    chosen = {m: {"log10_n": c_["log10_n"], "log10_tau": c_["log10_tau"]}
              for m, c_ in (srch.get("chosen") or {}).items() if c_}
    if (posteriors.get("inf") or {}).get("uri") and chosen.get("inf"):
        log("summary: INF's clipped D entries at the chosen (N, tau) (loads the INF posterior)")
    inf_clip = _inf_clipping(posteriors, chosen, store)
    return {
        "title": f"infoform report: {spec.name}" + (" (demo)" if cfg.data.demo else ""),
        "run_id": fingerprint(to_dict(cfg))[:8],
        "config": to_dict(cfg),
        "model": model_info,
        "data": data_info,
        "versions": _versions(),
        "timings": {s: (results.get(s) or {}).get("seconds") for s in STAGES if results.get(s)},
        "posterior_sizes": sizes,
        "skipped_images": skipped,
        "ignored_files": (data_info or {}).get("ignored_files", {}),
        "clipped_d_entries": {m: int(p.get("clipped_D", 0) or 0) for m, p in posteriors.items()}
        | ({"inf": inf_clip["clipped_D"]} if inf_clip else {}),
        "inf_clipping": inf_clip,
        "clamped_eigenvalues": int(curv.get("clamped_eigenvalues", 0) or 0),
        "failed_search_configs": int(srch.get("failed", 0) or 0),
        "chosen": chosen,
        "curvature": {k: curv.get(k) for k in ("count", "efb_count", "num_workers", "use_gpu", "allreduce_s",
                                               "allreduce_bytes", "computed_partitions", "reused_partitions",
                                               "excluded", "skipped_batches", "passes")}
        | ({"subnet": curv["subnet"]} if "subnet" in curv else {}),
        "search": {"chosen": srch.get("chosen"), "notes": srch.get("notes"),
                   "against_map": srch.get("against_map"), "not_better_than_map": srch.get("not_better_than_map") or {},
                   "device": (srch.get("info") or {}).get("device")}
        | {k: (srch.get("info") or {}).get(k) for k in ("scheduler", "algorithm", "image_samples",
                                                          "image_samples_full", "wall_s")},
        "temperature": _temperature(srch.get("temperature")),
        "evaluate": {"device": evl.get("device")},
        "results": evl.get("methods"),
        "output": store.output,
    }


def verdict_lines(summary: dict[str, Any]) -> list[str]:
    """The report's summary in a few lines for the end of the log: MAP's test numbers, then the
    verdict's sentences (:func:`pipelines.report.verdict.verdict_sentences`), then the data counts."""
    from pipelines.report.verdict import METRICS, verdict_sentences

    results = summary.get("results") or {}
    if not isinstance(results.get("map"), dict):
        return []
    m = results["map"]
    shown = [f"{x.label} {x.shown_for([m[x.key]]).fmt(m[x.key])}" for x in METRICS[:5] if isinstance(m.get(x.key), (int, float))]
    n = ((summary.get("data") or {}).get("test") or {}).get("num_files")
    lines = [f"verdict: MAP on {n if n is not None else 'the'} test images: {', '.join(shown)}"]
    marks = (summary.get("search") or {}).get("not_better_than_map") or {}
    from pipelines.report.inputs import chance_line

    lines += [f"verdict: {s}" for s in [c for c in [chance_line(summary)] if c]
              + verdict_sentences(results, summary.get("posterior_sizes"), marks=marks)]
    skipped = sum(int(d.get("count", 0)) for d in (summary.get("skipped_images") or {}).values())
    ignored = sum(int(d.get("count", 0)) for d in (summary.get("ignored_files") or {}).values())
    failed = [k for k, r in results.items() if isinstance(r, dict) and r.get("status") not in (None, "ok")]
    lines.append(f"verdict: {skipped} image(s) skipped as undecodable, {ignored} non-image file(s) ignored"
                 + (f"; failed: {', '.join(failed)}" if failed else ""))
    return lines[:7 + len(marks)]


def _stable_run_json(summary: dict[str, Any]) -> dict[str, Any]:
    """run.json: the summary without the time of this particular invocation."""
    out = dict(summary)
    out["timings"] = {k: v for k, v in summary["timings"].items() if k != "total_this_run"}
    return out


def _quiet_ray_data() -> None:
    """Our own progress lines (images/s, ETA, stage times) replace Ray Data's per-operator
    progress bars, which flood a job log."""
    try:
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
    except Exception:  # pragma: no cover - older Ray without these knobs
        pass


def _absolute(uri: str | None) -> str | None:
    if not uri or storage.is_remote(uri) or uri.startswith("file://"):
        return uri
    return os.path.abspath(os.path.expanduser(uri))


def absolute_inputs(cfg: RunConfig) -> RunConfig:
    """Local input paths (data, OOD, labels CSV, weights files) made absolute on the driver:
    Ray Train workers and actors run in directories of their own, where ``my_model.pt`` is not."""
    from pipelines.ingest.models import RANDOM_WEIGHTS, is_enum_name

    def spec(m: ModelSpec) -> ModelSpec:
        w = m.weights
        if w is None or w == RANDOM_WEIGHTS or is_enum_name(w):
            return m
        return dataclasses.replace(m, weights=_absolute(w))

    data = dataclasses.replace(cfg.data, root=_absolute(cfg.data.root), ood=tuple(dataclasses.replace(o, uri=_absolute(o.uri)) for o in cfg.data.ood),
                               labels_csv=_absolute(cfg.data.labels_csv))
    return dataclasses.replace(cfg, data=data, model=spec(cfg.model), models=tuple(spec(m) for m in cfg.models))


# --------------------------------------------------------------------------- entry
def run(cfg: RunConfig, init_ray: Callable[[], None] | None = None) -> RunResult:
    """Run every requested stage for the configured model(s).

    ``init_ray`` connects to (or starts) Ray; it is called once, just before the first
    stage that needs the cluster, so a re-run whose stages are all done never starts Ray.
    Without it, Ray must already be initialised (or ``ray.init()`` is called).
    """
    cfg.validate()
    forget_placement()
    from pipelines.distributed.cluster import resolve_output

    # Ray workers do not share the driver's working directory: an absolute path, outside a
    # `ray job submit --working-dir` copy (pipelines.distributed.cluster.resolve_output)
    output = resolve_output(cfg.output)
    if output != cfg.output:
        cfg = dataclasses.replace(cfg, output=output)
    cfg = absolute_inputs(cfg)
    with _take_lease(output, cfg.storage_options()):  # one job per output, before any cluster work
        plan = config_plan(cfg, output)
        ensure_ray = _ray_starter(cfg, init_ray)
        store = RunStore.open(output, cfg.storage_options())  # the run's one store, handed to every stage and worker
        store.write_json_atomic(store.config_uri(), to_dict(cfg))
        models = cfg.all_models()
        if len(models) == 1:
            summary = _run_model(cfg, models[0], store, plan, ensure_ray)
            report = layout.report_uris(output)["html"]
            return RunResult(output=output, report_path=report, summary=summary)
        return _run_audit(cfg, models, store, plan, ensure_ray)


def _take_lease(output: str, options: Any):
    """The lease on ``output`` (:mod:`pipelines.storage.lease`), its heartbeat running; a fresh
    lease of another job is a :class:`PreflightError` (one line, exit code 2)."""
    from pipelines.errors import PreflightError
    from pipelines.storage.lease import LeaseHeld, acquire

    try:
        return acquire(output, options, log=log).start()
    except LeaseHeld as e:
        raise PreflightError(str(e)) from None


def _ray_starter(cfg: RunConfig, init_ray: Callable[[], None] | None) -> Callable[[], None]:
    """``ensure_ray()``: connects to (or starts) Ray on its first call and says the cluster's
    shape, checking the local paths against it; later calls do nothing."""
    started = []

    def ensure_ray() -> None:
        if started:
            return
        started.append(True)
        import ray

        if not ray.is_initialized():  # a local instance takes 10-40 s to start on a small machine
            log("cluster: connecting to Ray (starting a local instance when no address is given)")
        if init_ray is not None:
            init_ray()
        elif not ray.is_initialized():
            ray.init()
        _quiet_ray_data()
        from pipelines.distributed.cluster import check_paths, cluster_shape

        shape = cluster_shape()
        log(f"cluster: {shape.nodes} node(s), {shape.cpus:g} CPUs, {shape.gpus:g} GPUs "
             f"({shape.driver_node_cpus:g} CPUs beside the driver)")
        check_paths(cfg, shape)  # local paths on several nodes: one line, before any pass

    return ensure_ray


def _run_audit(cfg: RunConfig, models, store: RunStore, plan: DataPlan, ensure_ray: Callable[[], None]) -> RunResult:
    """Every model under ``models/<name>/`` (:meth:`RunStore.for_model`), then the comparison
    report and the top-level run.json listing the models."""
    from pipelines.report.load import load_eval_metrics
    from pipelines.report.write import write_audit_report

    per_model, tables, listing = {}, {}, {}
    for spec in models:
        sub = store.for_model(spec.name)
        log(f"audit: model {spec.name} -> {sub.output}")
        summary = _run_model(cfg, spec, sub, plan, ensure_ray)
        listing[spec.name] = {k: summary.get(k) for k in ("output", "model", "results", "posterior_sizes", "chosen")}
        if summary.get("results") is None:  # evaluate not run (--stages): nothing to compare for this model
            continue
        per_model[spec.name] = (summary, load_eval_metrics(sub))
        reused = (summary.get("reused") or {}).get("search")  # a scheduled audit's origin (pipelines.cli.reuse)
        tables[spec.name] = read_search(sub.at(reused) if reused else sub)
    audit = {"preset": cfg.preset, "config": to_dict(cfg), "models": listing, "report": None}
    paths = {}
    if per_model:
        from pipelines.report.history import audit_trends

        paths = write_audit_report(store, per_model, search_tables=tables,
                                   model_figures=audit_trends(store.output, list(per_model), store.options))
        audit["report"] = {"html": paths["html"], "md": paths["md"]}
        audit["figures"] = {k: v for k, v in paths.items() if k not in ("html", "md")}
    else:
        log("audit: no model has evaluation results yet; no comparison report written")
    store.write_json_atomic(store.run_json_uri(), audit)
    # without a comparison (no model evaluated yet) the run.json listing is what there is to show
    return RunResult(output=store.output, report_path=paths.get("html", store.run_json_uri()), summary=audit)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use jobs/imagenet_inf.py or `infoform run`")
