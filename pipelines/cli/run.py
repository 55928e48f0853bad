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
:func:`pipelines.report.report.write_audit_report`) and a top-level ``run.json`` listing the models,
their outputs, posterior sizes and headline results.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pipelines.storage import uris as storage
from pipelines.config.schema import STAGES, EvalSpec, ModelSpec, RunConfig, to_dict

__all__ = ["RunResult", "run", "stage_marker_uri"]

DEMO_NUM_CLASSES = 10


@dataclass(frozen=True)
class RunResult:
    output: str
    report_path: str
    summary: dict[str, Any]


# --------------------------------------------------------------------------- helpers
def _log(msg: str) -> None:
    print(f"[infoform {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stage_marker_uri(output: str, stage: str) -> str:
    return storage.join(output, "stages", f"{stage}.json")


def _endpoint(cfg: RunConfig) -> storage.StorageOptions:
    """The store settings (endpoint + s3fs options) handed explicitly to every stage."""
    return cfg.storage_options()


class _Stages:
    """Run-or-skip bookkeeping for one output folder."""

    def __init__(self, cfg: RunConfig, output: str, ensure_ray: Callable[[], None]):
        self.cfg = cfg
        self.output = output
        self.ep = _endpoint(cfg)
        self.ensure_ray = ensure_ray
        self.results: dict[str, Any] = {}

    def run(self, stage: str, fp_obj: Any, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        uri = stage_marker_uri(self.output, stage)
        fp = _fingerprint(fp_obj)
        if stage not in self.cfg.stages:
            if storage.exists(uri, self.ep):
                self.results[stage] = storage.read_json(uri, self.ep)["summary"]
                return self.results[stage]
            _log(f"stage {stage}: not requested (--stages) and no earlier result")
            return None
        if storage.exists(uri, self.ep) and stage not in self.cfg.force:
            marker = storage.read_json(uri, self.ep)
            if marker.get("fingerprint") != fp:
                raise ValueError(
                    f"{self.output} already holds a {stage} result made with other settings; "
                    f"use a new --output or --force {stage}"
                )
            _log(f"stage {stage}: done earlier, skipped ({uri})")
            self.results[stage] = marker["summary"]
            return marker["summary"]
        self.ensure_ray()  # connects and checks the cluster's shape before the stage starts
        _log(f"stage {stage}: running")
        t0 = time.perf_counter()
        summary = fn()
        summary = {**summary, "seconds": time.perf_counter() - t0}
        storage.write_json_atomic(uri, {"stage": stage, "fingerprint": fp, "summary": summary}, self.ep)
        _log(f"stage {stage}: finished in {summary['seconds']:.1f} s")
        self.results[stage] = summary
        return summary


# --------------------------------------------------------------------------- data
@dataclass(frozen=True)
class _DataPlan:
    root: str
    ood: str | None
    mean: tuple[float, float, float] | None
    std: tuple[float, float, float] | None
    demo: dict[str, Any] | None
    train_root: str | None = None  # the demo's local ImageFolder, where the demo CNN is trained


def _demo_dir(output: str) -> str:
    if storage.is_remote(output):
        return os.path.join(os.path.expanduser("~"), ".cache", "infoform", "demo")
    return storage.get_fs(output)[1]


def _publish_demo(cfg: RunConfig, local: str, remote: str, split: str | None) -> None:
    """Copy one split of the demo's local ImageFolder to ``remote`` as Parquet shards (the
    encoded JPEG bytes unchanged), unless the same data is there already: with a remote
    output the demo's images are read from the output, so that any node can read them."""
    from pipelines.ingest.data import PARQUET_META_FILE, DataConfig, convert_to_parquet, scan

    ep = _endpoint(cfg)
    index = scan(DataConfig(root=local, split=split, unlabeled=split is None,
                            extensions=(".jpg",) if split is None else None))
    meta_uri = storage.join(remote, PARQUET_META_FILE)
    if storage.exists(meta_uri, ep) and storage.read_json(meta_uri, ep).get("source_fingerprint") == index.fingerprint:
        return
    convert_to_parquet(index, remote, endpoint_url=None, out_endpoint_url=ep)


def _prepare_demo(cfg: RunConfig, output: str) -> _DataPlan:
    from pipelines.ingest.demo_data import NORMALIZE_MEAN, NORMALIZE_STD, write_digits_imagefolder, write_letters_ood

    base = Path(_demo_dir(output))
    digits = write_digits_imagefolder(base / "demo-data" / "digits", size=32, seed=0)
    letters = write_letters_ood(base / "demo-data" / "letters", size=32, n_per_letter=30, seed=0)
    root, ood = str(base / "demo-data" / "digits"), str(base / "demo-data" / "letters")
    if storage.is_remote(output):  # every node reads the demo from the output, not from this machine's disk
        remote = storage.join(output, "demo-data")
        for split in (cfg.data.train_split, cfg.data.val_split, cfg.data.test_split):
            if split:
                _publish_demo(cfg, root, storage.join(remote, "digits", split), split)
        _publish_demo(cfg, ood, storage.join(remote, "letters"), None)
        root, ood = storage.join(remote, "digits"), storage.join(remote, "letters")
        _log(f"demo data written to {remote} (Parquet), read from there by every node")
    return _DataPlan(
        root=root,
        ood=ood,
        mean=NORMALIZE_MEAN,
        std=NORMALIZE_STD,
        demo={"digits": root, "letters": ood, "classes": digits["classes"]},
        train_root=digits["root"],
    )


def _demo_model(cfg: RunConfig, plan: _DataPlan, output: str) -> tuple[ModelSpec, dict[str, Any]]:
    from pipelines.ingest.demo_data import train_small_cnn

    cache = Path(_demo_dir(output)) / "model"
    _, info = train_small_cnn(plan.train_root, epochs=8, seed=0, cache_path=cache, num_threads=1)
    weights = str(cache / "small_cnn.safetensors")
    if storage.is_remote(output):  # the workers and actors load the weights from the output
        remote = storage.join(output, "demo-model", "small_cnn.safetensors")
        data = Path(weights).read_bytes()
        ep = _endpoint(cfg)
        if not storage.exists(remote, ep) or storage.read_bytes(remote, ep) != data:
            storage.write_bytes_atomic(remote, data, ep)
        weights = remote
    info_d = dataclasses.asdict(info) if dataclasses.is_dataclass(info) else dict(info)
    return ModelSpec(name="demo_cnn", weights=weights, num_classes=DEMO_NUM_CLASSES), info_d


def _data_config(cfg: RunConfig, plan: _DataPlan, split: str | None, *, limit=None, per_class=None,
                 classes=None, unlabeled=False, root: str | None = None, extensions=None):
    from pipelines.ingest.data import DataConfig

    kw: dict[str, Any] = dict(
        root=root or plan.root,
        split=split,
        image_size=cfg.data.image_size,
        resize_size=cfg.data.resize_size,
        limit=limit,
        per_class=per_class,
        endpoint_url=_endpoint(cfg),
        unlabeled=unlabeled,
    )
    if plan.mean is not None:
        kw["mean"], kw["std"] = plan.mean, plan.std
    if cfg.data.mean is not None:  # data.mean / data.std from the preset or --set override the default
        kw["mean"] = cfg.data.mean
    if cfg.data.std is not None:
        kw["std"] = cfg.data.std
    if classes is not None:
        kw["classes"] = tuple(classes)
    if extensions is not None:
        kw["extensions"] = tuple(extensions)
    if split == cfg.data.val_split and cfg.data.labels_csv:
        kw["labels_csv"] = cfg.data.labels_csv
    return DataConfig(**kw)


def _subset(index, keep: int, parts: int = 2, limit: int | None = None):
    """Deterministic interleaved subset of a DatasetIndex: within each class, entries at
    positions ``keep, keep+parts, ...`` (disjoint for different ``keep``), then at most
    ``limit`` entries spread evenly."""
    from pipelines.ingest.data import fingerprint as data_fingerprint

    seen: dict[int, int] = {}
    keep_idx = []
    for i, y in enumerate(index.labels):
        k = seen.get(y, 0)
        seen[y] = k + 1
        if k % parts == keep:
            keep_idx.append(i)
    if limit is not None and len(keep_idx) > limit:
        step = len(keep_idx) / limit
        keep_idx = [keep_idx[int(j * step)] for j in range(limit)]
    return _take(index, keep_idx, data_fingerprint)


def _take(index, idx, fp_fn):
    paths = tuple(index.paths[i] for i in idx)
    labels = tuple(index.labels[i] for i in idx)
    counts = [0] * len(index.classes)
    for y in labels:
        if y >= 0:
            counts[y] += 1
    kw = dict(paths=paths, labels=labels, class_counts=tuple(counts),
              fingerprint=fp_fn(index.classes, paths, labels))
    if index.locations:
        kw["locations"] = tuple(index.locations[i] for i in idx)
    return dataclasses.replace(index, **kw)


def _limit(index, limit: int | None):
    from pipelines.ingest.data import fingerprint as data_fingerprint

    if limit is None or len(index) <= limit:
        return index
    step = len(index) / limit
    return _take(index, [int(j * step) for j in range(limit)], data_fingerprint)


# --------------------------------------------------------------------------- one model
def _versions() -> dict[str, str]:
    import ray
    import torch
    import torchvision

    import laplace_core

    return {"python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
            "ray": ray.__version__, "infoform": laplace_core.__version__}


def _posterior_uris(output: str, methods) -> dict[str, str]:
    from pipelines.passes.posterior import posterior_uri

    return {m: posterior_uri(output, m) for m in methods}


def _actor_resources(ev: EvalSpec) -> dict[str, float]:
    """Ray resources of each search/evaluation actor: ``evaluate.cpus_per_actor`` and
    ``evaluate.gpus_per_actor``, or when that is null a share that lets every actor be placed
    on the GPUs the cluster declares (:func:`pipelines.distributed.cluster.gpu_share`: 1, or 1/k; 0 on a
    cluster without GPUs, said in one line). Needs Ray initialised."""
    gpus = ev.gpus_per_actor
    if gpus is None:
        import ray

        from pipelines.distributed.cluster import gpu_share

        declared = float(ray.cluster_resources().get("GPU", 0.0))
        gpus = gpu_share(ev.num_actors, declared)
        if gpus == 0:
            _log("actors: the cluster declares no GPU, so search and evaluation run on CPUs "
                 "(evaluate.gpus_per_actor=1 waits for GPU nodes instead)")
        else:
            _log(f"actors: {ev.num_actors} actor(s) on {declared:g} declared GPU(s), {gpus:.4g} GPU each")
    return {"cpus_per_actor": float(ev.cpus_per_actor), "gpus_per_actor": float(gpus)}


def _run_model(cfg: RunConfig, spec: ModelSpec, output: str, plan: _DataPlan,
               ensure_ray: Callable[[], None]) -> dict[str, Any]:
    """All stages for one model; returns the run summary (also written as run.json)."""
    from pipelines.passes.curvature import CurvatureConfig, run_curvature
    from pipelines.ingest.data import build_dataset, partition, scan
    from pipelines.evaluation.evaluate import evaluate
    from pipelines.evaluation.runtime import eval_config, search_config
    from pipelines.evaluation.search import search
    from pipelines.report.report import write_report

    st = _Stages(cfg, output, ensure_ray)
    ep = _endpoint(cfg)
    t_start = time.perf_counter()
    model_info: dict[str, Any] = {"name": spec.name, "weights": spec.weights}
    if plan.demo is not None and spec.name == "demo_cnn" and spec.weights is None:
        # the embedded demo: the small CNN trained on the spot (any other model is used as given)
        spec, trained = _demo_model(cfg, plan, output)
        trained.pop("cached", None)  # run.json must not depend on whether the cache was warm
        model_info.update(name=spec.name, weights=spec.weights, demo_training=trained)

    # ---- data: scanned on the driver, before any cluster work
    train_idx = scan(_data_config(cfg, plan, cfg.data.train_split, limit=cfg.data.limit, per_class=cfg.data.per_class))
    classes = train_idx.classes
    val_cfg = _data_config(cfg, plan, cfg.data.val_split, classes=classes)
    val_full = scan(val_cfg)
    if cfg.data.test_split:
        test_cfg = _data_config(cfg, plan, cfg.data.test_split, classes=classes)
        search_idx = _limit(val_full, cfg.data.val_limit)
        test_idx = _limit(scan(test_cfg), cfg.data.test_limit)
    else:  # one labelled held-out split: disjoint halves for the search and the evaluation
        test_cfg = val_cfg
        search_idx = _subset(val_full, 0, limit=cfg.data.val_limit)
        test_idx = _subset(val_full, 1, limit=cfg.data.test_limit)
    ood_idx = ood_cfg = None
    if plan.ood:
        ood_cfg = _data_config(cfg, plan, None, root=plan.ood, unlabeled=True,
                               extensions=(".jpg",) if plan.demo is not None else None)
        ood_idx = _limit(scan(ood_cfg), cfg.data.ood_limit)
    parts = partition(train_idx, partition_size=cfg.data.partition_size)
    try:  # weights under the posterior / left at MAP (laplace_core.sizes), shown in the summary and report
        from pipelines.ingest.models import model_coverage

        model_info["coverage"] = model_coverage(spec.name, spec.num_classes or len(classes),
                                                cfg.posterior.norm_layers)["summary"]
    except ValueError as e:
        model_info["coverage"] = f"not computed: {e}"
    data_info = {
        "train": train_idx.summary(),
        "search": {"split": cfg.data.val_split, "num_files": len(search_idx)},
        "test": {"split": cfg.data.test_split or f"{cfg.data.val_split} (other half)", "num_files": len(test_idx)},
        "ood": None if ood_idx is None else ood_idx.summary(),
        "num_classes": len(classes),
        "partitions": len(parts),
        "demo": plan.demo,
    }
    _log(f"data: {len(train_idx)} train images in {len(parts)} partitions, {len(search_idx)} for the search, "
         f"{len(test_idx)} test, {0 if ood_idx is None else len(ood_idx)} OOD")
    methods = tuple(m for m in cfg.posterior.methods)
    # "subnet" is not built from the reduced sums alone: the curvature stage adds its S x S Fisher pass
    layer_methods = tuple(m for m in methods if m != "subnet")
    subnet_cfg = None
    if "subnet" in methods:
        from pipelines.passes.subnet import subnet_config

        subnet_cfg = subnet_config(cfg.posterior, cfg.curvature.fisher, spec.num_classes or len(classes))

    # ---- curvature: the reduced statistics and eigenbasis (+ the subnet pass's S x S Fisher)
    c = cfg.curvature
    curv_cfg = CurvatureConfig(
        num_workers=c.num_workers, use_gpu=c.use_gpu, cpus_per_worker=c.cpus_per_worker, fisher=c.fisher,
        mc_samples=c.mc_samples, seed=c.seed, batch_size=c.batch_size, methods=layer_methods,
        efb_fraction=c.efb_fraction, max_failures=c.max_failures, torch_threads=c.torch_threads or 1,
        checkpoint_every_s=c.checkpoint_every_s, norm_layers=cfg.posterior.norm_layers,
    )
    # the checkpoint interval does not change the sums: not part of the stage's fingerprint
    curv_fp = {"model": to_dict(spec), "train": train_idx.fingerprint,
               "curvature": {k: v for k, v in to_dict(c).items() if k != "checkpoint_every_s"},
               "image": [cfg.data.image_size, cfg.data.resize_size], "methods": list(methods)}
    if cfg.posterior.norm_layers != "map":  # fingerprints of default runs unchanged
        curv_fp["norm_layers"] = cfg.posterior.norm_layers
    if subnet_cfg is not None:  # the selection (S, n_data, tau) and the Fisher type shape the subnet pass
        curv_fp["subnet"] = dataclasses.asdict(subnet_cfg)

    def do_curvature() -> dict[str, Any]:
        train_dcfg = _data_config(cfg, plan, cfg.data.train_split, limit=cfg.data.limit, per_class=cfg.data.per_class)
        res = run_curvature(spec, parts, curv_cfg, output, data_config=train_dcfg, endpoint_url=ep)
        skipped = {k: v for k, v in res.skipped.items()}
        passes, subnet = dict(res.passes), None
        if subnet_cfg is not None:  # Daxberger et al. (2021): select from the reduced sums, S x S Fisher pass
            from pipelines.passes.subnet import run_subnet_pass

            sres = run_subnet_pass(spec, parts, curv_cfg, subnet_cfg, output, data_config=train_dcfg,
                                   endpoint_url=ep, stats=res.stats)
            passes.update(sres.passes)
            subnet = {k: v for k, v in dataclasses.asdict(sres).items() if k != "passes"}
        return {
            "count": res.stats.count, "efb_count": res.stats.efb_count, "excluded": res.stats.excluded,
            "skipped_batches": res.stats.skipped_batches, "skipped": skipped,
            "clamped_eigenvalues": 0 if res.basis is None else res.basis.total_clamped(),
            "allreduce_s": res.allreduce_seconds, "allreduce_bytes": res.allreduce_bytes,
            "computed_partitions": {k: list(v) for k, v in res.computed_partitions.items()},
            "reused_partitions": {k: list(v) for k, v in res.reused_partitions.items()},
            "num_workers": res.num_workers, "use_gpu": res.use_gpu, "passes": passes,
            "timings": {k: v for k, v in res.timings.items() if k != "worker"},
            **({"subnet": subnet} if subnet is not None else {}),
        }

    curv = st.run("curvature", curv_fp, do_curvature)
    post_fp = {**curv_fp, "posterior": to_dict(cfg.posterior)}

    def do_posterior() -> dict[str, Any]:
        from pipelines.passes.posterior import build_posteriors

        return {"posteriors": build_posteriors(output, methods, cfg.posterior.rank, n_data=cfg.posterior.n_data,
                                               prior_precision=cfg.posterior.prior_precision, endpoint_url=ep)}

    post = st.run("posterior", post_fp, do_posterior)
    uris = _posterior_uris(output, methods)

    # ---- (N, tau) search on the held-out split
    ev = cfg.evaluate
    runtime = {"num_actors": ev.num_actors, "batch_size": ev.batch_size}
    search_settings = to_dict(cfg.search)
    if not search_settings["method_ranges"]:
        del search_settings["method_ranges"]  # the fingerprint of runs from before method_ranges existed
    search_fp = {**post_fp, "search": search_settings, "val": search_idx.fingerprint, "runtime": runtime,
                 "pred_type": ev.pred_type}

    def do_search() -> dict[str, Any]:
        search_cfg = search_config(cfg, expected_rows=(len(search_idx), None), **_actor_resources(ev))
        res = search(spec, uris, build_dataset(search_idx, val_cfg), search_cfg, output=output, endpoint_url=ep)
        return {"chosen": res.chosen, "notes": res.notes, "map": res.map,
                "info": {**res.info, "device": search_cfg.resolved_device},
                "failed": sum(1 for r in res.rows if r["status"] != "ok"),
                "table": storage.join(output, "eval", "search.parquet")}

    srch = st.run("search", search_fp, do_search)
    hyper = None
    if srch is not None:
        hyper = {m: (c_["n_data"], c_["prior_precision"]) for m, c_ in srch["chosen"].items() if c_ is not None}
        _write_search_table(output, methods, ep)

    # ---- evaluation on the test split and the OOD set
    # retries and actor resources do not change results (samples depend on (seed, t) and the
    # device's generator; a stage computed on CPU stays valid on GPU and is reused)
    ev_fp = {k: v for k, v in to_dict(ev).items() if k not in ("max_failures", "cpus_per_actor", "gpus_per_actor",
                                                                "placement_timeout_s")}
    eval_fp = {**search_fp, "evaluate": ev_fp, "test": test_idx.fingerprint,
               "ood": None if ood_idx is None else ood_idx.fingerprint, "hyper": hyper}

    def do_evaluate() -> dict[str, Any]:
        eval_cfg = eval_config(cfg, expected_rows=(len(test_idx), None if ood_idx is None else len(ood_idx)),
                               **_actor_resources(ev))
        ood_ds = None if ood_idx is None else build_dataset(ood_idx, ood_cfg)
        res = evaluate(spec, uris, build_dataset(test_idx, test_cfg), ood_ds, eval_cfg, output=output,
                       hyper=hyper, endpoint_url=ep)
        return {"methods": {m: _headline(r) for m, r in res.items()}, "device": eval_cfg.resolved_device}

    evl = st.run("evaluate", eval_fp, do_evaluate)

    # ---- run summary + report
    summary = _summary(cfg, spec, model_info, data_info, st.results, output)
    summary["timings"]["total_this_run"] = time.perf_counter() - t_start

    def do_report() -> dict[str, Any]:
        from pipelines.report.report import load_eval_metrics

        metrics = load_eval_metrics(output, ep)
        table = _read_search(output, methods, ep)
        paths = write_report(output, summary, metrics, table, endpoint_url=ep)
        return {"paths": paths}

    report_fp = {**eval_fp, "report": 1}
    if evl is not None:
        st.run("report", report_fp, do_report)
    storage.write_json_atomic(storage.join(output, "run.json"), _stable_run_json(summary), ep)
    return summary


def _headline(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("status", "reason", "accuracy", "nll", "brier", "ece", "ece_variant", "entropy_mean", "n_data",
            "prior_precision")
    out = {k: r.get(k) for k in keys if k in r}
    if isinstance(r.get("ood"), dict):
        out["ood_auroc"] = r["ood"].get("auroc")
        out["ood_entropy_mean"] = r.get("ood_entropy_mean")
    return out


def _write_search_table(output: str, methods, ep) -> None:
    """One search table for all methods at ``eval/search.parquet`` (from the per-method files)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    target = storage.join(output, "eval", "search.parquet")
    if storage.exists(target, ep):
        return
    tables = []
    for m in methods:
        uri = storage.join(output, "eval", m, "search.parquet")
        if storage.exists(uri, ep):
            tables.append(pq.read_table(io.BytesIO(storage.read_bytes(uri, ep))))
    if tables:
        buf = io.BytesIO()
        pq.write_table(pa.concat_tables(tables), buf)
        storage.write_bytes_atomic(target, buf.getvalue(), ep)


def _read_search(output: str, methods, ep):
    uri = storage.join(output, "eval", "search.parquet")
    if not storage.exists(uri, ep):
        return None
    from pipelines.report.report import read_search_table

    return read_search_table(uri, ep)


def _inf_clipping(posteriors: dict[str, Any], chosen: dict[str, Any], ep: storage.Store = None) -> dict[str, Any] | None:
    """INF's clipped ``D`` entries and diagonal error at the chosen ``(N, τ)`` (None without both)."""
    uri, c = (posteriors.get("inf") or {}).get("uri"), chosen.get("inf")
    if not uri or not c:
        return None
    from pipelines.passes.posterior import inf_clipping_at

    try:
        return inf_clipping_at(uri, 10.0 ** c["log10_n"], 10.0 ** c["log10_tau"], ep)
    except Exception as e:  # a report detail: never fail the run over it
        _log(f"INF clipping at the chosen (N, tau) not computed: {type(e).__name__}: {e}")
        return None


def _summary(cfg: RunConfig, spec: ModelSpec, model_info, data_info, results: dict[str, Any], output: str):
    curv = results.get("curvature") or {}
    post = results.get("posterior") or {}
    srch = results.get("search") or {}
    evl = results.get("evaluate") or {}
    posteriors = post.get("posteriors") or {}
    sizes = {m: {"numbers": p.get("num_stored"), "note": f"rank {cfg.posterior.rank}" if m == "inf" else
                 f"S = {p.get('subnet_size')} of {p.get('d_total')} weights" if m == "subnet" else ""}
             for m, p in posteriors.items()}
    skipped = {}
    for k, v in (curv.get("skipped") or {}).items():
        if isinstance(v, dict) and "count" in v:
            skipped[k] = {"count": int(v.get("count", 0)), "examples": v.get("examples", [])}
    chosen = {m: {"log10_n": c_["log10_n"], "log10_tau": c_["log10_tau"]}
              for m, c_ in (srch.get("chosen") or {}).items() if c_}
    inf_clip = _inf_clipping(posteriors, chosen, _endpoint(cfg))
    return {
        "title": f"infoform report: {spec.name}" + (" (demo)" if cfg.data.demo else ""),
        "run_id": _fingerprint(to_dict(cfg))[:8],
        "config": to_dict(cfg),
        "model": model_info,
        "data": data_info,
        "versions": _versions(),
        "timings": {s: (results.get(s) or {}).get("seconds") for s in STAGES if results.get(s)},
        "posterior_sizes": sizes,
        "skipped_images": skipped,
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
                   "device": (srch.get("info") or {}).get("device")},
        "evaluate": {"device": evl.get("device")},
        "results": evl.get("methods"),
        "output": output,
    }


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


# --------------------------------------------------------------------------- entry
def run(cfg: RunConfig, init_ray: Callable[[], None] | None = None) -> RunResult:
    """Run every requested stage for the configured model(s).

    ``init_ray`` connects to (or starts) Ray; it is called once, just before the first
    stage that needs the cluster, so a re-run whose stages are all done never starts Ray.
    Without it, Ray must already be initialised (or ``ray.init()`` is called).
    """
    cfg.validate()
    started = []

    def ensure_ray() -> None:
        if started:
            return
        started.append(True)
        import ray

        if init_ray is not None:
            init_ray()
        elif not ray.is_initialized():
            ray.init()
        _quiet_ray_data()
        from pipelines.distributed.cluster import check_paths, cluster_shape

        shape = cluster_shape()
        _log(f"cluster: {shape.nodes} node(s), {shape.cpus:g} CPUs, {shape.gpus:g} GPUs "
             f"({shape.driver_node_cpus:g} CPUs beside the driver)")
        check_paths(cfg, shape)  # local paths on several nodes: one line, before any pass

    from pipelines.distributed.cluster import resolve_output

    # Ray workers do not share the driver's working directory: an absolute path, outside a
    # `ray job submit --working-dir` copy (pipelines.distributed.cluster.resolve_output)
    output = resolve_output(cfg.output)
    if output != cfg.output:
        cfg = dataclasses.replace(cfg, output=output)
    plan = _prepare_demo(cfg, output) if cfg.data.demo else _DataPlan(
        root=cfg.data.root, ood=cfg.data.ood, mean=None, std=None, demo=None)
    storage.write_json_atomic(storage.join(output, "config.json"), to_dict(cfg), _endpoint(cfg))
    models = cfg.all_models()
    if len(models) == 1:
        summary = _run_model(cfg, models[0], output, plan, ensure_ray)
        report = storage.join(output, "report.html")
        return RunResult(output=output, report_path=report, summary=summary)
    from pipelines.report.report import load_eval_metrics, write_audit_report

    ep = _endpoint(cfg)
    per_model, tables, listing = {}, {}, {}
    for spec in models:
        sub = storage.join(output, "models", spec.name)
        _log(f"audit: model {spec.name} -> {sub}")
        summary = _run_model(cfg, spec, sub, plan, ensure_ray)
        listing[spec.name] = {k: summary.get(k) for k in ("output", "model", "results", "posterior_sizes", "chosen")}
        if summary.get("results") is None:  # evaluate not run (--stages): nothing to compare for this model
            continue
        per_model[spec.name] = (summary, load_eval_metrics(sub, ep))
        tables[spec.name] = _read_search(sub, cfg.posterior.methods, ep)
    audit = {"preset": cfg.preset, "config": to_dict(cfg), "models": listing, "report": None}
    paths = {}
    if per_model:
        paths = write_audit_report(output, per_model, search_tables=tables, endpoint_url=ep)
        audit["report"] = {"html": paths["html"], "md": paths["md"]}
        audit["figures"] = {k: v for k, v in paths.items() if k not in ("html", "md")}
    else:
        _log("audit: no model has evaluation results yet; no comparison report written")
    storage.write_json_atomic(storage.join(output, "run.json"), audit, ep)
    # without a comparison (no model evaluated yet) the run.json listing is what there is to show
    return RunResult(output=output, report_path=paths.get("html", storage.join(output, "run.json")), summary=audit)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use jobs/imagenet_inf.py or `infoform run`")
