"""One model's stages, in data-flow order: curvature -> posterior -> search -> evaluate -> report.

:class:`ModelRun` holds what the stages share (the config, the model, the scanned splits, the
output) and has one method per stage. Each builds the stage's fingerprint from the previous
stage's (so a changed setting redoes that stage and every later one) and hands its work to
:class:`pipelines.cli.stages.Stages`, which skips a stage already committed with the same
fingerprint.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from laplace_core.methods import TEMPERATURE, method_info
from pipelines.cli.plan import DataPlan, Splits, demo_model, scan_splits
from pipelines.cli.stages import Stages, fingerprint, log
from pipelines.config.load import derive, to_dict
from pipelines.config.schema import ConfigError, EvalSpec, ModelSpec, RunConfig
from pipelines.storage import layout
from pipelines.storage import uris as storage

__all__ = ["ModelRun", "actor_resources", "layer_fingerprint", "NOT_IN_FINGERPRINT"]

#: curvature settings that do not change the statistics: not part of the stage's fingerprint
NOT_IN_FINGERPRINT = frozenset({"checkpoint_every_s", "gpus_per_worker", "bucket_mb", "log_every_s"})
#: evaluation settings that do not change results (samples depend on (seed, t); retries and
#: actor resources do not matter, so a stage computed on CPU stays valid on GPU)
EVAL_NOT_IN_FINGERPRINT = frozenset({"max_failures", "cpus_per_actor", "gpus_per_actor", "placement_timeout_s",
                                     "chunk_size", "sample_cache_mb", "torch_threads", "log_every_s"})


def actor_resources(ev: EvalSpec) -> dict[str, float]:
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
            log("actors: the cluster declares no GPU, so search and evaluation run on CPUs "
                "(evaluate.gpus_per_actor=1 waits for GPU nodes instead)")
        else:
            log(f"actors: {ev.num_actors} actor(s) on {declared:g} declared GPU(s), {gpus:.4g} GPU each")
    return {"cpus_per_actor": float(ev.cpus_per_actor), "gpus_per_actor": float(gpus)}


def layer_fingerprint(posterior: Any) -> dict[str, Any]:
    """What of ``posterior.norm_layers`` / ``posterior.layers`` enters the curvature stage's
    fingerprint: each only when it is not the default, so default runs keep their fingerprints."""
    out: dict[str, Any] = {}
    if posterior.norm_layers != "map":
        out["norm_layers"] = posterior.norm_layers
    if posterior.layers != "all":
        out["layers"] = to_dict(posterior.layers)
    return out


class ModelRun:
    """The stages of one model under ``output``; ``model_info`` and ``data_info`` go to the summary."""

    def __init__(self, cfg: RunConfig, spec: ModelSpec, output: str, plan: DataPlan, ensure_ray: Callable[[], None]):
        self.cfg, self.output, self.plan = cfg, output, plan
        self.ep = cfg.storage_options()
        self.st = Stages(cfg, output, ensure_ray)
        self.model_info: dict[str, Any] = {"name": spec.name, "weights": spec.weights}
        if plan.demo is not None and spec.name == "demo_cnn" and spec.weights is None:
            # the embedded demo: the small CNN trained on the spot (any other model is used as given)
            spec, trained = demo_model(cfg, plan, output)
            trained.pop("cached", None)  # run.json must not depend on whether the cache was warm
            self.model_info.update(name=spec.name, weights=spec.weights, demo_training=trained)
        self.spec = spec
        self.splits: Splits = scan_splits(cfg, plan)  # on the driver, before any cluster work
        self.data_info = self.splits.summary(cfg, plan)
        self.model_info["coverage"] = self._coverage()
        s = self.splits
        log(f"data: {len(s.train)} train images in {len(s.parts)} partitions, {len(s.search)} for the search, "
            f"{len(s.test)} test, {0 if s.ood is None else len(s.ood)} OOD")
        self.methods = tuple(cfg.posterior.methods)
        # methods with a posterior (``temperature`` has none: it is fitted in the search stage)
        self.post_methods = tuple(m for m in self.methods if method_info(m).posterior)
        self.uris = {m: layout.posterior_uri(output, m) for m in self.post_methods}
        self.hyper: dict[str, tuple[float, float]] | None = None
        self.temperature: float | None = None

    @property
    def results(self) -> dict[str, Any]:
        return self.st.results

    def _coverage(self) -> Any:
        """Weights under the posterior / left at MAP (laplace_core.sizes), for the summary and report.
        A ``posterior.layers`` name or glob that matches no layer is a ConfigError here, before any
        cluster work."""
        from laplace_core.layer_selection import LayerSelectionError
        from pipelines.ingest.models import model_coverage

        try:
            return model_coverage(self.spec.name, self.spec.num_classes or len(self.splits.classes),
                                  self.cfg.posterior.norm_layers, self.cfg.posterior.layers)["summary"]
        except LayerSelectionError as e:
            raise ConfigError(f"posterior.layers: {e}") from None
        except ValueError as e:
            return f"not computed: {e}"

    # ------------------------------------------------------------------ curvature
    def curvature(self) -> dict[str, Any] | None:
        """The reduced statistics and eigenbasis (+ the subnet pass's S x S Fisher)."""
        from pipelines.passes.curvature import CurvatureConfig

        cfg, c = self.cfg, self.cfg.curvature
        # "subnet" is not built from the reduced sums alone: the curvature stage adds its S x S Fisher pass
        layer_methods = tuple(m for m in self.methods if method_info(m).per_layer)
        self.subnet_cfg = None
        if "subnet" in self.methods:
            from pipelines.passes.subnet import subnet_config

            self.subnet_cfg = subnet_config(cfg.posterior, c.fisher, self.spec.num_classes or len(self.splits.classes))
        self.curv_cfg = derive(CurvatureConfig, c, methods=layer_methods, norm_layers=cfg.posterior.norm_layers,
                               layers=cfg.posterior.layers,
                               torch_threads=c.torch_threads or 1)
        self.curv_fp = {"model": to_dict(self.spec), "train": self.splits.train.fingerprint,
                        "curvature": {k: v for k, v in to_dict(c).items() if k not in NOT_IN_FINGERPRINT
                                      and not (k == "precision" and v == "fp32")},  # fp32 runs keep their fingerprint
                        "image": [cfg.data.image_size, cfg.data.resize_size], "methods": list(self.post_methods)}
        self.curv_fp.update(layer_fingerprint(cfg.posterior))
        if self.subnet_cfg is not None:  # the selection (S, n_data, tau) and the Fisher type shape the subnet pass
            self.curv_fp["subnet"] = dataclasses.asdict(self.subnet_cfg)
        return self.st.run("curvature", self.curv_fp, self._do_curvature)

    def _do_curvature(self) -> dict[str, Any]:
        from pipelines.passes.curvature import run_curvature

        train_dcfg = self.splits.train_config
        res = run_curvature(self.spec, self.splits.parts, self.curv_cfg, self.output, data_config=train_dcfg,
                            endpoint_url=self.ep)
        passes, subnet = dict(res.passes), None
        if self.subnet_cfg is not None:  # Daxberger et al. (2021): select from the reduced sums, S x S Fisher pass
            from pipelines.passes.subnet import run_subnet_pass

            sres = run_subnet_pass(self.spec, self.splits.parts, self.curv_cfg, self.subnet_cfg, self.output,
                                   data_config=train_dcfg, endpoint_url=self.ep, stats=res.stats)
            passes.update(sres.passes)
            subnet = {k: v for k, v in dataclasses.asdict(sres).items() if k != "passes"}
        return {
            "count": res.stats.count, "efb_count": res.stats.efb_count, "excluded": res.stats.excluded,
            "skipped_batches": res.stats.skipped_batches, "skipped": dict(res.skipped),
            "clamped_eigenvalues": 0 if res.basis is None else res.basis.total_clamped(),
            "allreduce_s": res.allreduce_seconds, "allreduce_bytes": res.allreduce_bytes,
            "computed_partitions": {k: list(v) for k, v in res.computed_partitions.items()},
            "reused_partitions": {k: list(v) for k, v in res.reused_partitions.items()},
            "num_workers": res.num_workers, "use_gpu": res.use_gpu, "passes": passes,
            "timings": {k: v for k, v in res.timings.items() if k != "worker"},
            **({"subnet": subnet} if subnet is not None else {}),
        }

    # ------------------------------------------------------------------ posterior
    def posterior(self) -> dict[str, Any] | None:
        post = to_dict(self.cfg.posterior)
        post["methods"] = list(self.post_methods)  # adding "temperature" does not rebuild the posteriors
        self.post_fp = {**self.curv_fp, "posterior": post}
        return self.st.run("posterior", self.post_fp, self._do_posterior)

    def _do_posterior(self) -> dict[str, Any]:
        from pipelines.passes.posterior import build_posteriors

        p = self.cfg.posterior
        return {"posteriors": build_posteriors(self.output, self.post_methods, p.rank, n_data=p.n_data,
                                               prior_precision=p.prior_precision, endpoint_url=self.ep)}

    # ------------------------------------------------------------------ (N, tau) search
    def search(self) -> dict[str, Any] | None:
        ev = self.cfg.evaluate
        self.runtime = {"num_actors": ev.num_actors, "batch_size": ev.batch_size}
        settings = {k: v for k, v in to_dict(self.cfg.search).items() if k != "chunk_size"}  # grouping only
        if not settings["method_ranges"]:
            del settings["method_ranges"]  # the fingerprint of runs from before method_ranges existed
        for k, default in (("scheduler", "none"), ("algorithm", "random"), ("reduction_factor", 4)):
            if settings.get(k) == default or (k == "reduction_factor" and settings["scheduler"] != "asha"):
                settings.pop(k, None)  # the paper's protocol keeps the fingerprint it had before Ray Tune
        self.search_fp = {**self.post_fp, "search": settings, "val": self.splits.search.fingerprint,
                          "runtime": self.runtime, "pred_type": ev.pred_type}
        if (ev.ece_mode, ev.ece_bins) != ("equal_width", 15):  # the search scores with the evaluation's ECE
            self.search_fp["ece"] = [ev.ece_mode, ev.ece_bins]
        if ev.dtype != "float32":
            self.search_fp["dtype"] = ev.dtype
        if TEMPERATURE in self.methods:  # fitted on the same split (fingerprints of other runs unchanged)
            self.search_fp["temperature"] = True
        srch = self.st.run("search", self.search_fp, self._do_search)
        if srch is not None:
            self.hyper = {m: (c["n_data"], c["prior_precision"]) for m, c in srch["chosen"].items() if c is not None}
            if srch.get("temperature") is not None:
                self.temperature = float(srch["temperature"]["temperature"])
            write_search_table(self.output, self.post_methods, self.ep)
        return srch

    def _do_search(self) -> dict[str, Any]:
        from pipelines.evaluation.runtime import search_config
        from pipelines.evaluation.search import search
        from pipelines.ingest.batches import build_dataset

        ev, s = self.cfg.evaluate, self.splits
        search_cfg = search_config(self.cfg, expected_rows=(len(s.search), None), **actor_resources(ev))
        out: dict[str, Any] = {"chosen": {}, "notes": {}, "map": {}, "info": {"device": search_cfg.resolved_device},
                               "failed": 0, "table": layout.search_table_uri(self.output)}
        if self.uris:
            # a re-submitted job resumes the Tune experiment of this key
            key = fingerprint(self.search_fp)[:12]
            res = search(self.spec, self.uris, build_dataset(s.search, s.search_config), search_cfg,
                         output=self.output, endpoint_url=self.ep, key=key)
            out.update(chosen=res.chosen, notes=res.notes, map=res.map,
                       info={**res.info, "device": search_cfg.resolved_device},
                       failed=sum(1 for r in res.rows if r["status"] != "ok"))
        if TEMPERATURE in self.methods:  # Guo et al. (2017): T by NLL on the search split
            from pipelines.evaluation.temperature import fit_temperature_run

            fit = fit_temperature_run(self.spec, build_dataset(s.search, s.search_config), search_cfg,
                                      output=self.output, endpoint_url=self.ep)
            log(f"temperature: T = {fit['temperature']:.4g} (search-split NLL {fit['nll_before']:.4f} -> "
                f"{fit['nll_after']:.4f}){'; ' + fit['note'] if fit.get('note') else ''}")
            out["temperature"] = fit
        return out

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, Any] | None:
        """The test split and the OOD set, at the chosen ``(N, τ)``; with ``evaluate.shift``
        also the test split under each corruption and severity (:mod:`pipelines.evaluation.shift`)."""
        s = self.splits
        ev_fp = {k: v for k, v in to_dict(self.cfg.evaluate).items() if k not in EVAL_NOT_IN_FINGERPRINT}
        if ev_fp.get("shift") is None:  # fingerprints of runs without a sweep unchanged
            ev_fp.pop("shift", None)
        self.eval_fp = {**self.search_fp, "evaluate": ev_fp, "test": s.test.fingerprint,
                        "ood": None if s.ood is None else s.ood.fingerprint, "hyper": self.hyper}
        if self.temperature is not None:
            self.eval_fp["temperature"] = self.temperature
        return self.st.run("evaluate", self.eval_fp, self._do_evaluate)

    def _do_evaluate(self) -> dict[str, Any]:
        from pipelines.evaluation.evaluate import evaluate
        from pipelines.evaluation.runtime import eval_config
        from pipelines.ingest.batches import build_dataset

        ev, s = self.cfg.evaluate, self.splits
        eval_cfg = eval_config(self.cfg, expected_rows=(len(s.test), None if s.ood is None else len(s.ood)),
                               **actor_resources(ev))
        ood_ds = None if s.ood is None else build_dataset(s.ood, s.ood_config)
        res = evaluate(self.spec, self.uris, build_dataset(s.test, s.test_config), ood_ds, eval_cfg,
                       output=self.output, hyper=self.hyper, endpoint_url=self.ep, temperature=self.temperature)
        out = {"methods": {m: headline(r) for m, r in res.items()}, "device": eval_cfg.resolved_device}
        if ev.shift is not None:
            from pipelines.evaluation.shift import evaluate_shift

            docs = evaluate_shift(self.spec, self.uris, s.test, s.test_config, eval_cfg, ev.shift.corruptions,
                                  ev.shift.severities, output=self.output, hyper=self.hyper,
                                  temperature=self.temperature, endpoint_url=self.ep)
            out["shift"] = {m: d["mean"] for m, d in docs.items()}
            from pipelines.report.shift import shift_headline

            for m, d in docs.items():  # the means over corruptions and severities join the headline numbers
                if m in out["methods"]:
                    out["methods"][m].update(shift_headline(d))
        return out

    # ------------------------------------------------------------------ report
    def report(self, summary: dict[str, Any]) -> dict[str, Any] | None:
        def do_report() -> dict[str, Any]:
            from pipelines.report.load import load_eval_metrics
            from pipelines.report.write import write_report

            from pipelines.report.shift import load_shift, render_shift

            metrics = load_eval_metrics(self.output, self.ep)
            table = read_search(self.output, self.ep)
            figures = {}
            shift = load_shift(self.output, metrics, self.ep)
            if shift:  # metric against severity, one line per method
                figures["shift"] = layout.figure_uri(self.output, "shift")
                storage.write_bytes_atomic(figures["shift"], render_shift(shift), self.ep)
            return {"paths": write_report(self.output, summary, metrics, table, figures=figures, endpoint_url=self.ep)}

        return self.st.run("report", {**self.eval_fp, "report": 1}, do_report)

    def run_all(self) -> None:
        t0 = time.perf_counter()
        self.curvature()
        self.posterior()
        self.search()
        self.evaluate()
        self.seconds = time.perf_counter() - t0


def headline(r: dict[str, Any]) -> dict[str, Any]:
    """The evaluation numbers kept in the stage marker and run.json."""
    keys = ("status", "reason", "accuracy", "nll", "brier", "ece", "ece_variant", "entropy_mean", "n_data",
            "prior_precision")
    out = {k: r.get(k) for k in keys if k in r}
    if isinstance(r.get("ood"), dict):
        out["ood_auroc"] = r["ood"].get("auroc")
        out["ood_entropy_mean"] = r.get("ood_entropy_mean")
    return out


def write_search_table(output: str, methods, ep) -> None:
    """One search table for all methods at ``eval/search.parquet`` (from the per-method files)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    target = layout.search_table_uri(output)
    if storage.exists(target, ep):
        return
    tables = []
    for m in methods:
        uri = layout.search_table_uri(output, m)
        if storage.exists(uri, ep):
            tables.append(pq.read_table(io.BytesIO(storage.read_bytes(uri, ep))))
    if tables:
        buf = io.BytesIO()
        pq.write_table(pa.concat_tables(tables), buf)
        storage.write_bytes_atomic(target, buf.getvalue(), ep)


def read_search(output: str, ep):
    """The run's search table rows (None before the search)."""
    uri = layout.search_table_uri(output)
    if not storage.exists(uri, ep):
        return None
    from pipelines.report.load import read_search_table

    return read_search_table(uri, ep)
