"""Parallel Monte-Carlo evaluation of Laplace posteriors on Ray actors (``docs/design.md`` §1 "Predictive", §2).

Flow::

    results = evaluate(model_spec, {"inf": uri, ...}, in_ds, ood_ds, EvalConfig(), output=out)
    # results["map"], results["inf"], ... -> computed metrics (+ timings); writes
    # <out>/eval/<method>/metrics.json and accumulators.json

Settings: :class:`pipelines.evaluation.runtime.EvalConfig`. Parallelism: ``cfg.num_actors``
explicit Ray actors (:class:`EvalWorker`, on the actor engine of
:mod:`pipelines.evaluation.actors` that the search uses too). Each one loads the model
(``pipelines.ingest.models.load_model`` from a name + weights URI) and every posterior
(``laplace_core.load_posterior``) **once**, then consumes one iterator of
``in_ds.streaming_split(num_actors, equal=False)`` (and of the OOD dataset's split),
and returns, per method (``"map"`` plus every posterior), a mergeable
:class:`EvalAccumulator` as JSON — sums, counts and fixed-edge histograms, plus a few
float64 numbers per image (:class:`laplace_core.metrics.perimage.PerImage`). The driver merges
them in actor order (every method's per-image vectors in the same image order), computes the
metrics and the paired bootstrap intervals (:mod:`laplace_core.metrics.bootstrap`,
``cfg.bootstrap`` resamples seeded by ``cfg.seed``; ``metrics.json["intervals"]``).

Why 1 actor and 2 actors give the same predictions (the sample ``θ_t`` depends only
on ``(seed, t)``, :func:`laplace_core.predictive.monte_carlo.sample_seed`):

* every forward pass runs on **exactly** ``cfg.batch_size`` rows; valid images are
  re-batched into fixed-size batches and the last batch of a shard is zero-padded
  (padding rows are dropped from the outputs). Per-example results of a fixed-size
  batch do not depend on the other rows nor on the row's position (checked for the
  demo CNN, float32 and float64, 1 thread), so an example gets the bitwise same
  ``softmax(f(x; θ_t))`` whichever actor and batch it lands in;
* ``MCPredictor`` sums the ``K`` probabilities in float64 in the fixed order
  ``t = 0..K-1``; the metrics accumulate in float64 (counts and histograms exactly).

Merged accumulators of any sharding therefore have identical counts/histograms and
float sums equal up to summation order (~1e-16 relative). Actors run with
``cfg.torch_threads`` threads (default: the actor's CPU share rounded, at least 1).

Cost model (per actor, per method): ``K`` weight samples per *chunk* of
``cfg.chunk_size`` examples (samples outer, batches inner, as
:meth:`MCPredictor.predict_batches`), so a draw is amortised over the chunk; when
the ``K`` deltas of a method fit ``cfg.sample_cache_mb`` they are drawn once per
actor and reused for every chunk. Memory: one chunk of images plus ``[chunk, C]``
float64 sums.

Temperature scaling (``temperature=T``, the ``temperature`` row, Guo et al. 2017): the
actors also predict ``softmax(f(x; θ*)/T)``
(:class:`pipelines.evaluation.temperature.TemperaturePredictor`) and its metrics are computed
like every other row's (``pred_type: "temperature"``, ``num_stored: 1``).

ECE: both variants are accumulated (``ece_equal_width_<bins>`` and
``ece_equal_mass_<bins>``); ``cfg.ece_mode`` names the headline ``"ece"`` key and
``"ece_variant"`` says which one it is. OOD: the OOD set only updates the OOD part
(normalised-entropy AUROC/AUPR/FPR95 and the exact mean OOD entropy
``ood_entropy_mean``).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from laplace_core.posteriors.methods import TEMPERATURE
from laplace_core.metrics.base import NLL_EPS
from laplace_core.metrics.bootstrap import bootstrap, ood_summary
from laplace_core.metrics.calibration import Entropy
from laplace_core.metrics.perimage import PerImage, per_image_terms
from laplace_core.metrics.selective import selective_summary
from laplace_core.metrics.suite import MetricSuite

from pipelines.evaluation.actors import ActorProgress, ModelActor, inject_fault, run_actors
from pipelines.evaluation.chunks import iter_chunks, valid_batches
from pipelines.evaluation.predictors import MAP, finite_or_reason, make_predictor, model_ref, predict_chunk_stats
from pipelines.evaluation.runtime import EvalConfig
from pipelines.evaluation.temperature import TemperaturePredictor
from pipelines.storage import uris as storage
from pipelines.storage.store import RunStore

__all__ = [
    "EvalAccumulator",
    "evaluate_shard",
    "EvalWorker",
    "merge_worker_results",
    "paired_intervals",
    "evaluate",
]


# --------------------------------------------------------------------------- accumulator
@dataclass(frozen=True, eq=False)
class EvalAccumulator:
    """One method's evaluation state: a mergeable :class:`MetricSuite` (in-distribution
    metrics + OOD detection), an :class:`Entropy` over the OOD set (exact mean OOD entropy,
    which the suite's OOD histograms only approximate) and the per-image quantities
    (:class:`laplace_core.metrics.perimage.PerImage`: a few float64 numbers per image, merged by
    concatenation in actor order) behind the bootstrap intervals, selective prediction and the
    exact OOD metrics of every score."""

    suite: MetricSuite
    ood_entropy: Entropy
    per_image: PerImage = dataclasses.field(default_factory=PerImage)

    @classmethod
    def create(cls, cfg: EvalConfig) -> "EvalAccumulator":
        return cls(
            MetricSuite.create(ece_bins=cfg.ece_bins, entropy_bins=cfg.entropy_bins, ood_exact_limit=cfg.ood_exact_limit),
            Entropy(cfg.entropy_bins),
        )

    def update(self, probs: torch.Tensor, labels: torch.Tensor, log_probs: torch.Tensor | None = None,
               expected_entropy: torch.Tensor | None = None, exact: bool = True) -> "EvalAccumulator":
        """``log_probs``: exact log-probabilities (NLL from them when ``exact``); without them
        ``log probs`` stand in (floored NLL)."""
        lp = torch.log(probs.to(torch.float64).clamp_min(NLL_EPS)) if log_probs is None else log_probs
        exact = exact and log_probs is not None
        terms = per_image_terms(lp, labels, expected_entropy)
        return dataclasses.replace(self, suite=self.suite.update(probs, labels, lp if exact else None),
                                   per_image=self.per_image.add(terms, ood=False, exact_nll=exact))

    def update_ood(self, probs: torch.Tensor, log_probs: torch.Tensor | None = None,
                   expected_entropy: torch.Tensor | None = None, set_index: int | None = None) -> "EvalAccumulator":
        """``set_index``: the OOD set of these images (kept per image as ``set``), or None."""
        lp = torch.log(probs.to(torch.float64).clamp_min(NLL_EPS)) if log_probs is None else log_probs
        terms = per_image_terms(lp, None, expected_entropy)
        if set_index is not None:
            terms["set"] = torch.full((probs.shape[0],), float(set_index), dtype=torch.float64)
        return EvalAccumulator(self.suite.update_ood(probs), self.ood_entropy.update(probs),
                               self.per_image.add(terms, ood=True))

    def merge(self, other: "EvalAccumulator") -> "EvalAccumulator":
        return EvalAccumulator(self.suite.merge(other.suite), self.ood_entropy.merge(other.ood_entropy),
                               self.per_image.merge(other.per_image))

    def compute(self, ece_mode: str = "equal_width",
                ood_sets: Sequence[tuple[str, str | None]] | None = None) -> dict[str, Any]:
        """The metrics; with ``ood_sets`` (``(name, group)`` per set index) the OOD scores per set
        and group too (``ood_scores["per_set"]``)."""
        out = self.suite.compute()
        key = f"ece_{ece_mode}_{self.suite.ece.n_bins}"
        out["ece"] = out[key]
        out["ece_variant"] = key
        out["nll_from"] = ("log-probabilities (exact)" if self.per_image.exact_nll
                           else f"probabilities, floored at {NLL_EPS:g}")
        if self.ood_entropy.count:
            e = self.ood_entropy.compute()
            out["ood_entropy_mean"] = e["entropy_mean"]
            out["ood_entropy_hist"] = e["entropy_hist"]
        per = self.per_image
        if per.n:
            out["selective"] = selective_summary(per.inp["conf"], per.inp["correct"])
            if per.n_ood:
                out["ood_scores"] = ood_summary(per, ood_sets)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"format": "infoform.eval_accumulator", "version": 1,
                "suite": self.suite.to_json(), "ood_entropy": self.ood_entropy.to_json(),
                "per_image": self.per_image.to_json()}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "EvalAccumulator":
        if d.get("format") != "infoform.eval_accumulator":
            raise ValueError("not an EvalAccumulator JSON (format tag missing)")
        per = PerImage.from_json(d["per_image"]) if "per_image" in d else PerImage()
        return cls(MetricSuite.from_json(d["suite"]), Entropy.from_json(d["ood_entropy"]), per)


# --------------------------------------------------------------------------- one shard
def evaluate_shard(
    model: nn.Module,
    posteriors: Mapping[str, Any],
    in_batches: Iterable[Any],
    ood_batches: Iterable[Any] | None,
    cfg: EvalConfig,
    progress: Callable[[int, int], None] | None = None,
    temperature: float | None = None,
    ood_sets: Sequence[Iterable[Any]] | None = None,
) -> tuple[dict[str, EvalAccumulator], dict[str, Any]]:
    """Evaluate ``"map"`` and every posterior on one shard, in this process.

    ``in_batches`` / ``ood_batches``: iterables of ``(x, y)`` or dicts with image/label
    (invalid rows already removed). ``ood_sets``: one such iterable per named OOD set (its
    images keep the set's index, :mod:`laplace_core.metrics.oodsets`), instead of ``ood_batches``. Returns ``(accumulators, info)``; ``info`` holds
    ``seconds`` per method (predictions + metric updates), ``failed`` (method -> reason,
    e.g. non-finite predictions; that method's accumulator is dropped), ``examples``
    and ``ood_examples``. ``progress(split, n)``: called after each method of each chunk,
    with ``split`` 0 (in-domain) or 1 (OOD) and the method's share of the chunk's example count.
    ``temperature``: also evaluate the ``temperature`` row, ``softmax(f(x; θ*)/T)``.
    """
    cache_bytes = int(cfg.sample_cache_mb * 2**20)
    predictors: dict[str, Any] = {MAP: None}
    for m, post in posteriors.items():
        predictors[m] = make_predictor(model, post, cfg.pred_type_of(m), cfg.mc_samples, cfg.seed, cache_bytes)
    if temperature is not None:
        predictors[TEMPERATURE] = TemperaturePredictor(model, temperature)
    acc = {m: EvalAccumulator.create(cfg) for m in predictors}
    seconds = {m: 0.0 for m in predictors}
    failed: dict[str, str] = {}
    counts = {"examples": 0, "ood_examples": 0}
    dt, dev = cfg.torch_dtype, cfg.resolved_device

    def one(m: str, pred: Any, chunk: Any, ood: bool, set_index: int | None) -> None:
        t0 = time.perf_counter()
        lp, ent, exact = predict_chunk_stats(model, pred, chunk)
        p_all = torch.exp(lp)
        reason = finite_or_reason(p_all)
        if reason:
            failed[m] = reason
        elif ood:
            acc[m] = acc[m].update_ood(p_all, lp, ent, set_index)
        else:
            acc[m] = acc[m].update(p_all, torch.cat(chunk.ys), lp, ent, exact)
        seconds[m] += time.perf_counter() - t0

    def run(batches: Iterable[Any], ood: bool, set_index: int | None = None) -> None:
        for chunk in iter_chunks(batches, cfg.batch_size, cfg.batches_per_chunk, dtype=dt, device=dev):
            counts["ood_examples" if ood else "examples"] += chunk.count
            for m, pred in predictors.items():
                if m not in failed:
                    one(m, pred, chunk, ood, set_index)
                if progress is not None:  # each method its share of the chunk: a line while a long chunk runs
                    progress(int(ood), chunk.count / len(predictors))

    with torch.no_grad():
        run(in_batches, ood=False)
        if ood_batches is not None:
            run(ood_batches, ood=True)
        for k, batches in enumerate(ood_sets or ()):
            if batches is not None:
                run(batches, ood=True, set_index=k)
    for m in failed:
        acc.pop(m, None)
    return acc, {"seconds": seconds, "failed": failed, **counts}


# --------------------------------------------------------------------------- Ray actor
class EvalWorker(ModelActor):
    """Ray actor body of :func:`evaluate` (:class:`pipelines.evaluation.actors.ModelActor`:
    the model and the posteriors loaded once); ``run(in_shard, *ood_shards)`` evaluates one
    ``streaming_split`` iterator of each dataset (the test split, then each OOD set) and returns
    JSON-able accumulators;
    ``temperature``: the fitted ``T`` of the ``temperature`` row, or None."""

    def __init__(self, model: Mapping[str, Any], posterior_uris: Mapping[str, str],
                 hyper: Mapping[str, Sequence[float]] | None, cfg: EvalConfig,
                 store: RunStore = RunStore(), temperature: float | None = None):
        super().__init__(model, posterior_uris, hyper, cfg, store)
        self.temperature = temperature

    def run(self, in_shard: Any, *ood_shards: Any, actor_index: int = 0) -> dict[str, Any]:
        if self.init_error is not None:  # the driver stops the stage on ``started()``
            return {"init_error": self.init_error}
        t0 = time.perf_counter()
        in_it, in_skipped = valid_batches(in_shard, self.cfg.batch_size)
        in_it = self.watched(in_it)
        if self.cfg.fault_marker is not None:
            in_it = inject_fault(in_it, self.cfg.fault_marker)
        ood = [valid_batches(s, self.cfg.batch_size) for s in ood_shards if s is not None]
        acc, info = evaluate_shard(self.model, self.posteriors, in_it, None, self.cfg,
                                   progress=ActorProgress("evaluate", actor_index, self.cfg),
                                   temperature=self.temperature, ood_sets=[self.watched(it) for it, _ in ood])
        return {
            "accumulators": {m: a.to_json() for m, a in acc.items()},
            "seconds": info["seconds"],
            "failed": info["failed"],
            "examples": info["examples"],
            "ood_examples": info["ood_examples"],
            "skipped": in_skipped().to_dict(),
            "ood_skipped": _merge_skips([skipped().to_dict() for _, skipped in ood]),
            "load_seconds": self.load_seconds,
            "run_seconds": time.perf_counter() - t0,
        }


# --------------------------------------------------------------------------- driver
def _merge_skips(parts: Sequence[dict | None]) -> dict[str, Any] | None:
    from pipelines.ingest.batches import SkipReport

    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    rep = SkipReport()
    for p in parts:
        rep = rep.merge(SkipReport.from_dict(p))
    return rep.to_dict()


def merge_worker_results(results: Sequence[Mapping[str, Any]], methods: Sequence[str],
                         cfg: EvalConfig) -> dict[str, dict[str, Any]]:
    """Merge actor results (in the given order) into ``method -> {"accumulator", "seconds",
    "failed"}``; a method that failed on any actor is failed."""
    out: dict[str, dict[str, Any]] = {}
    for m in methods:
        reasons = [r["failed"][m] for r in results if m in r["failed"]]
        secs = [float(r["seconds"].get(m, 0.0)) for r in results]
        entry: dict[str, Any] = {"seconds_sum": sum(secs), "seconds_max": max(secs) if secs else 0.0}
        if reasons:
            entry["failed"] = reasons[0]
            entry["accumulator"] = None
        else:
            acc = EvalAccumulator.create(cfg)
            for r in results:
                acc = acc.merge(EvalAccumulator.from_json(r["accumulators"][m]))
            entry["accumulator"] = acc
            entry["failed"] = None
        out[m] = entry
    return out


def paired_intervals(merged: Mapping[str, Mapping[str, Any]], cfg: EvalConfig,
                     ood_sets: Sequence[tuple[str, str | None]] | None = None) -> dict[str, dict[str, Any]]:
    """The paired bootstrap (:func:`laplace_core.metrics.bootstrap.bootstrap`) over the methods
    that finished, against MAP and temperature scaling: ``method -> intervals`` (with
    ``ood_sets``, every OOD set's and group's metrics too)."""
    per = {m: e["accumulator"].per_image for m, e in merged.items() if e["accumulator"] is not None}
    per = {m: p for m, p in per.items() if p.n}
    if not per:
        return {}
    return bootstrap(per, cfg.bootstrap, cfg.seed, (MAP, TEMPERATURE), ece_bins=cfg.ece_bins, ece_mode=cfg.ece_mode,
                     ood_sets=ood_sets)


def evaluate(
    model_spec: Any,
    posterior_uris: Mapping[str, str],
    in_ds: Any,
    ood_ds: Any | None | Sequence[tuple[str, str | None, Any]],
    cfg: EvalConfig = EvalConfig(),
    *,
    store: RunStore = RunStore(),
    hyper: Mapping[str, Sequence[float]] | None = None,
    temperature: float | None = None,
) -> dict[str, dict[str, Any]]:
    """MC evaluation of the MAP baseline and every posterior on Ray actors.

    ``model_spec``: ``ModelSpec``-like (name, weights URI, num_classes) or a mapping.
    ``posterior_uris``: ``method -> artifact URI`` (``Posterior.save``). ``in_ds``: Ray
    Dataset with columns image/label/path/valid (``pipelines.ingest.batches.build_dataset``; the
    labelled test split). ``ood_ds``: the same for one OOD set (named ``ood``), a list of
    ``(name, group, dataset)`` for several named sets, or None. ``hyper``: optional
    ``method -> (N, τ)`` applied with ``with_hyper`` inside the actors (e.g. the search's
    choice). ``temperature``: the fitted ``T`` of the ``temperature`` row (evaluated after
    the posteriors; :mod:`pipelines.evaluation.temperature`). Returns ``method -> metrics`` (``"map"`` always first): the output of
    :meth:`EvalAccumulator.compute` plus ``method``, ``status`` ("ok"/"failed"),
    ``reason``, ``pred_type``, ``mc_samples``, ``seed``, ``n_data``, ``prior_precision``,
    ``timing`` (``seconds_sum`` / ``seconds_max`` over actors, ``wall_s``, ``load_s_max``),
    ``skipped`` / ``ood_skipped`` (invalid images). ``store``: the run's store (its storage options
    read the model and posteriors); with an output, writes ``<output>/eval/<method>/metrics.json``
    and ``accumulators.json`` (atomic).
    """
    if not isinstance(cfg, EvalConfig):
        raise ValueError(f"cfg must be an EvalConfig, got {type(cfg).__name__}")
    ref = model_ref(model_spec)
    uris = dict(posterior_uris)
    if MAP in uris:
        raise ValueError(f"{MAP!r} is the baseline and always evaluated; do not pass a posterior under that name")
    if hyper:
        unknown = sorted(set(hyper) - set(uris))
        if unknown:
            raise ValueError(f"hyper given for methods without a posterior: {unknown}; posteriors: {sorted(uris)}")
    if TEMPERATURE in uris:
        raise ValueError(f"{TEMPERATURE!r} has no posterior: pass its fitted T as temperature=")
    methods = [MAP, *uris, *([TEMPERATURE] if temperature is not None else [])]
    t0 = time.perf_counter()
    named = _named_sets(ood_ds)
    sets = [(n, g) for n, g, _ in named] or None
    results = run_actors(EvalWorker, (ref, uris, dict(hyper) if hyper else None, cfg, store, temperature),
                         [in_ds, *[ds for _, _, ds in named]], cfg)
    wall = time.perf_counter() - t0
    merged = merge_worker_results(results, methods, cfg)
    skipped = _merge_skips([r["skipped"] for r in results])
    ood_skipped = _merge_skips([r["ood_skipped"] for r in results])
    hyper_used = _hyper_of(uris, hyper, store)
    intervals = paired_intervals(merged, cfg, sets)
    out: dict[str, dict[str, Any]] = {}
    for m in methods:
        e = merged[m]
        res: dict[str, Any] = {"method": m, "pred_type": "map" if m == MAP else cfg.pred_type_of(m),
                               "mc_samples": None if m == MAP else cfg.mc_samples, "seed": cfg.seed}
        if m == TEMPERATURE:
            res.update(pred_type=TEMPERATURE, mc_samples=None, temperature=float(temperature), num_stored=1)
        res.update(hyper_used.get(m, {}))
        if e["failed"] is None:
            res.update(e["accumulator"].compute(cfg.ece_mode, sets))
            res["status"], res["reason"] = "ok", ""
            if m in intervals:
                res["intervals"] = intervals[m]
        else:
            res["status"], res["reason"] = "failed", e["failed"]
        res["timing"] = {"seconds_sum": e["seconds_sum"], "seconds_max": e["seconds_max"], "wall_s": wall,
                         "load_s_max": max(r["load_seconds"] for r in results), "num_actors": cfg.num_actors}
        res["skipped"], res["ood_skipped"] = skipped, ood_skipped
        out[m] = res
        if store.output is not None:
            d = store.eval_uri(m)
            store.write_json_atomic(storage.join(d, "metrics.json"), res)
            if e["accumulator"] is not None:
                store.write_json_atomic(storage.join(d, "accumulators.json"), e["accumulator"].to_json())
    return out


def _named_sets(ood_ds: Any) -> list[tuple[str, str | None, Any]]:
    """``[(name, group, dataset)]`` of ``evaluate``'s ``ood_ds`` argument (one dataset: ``ood``)."""
    if ood_ds is None:
        return []
    if isinstance(ood_ds, (list, tuple)):
        return [(str(n), g, ds) for n, g, ds in ood_ds]
    return [("ood", None, ood_ds)]


def _hyper_of(uris: Mapping[str, str], hyper: Mapping[str, Sequence[float]] | None,
              store: RunStore) -> dict[str, dict[str, Any]]:
    """``method -> {"n_data", "prior_precision", "hyper_source"}`` as evaluated: from ``hyper``
    when given, else from the artifact's manifest (``meta.n_data`` / ``meta.prior_precision``)."""
    from laplace_core.io import MANIFEST_FILE

    out: dict[str, dict[str, Any]] = {}
    for m, uri in uris.items():
        if hyper and hyper.get(m) is not None:
            n, t = hyper[m]
            out[m] = {"n_data": float(n), "prior_precision": float(t), "hyper_source": "given"}
        else:
            meta = store.read_json(storage.join(uri, MANIFEST_FILE)).get("meta", {})
            out[m] = {"n_data": meta.get("n_data"), "prior_precision": meta.get("prior_precision"),
                      "hyper_source": "artifact"}
    return out
