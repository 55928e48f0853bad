"""Random search over the Laplace hyperparameters ``(N, τ)`` on Ray actors (``docs/design.md`` §1, §2).

``P = N F/M + τ I``: the search draws ``cfg.num_configs`` pairs ``(log10 N, log10 τ)``
uniformly from ``cfg.log10_n`` x ``cfg.log10_tau`` with ``numpy.random.default_rng(seed)``
(100 configurations by default, as in Lee et al. 2020), the same pairs for every method
unless ``cfg.method_ranges`` gives a method ranges of its own (its pairs are then the
same uniform draws mapped onto its ranges: configuration ``i`` of every method shares its
random numbers), and scores each on a held-out, labelled **validation** split of the in-domain data with
the MC predictive (``cfg.mc_samples``, default 10; the same ``θ_t`` noise ``(seed, t)``
for every configuration, i.e. common random numbers, which makes the comparison less
noisy). ``cfg.pred_types`` (``search.pred_types``, e.g. ``[nn, glm]``) runs the search once per
predictive (weight sampling ``nn``, the linearised ``glm``; the same configurations and draws)
and chooses per method over all of them: the chosen row names its ``pred_type``, which the
evaluation then uses for that method (``EvalConfig.method_pred_types``) and the judgement
against MAP applies (:mod:`pipelines.evaluation.against_map`); without it, ``cfg.pred_type`` alone.
With the ``nll`` objective a later-listed predictive is chosen only when its best is lower than
the first-listed one's by more than :data:`PRED_TIE_NATS` (at the MAP limit both are MAP's within
MC noise, and the GLM costs several times more in the evaluation).

Settings: :class:`pipelines.evaluation.runtime.SearchConfig` (in a run, the ECE variant and
bins are the evaluation's, ``evaluate.ece_mode`` / ``evaluate.ece_bins``). Execution:
:func:`search` runs a Ray Tune experiment (:mod:`pipelines.evaluation.tune`): one trial per
``(method, configuration)`` on Tune actors that keep the model and posteriors loaded,
scoring the split chunk by chunk (``cfg.chunk_size`` examples, default 4096) and reporting
the running objective, so that ``cfg.scheduler="asha"`` can stop bad configurations early;
``cfg.algorithm="tpe"`` lets Optuna propose the configurations. A configuration is
re-targeted with ``laplace_core.posteriors.build.with_hyper`` (reuses the stored eigenvectors,
``Λ/M``, ``D``; INF redoes only its ``L x L`` eigh) once per trial. :func:`search_shard` is
the same scoring in one process over every configuration (the reference the Tune search is
tested against).

Failures never stop the search: a configuration whose precision is not positive
definite (``with_hyper`` raises) or whose predictions are not finite on any shard is
marked ``status="failed"`` with the reason. Choice per method: objective ``"nll"``
(default) = smallest NLL; ``"ece"`` = smallest ECE (``cfg.ece_mode``) among the
configurations with ``accuracy >= cfg.accuracy_floor`` (no floor when None); ties ->
lowest configuration id. No eligible configuration -> ``chosen[method] = None`` with
the reason in ``notes``.

Artifacts (with ``output``): ``<output>/eval/<method>/search.parquet`` (one row per
configuration: config_id, method, log10_n, log10_tau, n_data, prior_precision, nll,
ece, accuracy, brier, count, status ("ok", "failed", or "stopped" by ASHA: its metrics
are over the images it saw), reason, seconds, images: the images it was evaluated on) and
``<output>/eval/<method>/search.json`` (choice, objective, floor, MAP reference on
the validation split, search settings).
"""
from __future__ import annotations

import dataclasses
import io
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from pipelines.errors import StageError
from pipelines.evaluation.against_map import MIN_GAIN
from pipelines.evaluation.chunks import iter_chunks
from pipelines.evaluation.trials import HyperConfig, SearchAccumulator, sample_configs
from pipelines.evaluation.predictors import MAP, finite_or_reason, make_predictor, model_ref, predict_chunk
from pipelines.evaluation.runtime import OBJECTIVES, SearchConfig
from pipelines.storage import uris as storage
from pipelines.storage.store import RunStore

__all__ = [
    "TABLE_COLUMNS",
    "SearchResult",
    "search_shard",
    "search",
    "choose",
    "PRED_TIE_NATS",
]

#: Nats per image: a predictive listed after the first in ``search.pred_types`` is chosen only when
#: its best validation NLL is lower by more than this (the MAP-limit tolerance of the judgement).
PRED_TIE_NATS = MIN_GAIN

#: Columns of ``search.parquet`` (:meth:`SearchResult.table`).
TABLE_COLUMNS = ("config_id", "method", "pred_type", "log10_n", "log10_tau", "n_data", "prior_precision", "nll", "ece",
                 "accuracy", "brier", "count", "status", "reason", "seconds", "images")


# --------------------------------------------------------------------------- one shard
def search_shard(
    model: nn.Module,
    posteriors: Mapping[str, Any],
    batches: Iterable[Any],
    cfg: SearchConfig,
    configs: Sequence[HyperConfig] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Score every configuration of every posterior (and the MAP reference) on one shard.

    Returns ``{"acc": {method: {config_id: SearchAccumulator}}, "map": SearchAccumulator,
    "failed": {method: {config_id: reason}}, "seconds": {method: {config_id: s}},
    "examples": n}``. Accumulators of failed configurations are dropped.
    ``progress(0, n)``: called after each (method, configuration) of each chunk of ``n``
    examples (the work unit is one example under one configuration).
    """
    from laplace_core.posteriors.build import with_hyper

    by_method = {m: tuple(configs) if configs is not None else sample_configs(cfg, m) for m in posteriors}
    acc: dict[str, dict[int, SearchAccumulator]] = {
        m: {c.config_id: SearchAccumulator.create(cfg) for c in by_method[m]} for m in posteriors}
    failed: dict[str, dict[int, str]] = {m: {} for m in posteriors}
    seconds: dict[str, dict[int, float]] = {m: {c.config_id: 0.0 for c in by_method[m]} for m in posteriors}
    map_acc = SearchAccumulator.create(cfg)
    pairs = [(m, c) for m in posteriors for c in by_method[m]]
    n = 0
    with torch.no_grad():
        for chunk in iter_chunks(batches, cfg.batch_size, cfg.batches_per_chunk, dtype=cfg.torch_dtype,
                                 device=cfg.resolved_device):
            n += chunk.count
            y = torch.cat(chunk.ys)
            map_acc = map_acc.update(torch.cat(predict_chunk(model, None, chunk)), y)
            for m, c in pairs:
                if c.config_id in failed[m]:
                    continue
                t0 = time.perf_counter()
                updated, reason = _score_config(model, posteriors[m], c, cfg, chunk, y, acc[m][c.config_id])
                if reason:
                    failed[m][c.config_id] = reason
                    continue
                acc[m][c.config_id] = updated
                seconds[m][c.config_id] += time.perf_counter() - t0
                if progress is not None:
                    progress(0, chunk.count)
    for m in posteriors:
        for cid in failed[m]:
            acc[m].pop(cid, None)
    return {"acc": acc, "map": map_acc, "failed": failed, "seconds": seconds, "examples": n}


def _score_config(model: nn.Module, post: Any, c: HyperConfig, cfg: SearchConfig, chunk: Any, y: torch.Tensor,
                  acc: SearchAccumulator) -> tuple[SearchAccumulator | None, str]:
    """``(acc updated with one chunk under configuration c, "")``, or ``(None, why it failed)``."""
    from laplace_core.posteriors.build import with_hyper

    try:
        post_c = with_hyper(post, c.n_data, c.prior_precision)
    except ValueError as e:
        return None, str(e)
    pred = make_predictor(model, post_c, cfg.pred_type, cfg.mc_samples, cfg.seed, 0)
    p = torch.cat(predict_chunk(model, pred, chunk))
    reason = finite_or_reason(p)
    if reason:
        return None, reason
    try:
        return acc.update(p, y), ""
    except ValueError as e:  # e.g. rows not summing to 1 after overflow
        return None, f"invalid predictions: {e}"


# --------------------------------------------------------------------------- driver
@dataclass(frozen=True)
class SearchResult:
    """``rows``: one dict per (method, configuration) with :data:`TABLE_COLUMNS`;
    ``chosen``: method -> ``{"config_id", "log10_n", "log10_tau", "n_data",
    "prior_precision", "nll", "ece", "accuracy", "brier"}`` or None; ``notes``: method ->
    why nothing was chosen; ``map``: MAP metrics on the validation split; ``info``:
    settings, counts and timings; ``against_map``: method -> the chosen configuration against
    MAP on the same validation images (:func:`pipelines.evaluation.against_map.judge_terms`:
    ``diff``, ``lo``, ``hi``, ``improved``, ``mark``), or None when nothing was chosen."""

    rows: tuple[dict[str, Any], ...]
    chosen: dict[str, dict[str, Any] | None]
    notes: dict[str, str] = field(default_factory=dict)
    map: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    against_map: dict[str, dict[str, Any] | None] = field(default_factory=dict)

    def marks(self) -> dict[str, str]:
        """``method -> "no configuration of <method> improved validation NLL over MAP (...)"`` for
        every method whose chosen configuration did not beat MAP on validation."""
        from pipelines.evaluation.against_map import not_better_line

        return {m: line for m in self.chosen if m in self.against_map
                and (line := not_better_line(m, self.against_map[m]))}

    def predictive_lines(self) -> dict[str, str]:
        """``method -> "<method>: predictive glm chosen (validation nll 0.12; best nn 0.15)"`` when
        more than one predictive was searched: the best row of each, the chosen one first."""
        out = {}
        key = "nll" if self.info.get("objective", "nll") == "nll" else "ece"
        for m, c in self.chosen.items():
            ok = [r for r in self.rows if r["method"] == m and r["status"] == "ok"]
            best = {pt: min(r[key] for r in ok if r["pred_type"] == pt) for pt in {r["pred_type"] for r in ok}}
            if c is None or len(self.info.get("pred_types", ())) < 2:
                continue
            others = "; ".join(f"best {pt} {v:.4f}" for pt, v in sorted(best.items()) if pt != c["pred_type"])
            out[m] = (f"{m}: predictive {c['pred_type']} chosen (validation {key} {c[key]:.4f}"
                      f"{'; ' + others if others else ''})")
        return out

    def hyper(self) -> dict[str, tuple[float, float]]:
        """``method -> (N, τ)`` of the chosen configurations (for ``evaluate(hyper=...)``)."""
        return {m: (c["n_data"], c["prior_precision"]) for m, c in self.chosen.items() if c is not None}

    def table(self, method: str | None = None):
        """The rows (of one method, or all) as a ``pyarrow.Table`` with :data:`TABLE_COLUMNS`."""
        import pyarrow as pa

        rows = [r for r in self.rows if method is None or r["method"] == method]
        types = {"config_id": pa.int64(), "method": pa.string(), "pred_type": pa.string(), "count": pa.int64(), "status": pa.string(),
                 "reason": pa.string(), "images": pa.int64()}
        cols = {k: pa.array([r[k] for r in rows], type=types.get(k, pa.float64())) for k in TABLE_COLUMNS}
        return pa.table(cols)


def choose(rows: Sequence[Mapping[str, Any]], objective: str = "nll", accuracy_floor: float | None = None
           ) -> tuple[dict[str, Any] | None, str]:
    """Best row of one method's table: ``(row, "")`` or ``(None, reason)`` (see module doc)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown search objective {objective!r}; valid: {', '.join(OBJECTIVES)}")
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return None, f"all {len(rows)} configurations failed"
    if objective == "ece" and accuracy_floor is not None:
        ok = [r for r in ok if r["accuracy"] >= accuracy_floor]
        if not ok:
            return None, f"no configuration reached the accuracy floor {accuracy_floor}"
    key = "nll" if objective == "nll" else "ece"
    best = min(ok, key=lambda r: (r[key], r["config_id"]))  # equal values: the first listed predictive
    own = [r for r in ok if r.get("pred_type") == ok[0].get("pred_type")]  # the first-listed predictive's rows
    if key == "nll" and best.get("pred_type") != own[0].get("pred_type"):
        first = min(own, key=lambda r: (r[key], r["config_id"]))
        best = first if first[key] - best[key] <= PRED_TIE_NATS else best
    return dict(best), ""


def _parquet_bytes(table) -> bytes:
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def _rows(method: str, pred_type: str, trials: Sequence[Mapping[str, Any]], images: int,
          chunks: int) -> list[dict[str, Any]]:
    """One table row per trial of ``method`` under ``pred_type``, by configuration id (random:
    the id of :func:`sample_configs`; tpe: the order Optuna proposed them)."""
    ids = [t["trial"].split(":")[1] for t in trials]
    if any(i == "tpe" for i in ids):  # Tune lists the trials in the order they were created
        ids = list(range(len(trials)))
    rows = []
    for cid, t in zip(ids, trials):
        c = HyperConfig(int(cid), float(t["log10_n"]), float(t["log10_tau"]))
        row: dict[str, Any] = {"config_id": c.config_id, "method": method, "pred_type": pred_type, "log10_n": c.log10_n,
                               "log10_tau": c.log10_tau, "n_data": c.n_data, "prior_precision": c.prior_precision,
                               "seconds": float(t["seconds"]), "images": int(t["images"])}
        if t["status"] == "failed":
            row.update(nll=math.nan, ece=math.nan, accuracy=math.nan, brier=math.nan, count=0,
                       status="failed", reason=t["reason"])
        else:
            a = SearchAccumulator.from_json(json.loads(t["acc"]))
            done = int(t["chunks"]) >= chunks
            row.update(a.compute(), status="ok" if done else "stopped",
                       reason="" if done else f"stopped by ASHA after {t['chunks']} of {chunks} chunks "
                                              f"({t['images']} of {images} images)")
        rows.append(row)
    return sorted(rows, key=lambda r: r["config_id"])


def search(
    model_spec: Any,
    posterior_uris: Mapping[str, str],
    val_ds: Any,
    cfg: SearchConfig = SearchConfig(),
    *,
    store: RunStore = RunStore(),
    key: str = "",
    chunked: tuple[Sequence[Any], int, dict[str, Any]] | None = None,
) -> SearchResult:
    """Search of ``(N, τ)`` per method on ``val_ds`` (Ray Dataset with image/label/path/valid
    columns, a held-out labelled split of the in-domain data; or ``chunked``, what
    :func:`pipelines.evaluation.tune.chunk_refs` made of it, when the caller reads the split's
    chunks for other work too, e.g. the temperature fit): one Ray Tune experiment per
    predictive (:mod:`pipelines.evaluation.tune`: ``cfg.scheduler``, ``cfg.algorithm``; at most
    ``cfg.trials_at_once`` trials at once). ``posterior_uris``: ``method -> artifact URI`` (any
    stored ``(N, τ)``; each configuration is applied with ``with_hyper``). Returns a
    :class:`SearchResult`; with an output in ``store`` (the run's store) keeps the Tune experiments under ``eval/tune/``
    (a repeated call resumes them; ``key`` names the data, e.g. the split's fingerprint)
    and writes ``<output>/eval/<method>/search.parquet`` and ``search.json``."""
    from pipelines.evaluation import tune as search_tune
    from pipelines.evaluation.search_progress import total_line

    if not isinstance(cfg, SearchConfig):
        raise ValueError(f"cfg must be a SearchConfig, got {type(cfg).__name__}")
    ref = model_ref(model_spec)
    uris = dict(posterior_uris)
    if MAP in uris:
        raise ValueError(f"{MAP!r} has no hyperparameters; pass posterior methods only")
    t0 = time.perf_counter()
    chunks, images, skipped = chunked if chunked is not None else search_tune.chunk_refs(val_ds, cfg)
    if not chunks:
        raise StageError("search: the validation split has no valid image")
    root = None if store.output is None else store.tune_uri()
    runs = len(cfg.searched_pred_types)  # Tune experiments
    kw = dict(storage_root=root, key=key, store=store, progress_end=runs == 1)
    trials = [dict(t, pred_type=pt) for pt in cfg.searched_pred_types  # one search per predictive
              for t in _trials(ref, uris, chunks, images, dataclasses.replace(cfg, pred_type=pt), kw)]
    if runs > 1:  # one line for them all, not one per experiment
        total_line(len(trials), len(trials), sum(int(t["images"]) for t in trials), time.perf_counter() - t0, runs)
    maps = [t for t in trials if t["trial"].split(":")[0] == search_tune.MAP_TRIAL]
    map_json = json.loads(maps[0]["acc"]) if maps else search_tune.map_reference(ref, chunks, cfg, store)
    map_acc = SearchAccumulator.from_json(map_json)
    rows, chosen, notes = _choose_per_method(trials, list(uris), images, len(chunks), cfg)
    against = _against_map(ref, uris, chosen, chunks, cfg, store)
    info = _search_info(cfg, list(uris), rows, images, len(chunks), skipped, time.perf_counter() - t0)
    result = SearchResult(tuple(rows), chosen, notes, map_acc.compute() if map_acc.count else {}, info, against)
    if store.output is not None:
        _write_search(store, result)
    return result


def _trials(ref: Mapping[str, Any], uris: Mapping[str, str], chunks: Sequence[Any], images: int, cfg: SearchConfig,
            kw: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The trials of one predictive (``cfg.pred_type``), one experiment: random: the MAP reference
    and every method's grid; tpe: one TPE sampler per method."""
    from pipelines.evaluation import tune as search_tune

    return search_tune.run_experiment(ref, uris, chunks, images, cfg, **kw)


def _against_map(ref: Mapping[str, Any], uris: Mapping[str, str], chosen: Mapping[str, Any], chunks: Sequence[Any],
                 cfg: SearchConfig, store: RunStore) -> dict[str, dict[str, Any] | None]:
    """Each chosen configuration against MAP on the same validation images
    (:func:`pipelines.evaluation.against_map.judge`); the job logs the marks once
    (:meth:`SearchResult.marks`, ``pipelines.cli.model_run``)."""
    from pipelines.evaluation.against_map import judge

    got = judge(ref, uris, chosen, chunks, cfg, store) if any(c is not None for c in chosen.values()) else {}
    return {m: got.get(m) for m in uris}


def _choose_per_method(trials: Sequence[dict[str, Any]], methods: Sequence[str], images: int, n_chunks: int,
                       cfg: SearchConfig) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, str]]:
    """``(table rows, chosen configuration per method or None, why none was chosen)`` from the
    trials; a method's choice is over every predictive searched (its ``pred_type`` recorded)."""
    rows: list[dict[str, Any]] = []
    chosen: dict[str, dict[str, Any] | None] = {}
    notes: dict[str, str] = {}
    for m in methods:
        mrows = [r for pt in cfg.searched_pred_types for r in _rows(
            m, pt, [t for t in trials if t["trial"].split(":")[0] == m and t["pred_type"] == pt], images, n_chunks)]
        best, why = choose(mrows, cfg.objective, cfg.accuracy_floor)
        chosen[m] = None if best is None else {k: best[k] for k in (
            "config_id", "pred_type", "log10_n", "log10_tau", "n_data", "prior_precision", "nll", "ece", "accuracy",
            "brier")}
        if why:
            notes[m] = why
        rows.extend(mrows)
    return rows, chosen, notes


def _search_info(cfg: SearchConfig, methods: Sequence[str], rows: Sequence[dict[str, Any]], images: int,
                 n_chunks: int, skipped: dict[str, Any], wall: float) -> dict[str, Any]:
    """The search's settings, counts and timings (``SearchResult.info``, ``search.json``)."""
    evaluated = sum(r["images"] for r in rows)
    return {
        "objective": cfg.objective,
        "accuracy_floor": cfg.accuracy_floor,
        "num_configs": len(sample_configs(cfg)) if cfg.algorithm == "random" else cfg.num_configs,
        "log10_n": list(cfg.log10_n),
        "log10_tau": list(cfg.log10_tau),
        "method_ranges": {m: {"log10_n": list(rn), "log10_tau": list(rt)}
                          for m, rn, rt in cfg.method_ranges if m in methods and cfg.configs is None},
        "explicit_configs": cfg.configs is not None,
        "mc_samples": cfg.mc_samples,
        "seed": cfg.seed,
        "ece": f"ece_{cfg.ece_mode}_{cfg.ece_bins}",
        "scheduler": cfg.scheduler,
        "algorithm": cfg.algorithm,
        "reduction_factor": cfg.reduction_factor,
        "map_limit_log10_tau": cfg.map_limit_log10_tau,
        "pred_types": list(cfg.searched_pred_types),
        "examples": images,
        "chunks": n_chunks,
        "skipped": skipped["count"],
        "skipped_examples": skipped["examples"][:3],
        "images_evaluated": evaluated,
        "image_samples": evaluated * cfg.mc_samples,
        "image_samples_full": len(rows) * images * cfg.mc_samples,
        "wall_s": wall,
        "num_actors": cfg.num_actors,
        "concurrent_trials": cfg.trials_at_once,
        "failed": {m: sum(1 for r in rows if r["method"] == m and r["status"] == "failed") for m in methods},
        "stopped": {m: sum(1 for r in rows if r["method"] == m and r["status"] == "stopped") for m in methods},
    }


def _write_search(store: RunStore, result: SearchResult) -> None:
    """``eval/<method>/search.parquet`` and ``search.json`` of every method, under the store's output."""
    for m, chosen in result.chosen.items():
        d = store.eval_uri(m)
        store.write_bytes_atomic(storage.join(d, "search.parquet"), _parquet_bytes(result.table(m)))
        store.write_json_atomic(storage.join(d, "search.json"),
                                {"method": m, "chosen": chosen, "note": result.notes.get(m, ""),
                                 "map_validation": result.map, "against_map": result.against_map.get(m),
                                 "not_better_than_map": result.marks().get(m, ""), **result.info})
