"""One model's stages, in data-flow order: curvature -> posterior -> search -> evaluate -> report.

:class:`ModelRun` holds what the stages share (the config, the model, the scanned splits, the
output) and has one method per stage. Each takes the previous stage's result and returns its
own (:class:`StageResult`: the fingerprint tree, the summary, the seconds; the search adds the
chosen ``(N, tau)`` and temperature), so a stage cannot be called before the one it depends on.
A stage's fingerprint is the previous stage's plus its own settings, read from the config
fields themselves (:func:`pipelines.config.settings.fingerprint_fields`: a field opts out with
``fingerprint=False``), so a changed setting redoes that stage and every later one;
:class:`pipelines.cli.stages.Stages` skips a stage already committed with the same fingerprint.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

from laplace_core.posteriors.methods import TEMPERATURE, method_info
from pipelines.cli.counts import ignored_lines
from pipelines.ingest.plan import DataPlan, Splits, demo_model, scan_splits
from pipelines.cli.stages import Stages, fingerprint, log
from pipelines.config.load import derive, to_dict
from pipelines.config.schema import ActorSpec, ConfigError, EvalSpec, ModelSpec, RunConfig
from pipelines.config.settings import fingerprint_fields
from pipelines.storage.store import RunStore

__all__ = ["ModelRun", "StageResult", "CurvatureResult", "SearchResult", "RunResult", "actor_resources",
           "forget_placement", "FINGERPRINT_VERSION"]

#: Bumped when what enters a stage fingerprint changes: a run folder made under another version
#: is refused in one line (``--force <stage>`` or a new ``--output``) instead of being misread.
FINGERPRINT_VERSION = 2


@dataclass(frozen=True)
class StageResult:
    """What a stage hands to the next: ``fingerprint`` (the settings tree of this stage and every
    earlier one), ``summary`` (its stage marker's summary; None when it was not requested and has
    no earlier result), ``seconds`` (as the marker records them; 0 without a summary)."""

    fingerprint: dict[str, Any]
    summary: dict[str, Any] | None

    @property
    def seconds(self) -> float:
        return float((self.summary or {}).get("seconds", 0.0))


@dataclass(frozen=True)
class CurvatureResult(StageResult):
    """The curvature stage's result and the pass settings it ran with."""

    config: Any = None  # pipelines.passes.curvature.CurvatureConfig
    subnet: Any = None  # pipelines.passes.subnet.SubnetConfig, when "subnet" is a method


@dataclass(frozen=True)
class SearchResult(StageResult):
    """The search stage's result: the chosen ``(N, tau)`` and predictive per method and the fitted temperature."""

    hyper: dict[str, tuple[float, float]] | None = None
    temperature: float | None = None
    pred_types: dict[str, str] | None = None


@dataclass(frozen=True)
class RunResult:
    """The four computing stages of one model and the seconds they took in this process."""

    curvature: CurvatureResult
    posterior: StageResult
    search: SearchResult
    evaluate: StageResult
    seconds: float


_SAID: set[str] = set()


def forget_placement() -> None:
    """A new run says its actor placement again (called at the start of each run)."""
    _SAID.clear()


def actor_resources(evaluate_spec: EvalSpec) -> dict[str, float]:
    """Ray resources of each search/evaluation actor: ``evaluate.cpus_per_actor`` and
    ``evaluate.gpus_per_actor``, or when that is null a share that lets every actor be placed
    on the GPUs the cluster declares (:func:`pipelines.distributed.cluster.gpu_share`: 1, or 1/k; 0 on a
    cluster without GPUs, said in one line). Needs Ray initialised."""
    gpus = evaluate_spec.gpus_per_actor
    if gpus is None:
        import ray

        from pipelines.distributed.cluster import gpu_share

        declared = float(ray.cluster_resources().get("GPU", 0.0))
        gpus = gpu_share(evaluate_spec.num_actors, declared)
        if gpus == 0:
            line = ("actors: the cluster declares no GPU, so search and evaluation run on CPUs "
                    "(evaluate.gpus_per_actor=1 waits for GPU nodes instead)")
        else:
            line = f"actors: {evaluate_spec.num_actors} actor(s) on {declared:g} declared GPU(s), {gpus:.4g} GPU each"
        if line not in _SAID:  # one placement line per run, not one per stage
            _SAID.add(line)
            log(line)
    return {"cpus_per_actor": float(evaluate_spec.cpus_per_actor), "gpus_per_actor": float(gpus)}


class ModelRun:
    """The stages of one model under ``store.output`` (the run's store, or the model's own in an
    audit: :meth:`RunStore.for_model`); ``model_info`` and ``data_info`` go to the summary."""

    def __init__(self, cfg: RunConfig, spec: ModelSpec, store: RunStore, plan: DataPlan,
                 ensure_ray: Callable[[], None]):
        self.cfg, self.store, self.plan = cfg, store, plan
        self.output = output = store.output
        self.stages = Stages(cfg, store, ensure_ray)
        self.model_info: dict[str, Any] = {"name": spec.name, "weights": spec.weights}
        if plan.demo is not None and spec.name == "demo_cnn" and spec.weights is None:
            # the embedded demo: the small CNN trained on the spot (any other model is used as given)
            spec, trained = demo_model(cfg, plan, output)
            trained.pop("cached", None)  # run.json must not depend on whether the cache was warm
            self.model_info.update(name=spec.name, weights=spec.weights, demo_training=trained)
        self.spec = spec
        self.splits: Splits = scan_splits(cfg, plan)  # on the driver, before any cluster work
        self.data_info = self.splits.summary(cfg, plan)
        if spec.weights == "random":  # a test run: the head sized to the data's classes
            self.spec = spec = dataclasses.replace(spec, num_classes=spec.num_classes or len(self.splits.classes))
            log(f"model: {spec.name} with random weights ({spec.num_classes} classes): a test run of the pipeline, "
                "its results say nothing about a trained model")
        self.model_info["coverage"] = self._coverage()
        splits = self.splits
        log(f"data: {len(splits.train)} train images in {len(splits.parts)} "
            f"partition{'s' if len(splits.parts) != 1 else ''}, {len(splits.search)} for the search, "
            f"{len(splits.test)} test, " + (", ".join(f"{len(o.index)} OOD ({o.name})" for o in splits.oods) or "0 OOD"))
        for line in ignored_lines(splits.ignored()):
            log(line)
        self.methods = tuple(cfg.posterior.methods)
        # methods with a posterior (``temperature`` has none: it is fitted in the search stage)
        self.post_methods = tuple(m for m in self.methods if method_info(m).posterior)
        self.uris = {m: store.posterior_uri(m) for m in self.post_methods}
        from pipelines.cli.reuse import plan_reuse

        # an earlier run's curvature, posteriors and search, when schedule.reuse finds one (read in place)
        self.reuse = plan_reuse(self, self.stages)
        self.stages, self.uris = self.reuse.stages, self.reuse.uris

    @property
    def results(self) -> dict[str, Any]:
        return self.stages.results

    def _coverage(self) -> Any:
        """Weights under the posterior / left at MAP (laplace_core.posteriors.sizes), for the summary and report.
        A ``posterior.layers`` name or glob that matches no layer is a ConfigError here, before any
        cluster work."""
        from laplace_core.curvature.layer_selection import LayerSelectionError
        from pipelines.ingest.models import model_coverage

        try:
            return model_coverage(self.spec.name, self.spec.num_classes or len(self.splits.classes),
                                  self.cfg.posterior.norm_layers, self.cfg.posterior.layers)["summary"]
        except LayerSelectionError as e:
            raise ConfigError(f"posterior.layers: {e}") from None
        except ValueError as e:
            return f"not computed: {e}"

    # ------------------------------------------------------------------ curvature
    def curvature(self) -> CurvatureResult:
        """The reduced statistics and eigenbasis (+ the subnet pass's S x S Fisher)."""
        from pipelines.passes.curvature import CurvatureConfig

        cfg = self.cfg
        subnet_cfg = None
        if "subnet" in self.methods:  # not built from the reduced sums alone: the stage adds its S x S pass
            from pipelines.passes.subnet import subnet_config

            subnet_cfg = subnet_config(cfg.posterior, cfg.curvature.fisher,
                                       self.spec.num_classes or len(self.splits.classes))
        # the curvature section, the per-layer methods and the posterior's layer choice (no field named)
        curv_cfg = derive(CurvatureConfig, cfg.posterior, cfg.curvature,
                          methods=tuple(m for m in self.methods if method_info(m).per_layer))
        fp = {"version": FINGERPRINT_VERSION, "model": to_dict(self.spec), "train": self.splits.train.fingerprint,
              "curvature": fingerprint_fields(curv_cfg), "image": [cfg.data.image_size, cfg.data.resize_size],
              "subnet": None if subnet_cfg is None else dataclasses.asdict(subnet_cfg)}
        summary = self.stages.run("curvature", fp, lambda: self._do_curvature(curv_cfg, subnet_cfg))
        return CurvatureResult(fp, summary, config=curv_cfg, subnet=subnet_cfg)

    def _do_curvature(self, curv_cfg: Any, subnet_cfg: Any) -> dict[str, Any]:
        from pipelines.passes.curvature import run_curvature

        train_dcfg = self.splits.train_config
        self._announce_disk()
        res = run_curvature(self.spec, self.splits.parts, curv_cfg, self.store, data_config=train_dcfg)
        passes, subnet = dict(res.passes), None
        if subnet_cfg is not None:  # Daxberger et al. (2021): select from the reduced sums, S x S Fisher pass
            from pipelines.passes.subnet import run_subnet_pass

            subnet_res = run_subnet_pass(self.spec, self.splits.parts, curv_cfg, subnet_cfg, self.store,
                                         data_config=train_dcfg, stats=res.stats)
            passes.update(subnet_res.passes)
            subnet = {k: v for k, v in dataclasses.asdict(subnet_res).items() if k != "passes"}
        from pipelines.storage.disk import drop, human

        freed = drop([self.store.pass_uri(p) for p in ("pass1", "pass2")], self.store)
        if freed:
            log(f"disk: removed the pass checkpoints ({human(freed)}): stats/reduced holds the same sums")
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
    def posterior(self, curvature: CurvatureResult) -> StageResult:
        # adding "temperature" to the methods does not rebuild the posteriors
        fp = {**curvature.fingerprint,
              "posterior": {**fingerprint_fields(self.cfg.posterior), "methods": list(self.post_methods)}}
        return StageResult(fp, self.stages.run("posterior", fp, self._do_posterior))

    def _do_posterior(self) -> dict[str, Any]:
        from pipelines.passes.posterior import build_posteriors

        from pipelines.errors import StageError

        post = self.cfg.posterior
        if not self.store.exists(self.store.reduced_uri()):
            raise StageError(f"posterior: {self.store.reduced_uri()} was dropped after an earlier posterior stage "
                             "(storage.keep_stats=false); redo the statistics with --force curvature")
        out = {"posteriors": build_posteriors(self.store, self.post_methods, post.rank, n_data=post.n_data,
                                              prior_precision=post.prior_precision)}
        self._keep_or_drop_stats()
        return out

    def _announce_disk(self) -> None:
        """One line before pass 1: the bytes the statistics, checkpoint and posteriors will take."""
        from pipelines.ingest.models import model_size_report
        from pipelines.storage.disk import announce, expected_bytes

        curvature, post = self.cfg.curvature, self.cfg.posterior
        try:
            rep = model_size_report(self.spec.name, self.spec.num_classes or len(self.splits.classes),
                                    post.norm_layers, post.layers, post.rank)
        except (ValueError, RuntimeError) as e:  # a model that cannot be built without weights: said, not fatal
            log(f"disk: expected sizes not computed ({e})")
            return
        est = expected_bytes(rep, self.post_methods, stats_bytes=8 if curvature.stats_dtype == "float64" else 4,
                             efb=any(method_info(m).needs_efb for m in self.post_methods if m != "subnet"))
        log(announce(est, self.cfg.storage.keep_stats))

    def _keep_or_drop_stats(self) -> None:
        """After the posteriors: ``storage.keep_stats=false`` drops what only built them; the log
        says what stays (the eigenbasis always: the kfac/efb posteriors reference its eigenvectors)."""
        from pipelines.storage.disk import drop, human, tree_bytes

        store = self.store
        stats = [store.reduced_uri(), store.subnet_uri()]
        if self.cfg.storage.keep_stats:
            kept = sum(tree_bytes(u, self.store) for u in stats)
            log(f"disk: kept stats/reduced ({human(kept)}) to rebuild posteriors with other settings, and "
                f"stats/eigenbasis ({human(tree_bytes(store.basis_uri(), store))}); "
                "storage.keep_stats=false drops the statistics after this stage")
        else:
            freed = drop(stats, self.store)
            log(f"disk: dropped the statistics ({human(freed)}, storage.keep_stats=false); kept stats/eigenbasis "
                f"({human(tree_bytes(store.basis_uri(), store))}), which the posteriors reference")

    # ------------------------------------------------------------------ (N, tau) search
    def search(self, posterior: StageResult) -> SearchResult:
        """The search scores with the evaluation's actors and ECE (``evaluate``'s :class:`ActorSpec`
        fields); the temperature is fitted on the same split."""
        fp = {**posterior.fingerprint, "search": fingerprint_fields(self.cfg.search),
              "actors": fingerprint_fields(self.cfg.evaluate, ActorSpec), "val": self.splits.search.fingerprint,
              "temperature": TEMPERATURE in self.methods}
        summary = self.stages.run("search", fp, lambda: self._do_search(fp))
        if summary is None:
            return SearchResult(fp, None)
        write_search_table(self.store, self.post_methods)
        from pipelines.evaluation.temperature import with_fallback

        fitted = summary.get("temperature")
        return SearchResult(fp, summary,
                            hyper={m: (c["n_data"], c["prior_precision"])
                                   for m, c in summary["chosen"].items() if c is not None},
                            temperature=None if fitted is None else float(with_fallback(fitted)["temperature"]),
                            pred_types={m: c["pred_type"] for m, c in summary["chosen"].items()
                                        if c is not None and c.get("pred_type")} or None)

    def _do_search(self, fp: dict[str, Any]) -> dict[str, Any]:
        from pipelines.evaluation.runtime import search_config
        from pipelines.evaluation.search import search
        from pipelines.evaluation.tune import chunk_refs
        from pipelines.ingest.batches import build_dataset

        splits = self.splits
        search_cfg = search_config(self.cfg, expected_rows=(len(splits.search), None),
                                   **actor_resources(self.cfg.evaluate),
                                   decode_cpus=float(self.cfg.data.decode_num_cpus))
        out: dict[str, Any] = {"chosen": {}, "notes": {}, "map": {}, "info": {"device": search_cfg.resolved_device},
                               "failed": 0, "table": self.store.search_table_uri()}
        # the search split read and decoded once, into chunks in the object store: the search's
        # trials and the temperature fit both score them
        chunked = (chunk_refs(build_dataset(splits.search, splits.search_config), search_cfg)
                   if self.uris or TEMPERATURE in self.methods else None)
        if self.uris:
            # a re-submitted job resumes the Tune experiment of this key
            res = search(self.spec, self.uris, None, search_cfg, store=self.store, key=fingerprint(fp)[:12],
                         chunked=chunked)
            from pipelines.report.edges import edge_notes

            for line in edge_notes(res.chosen, to_dict(self.cfg.search)):
                log(f"search: {line}")
            if preds := list(res.predictive_lines().values()):  # one line for all methods
                log("search: " + " | ".join(preds))
            for line in res.marks().values():
                log(f"search: {line}")
            out.update(chosen=res.chosen, notes=res.notes, map=res.map, against_map=res.against_map,
                       not_better_than_map=res.marks(),
                       info={**res.info, "device": search_cfg.resolved_device},
                       failed=sum(1 for r in res.rows if r["status"] != "ok"),
                       skipped={"count": res.info["skipped"], "examples": res.info.get("skipped_examples", [])})
        if TEMPERATURE in self.methods:  # Guo et al. (2017): T by NLL on the search split
            from pipelines.evaluation.temperature import fit_temperature_run

            fit = fit_temperature_run(self.spec, chunked[0], search_cfg, skipped=chunked[2]["count"],
                                      store=self.store)
            if fit.get("fallback"):
                log(fit["fallback"])
            else:
                log(f"temperature: T = {fit['temperature']:.4g} (search-split NLL {fit['nll_before']:.4f} -> "
                    f"{fit['nll_after']:.4f}){'; ' + fit['note'] if fit.get('note') else ''}")
            out["temperature"] = fit
        return out

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, searched: SearchResult) -> StageResult:
        """The test split and the OOD set, at the chosen ``(N, τ)``; with ``evaluate.shift``
        also the test split under each corruption and severity (:mod:`pipelines.evaluation.shift`)."""
        splits = self.splits
        fp = {**searched.fingerprint, "evaluate": fingerprint_fields(self.cfg.evaluate),
              "test": splits.test.fingerprint, "ood": None if splits.ood is None else splits.ood.fingerprint,
              "ood_sets": [[o.name, o.group, o.index.fingerprint] for o in splits.oods],
              "hyper": searched.hyper, "fitted_temperature": searched.temperature,
              **({"pred_types": searched.pred_types} if searched.pred_types else {})}
        return StageResult(fp, self.stages.run("evaluate", fp, lambda: self._do_evaluate(searched)))

    def _do_evaluate(self, searched: SearchResult) -> dict[str, Any]:
        from pipelines.evaluation.evaluate import evaluate
        from pipelines.evaluation.runtime import eval_config
        from pipelines.ingest.batches import build_dataset

        evaluate_spec, splits = self.cfg.evaluate, self.splits
        n_ood = sum(len(o.index) for o in splits.oods)
        eval_cfg = eval_config(self.cfg, expected_rows=(len(splits.test), n_ood if splits.oods else None),
                               **actor_resources(evaluate_spec), decode_cpus=float(self.cfg.data.decode_num_cpus),
                               method_pred_types=tuple(sorted((searched.pred_types or {}).items())))
        ood_ds = [(o.name, o.group, build_dataset(o.index, o.config)) for o in splits.oods] or None
        res = evaluate(self.spec, self.uris, build_dataset(splits.test, splits.test_config), ood_ds, eval_cfg,
                       store=self.store, hyper=searched.hyper, temperature=searched.temperature)
        out = {"methods": {m: headline(r) for m, r in res.items()}, "device": eval_cfg.resolved_device,
               "skipped": {k: v for k, v in (("test", res["map"].get("skipped")),
                                             ("ood", res["map"].get("ood_skipped"))) if v is not None}}
        if evaluate_spec.shift is not None:
            from pipelines.evaluation.shift import evaluate_shift

            docs = evaluate_shift(self.spec, self.uris, splits.test, splits.test_config, eval_cfg,
                                  evaluate_spec.shift.corruptions, evaluate_spec.shift.severities, store=self.store,
                                  hyper=searched.hyper, temperature=searched.temperature)
            out["shift"] = {m: d["mean"] for m, d in docs.items()}
            from pipelines.report.shift import shift_headline

            for m, d in docs.items():  # the means over corruptions and severities join the headline numbers
                if m in out["methods"]:
                    out["methods"][m].update(shift_headline(d))
                    _join_intervals(out["methods"][m], d.get("intervals"))
        return out

    # ------------------------------------------------------------------ report
    def report(self, evaluated: StageResult, summary: dict[str, Any]) -> StageResult:
        def do_report() -> dict[str, Any]:
            from pipelines.report.load import load_eval_metrics
            from pipelines.report.write import write_report

            from pipelines.report.shift import load_shift, render_shift, shift_summary_section

            log("report: the summary table, the figures (matplotlib) and the HTML/Markdown pages")
            metrics = load_eval_metrics(self.store)
            table = read_search(self.store.at(self.reuse.search_output))
            figures = {}
            shift = load_shift(self.store, metrics)
            if shift:  # metric against severity, one line per method
                figures["shift"] = self.store.figure_uri("shift")
                self.store.write_bytes_atomic(figures["shift"], render_shift(shift))
            from pipelines.report.history import trend_parts

            trend_figures, trend_sections = trend_parts(self.cfg.schedule.history, self.store.output, self.spec.name,
                                                        self.store.options)  # a scheduled audit's metrics over time
            families = shift_summary_section(shift) if shift else None  # ImageNet-C's families, all 15
            return {"paths": write_report(self.store, summary, metrics, table, figures={**figures, **trend_figures},
                                          sections=[*([families] if families else []), *trend_sections])}

        fp = {**evaluated.fingerprint, "report": 1}
        return StageResult(fp, self.stages.run("report", fp, do_report))

    def run_all(self) -> RunResult:
        """Curvature, posterior, search and evaluation, each fed the one before."""
        t0 = time.perf_counter()
        curvature = self.curvature()
        posterior = self.posterior(curvature)
        searched = self.search(posterior)
        evaluated = self.evaluate(searched)
        return RunResult(curvature, posterior, searched, evaluated, time.perf_counter() - t0)


def _join_intervals(head: dict[str, Any], shift_iv: dict[str, Any] | None) -> None:
    """The shift means' intervals (:func:`laplace_core.metrics.bootstrap.bootstrap_means`) join the
    headline's ``intervals`` (``ci`` and ``paired`` per reference)."""
    iv = head.get("intervals")
    if not shift_iv or not isinstance(iv, dict):
        return
    iv.setdefault("ci", {}).update(shift_iv.get("ci") or {})
    for ref, p in (shift_iv.get("paired") or {}).items():
        iv.setdefault("paired", {}).setdefault(ref, {}).update(p)


def headline(r: dict[str, Any]) -> dict[str, Any]:
    """The evaluation numbers kept in the stage marker and run.json."""
    keys = ("status", "reason", "accuracy", "nll", "brier", "ece", "ece_variant", "entropy_mean", "n_data",
            "prior_precision")
    out = {k: r.get(k) for k in keys if k in r}
    if isinstance(r.get("ood"), dict):
        out["ood_auroc"] = r["ood"].get("auroc")
        out["ood_entropy_mean"] = r.get("ood_entropy_mean")
    ent = (r.get("ood_scores") or {}).get("entropy")
    if isinstance(ent, dict):  # exact, from the per-image scores
        out.update(ood_auroc=ent["auroc"], ood_fpr95=ent["fpr_at_95_tpr"], ood_aupr=ent["aupr"],
                   ood_scores=r["ood_scores"])
        from pipelines.report.oodsets import flat_set_metrics

        out.update(flat_set_metrics(r))  # per OOD set and group: ood_auroc@letters, ... (issue 39)
    sel = r.get("selective")
    if isinstance(sel, dict):
        out.update({k: sel[k] for k in ("aurc", "acc_at_90", "acc_at_95")})
    for k in ("intervals", "nll_from", "count", "temperature"):
        if k in r:
            out[k] = r[k]
    return out


def write_search_table(store: RunStore, methods) -> None:
    """One search table for all methods at ``eval/search.parquet`` (from the per-method files)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    target = store.search_table_uri()
    if store.exists(target):
        return
    tables = []
    for m in methods:
        uri = store.search_table_uri(m)
        if store.exists(uri):
            tables.append(pq.read_table(io.BytesIO(store.read_bytes(uri))))
    if tables:
        buf = io.BytesIO()
        pq.write_table(pa.concat_tables(tables), buf)
        store.write_bytes_atomic(target, buf.getvalue())


def read_search(store: RunStore):
    """The run's search table rows (None before the search)."""
    uri = store.search_table_uri()
    if not store.exists(uri):
        return None
    from pipelines.report.load import read_search_table

    return read_search_table(uri, store)
