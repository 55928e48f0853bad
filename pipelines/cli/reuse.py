"""Reusing an earlier run's curvature, posteriors and search (``--reuse``, ``schedule.reuse``;
docs/scheduled-audits.md).

A weekly audit of the same weights need not redo the curvature passes, the posteriors and the
``(N, τ)`` search: only the evaluation depends on the week's data. Each run records, next to its
stage markers, ``<output>/reuse.json``: its reuse keys (the curvature, posterior and search stage
fingerprint trees of :mod:`pipelines.cli.model_run`, with the weights *path* replaced by the
sha256 of the weights' bytes and the input normalisation added, so a file overwritten with new
weights under the same name never matches) and where those stages' artifacts live (``origin``).

A run takes the three stages from an earlier run when its keys equal that run's: the stage
summaries are read from the origin's markers, the posteriors and the search table are read where
they are (nothing is copied), and the new ``run.json`` lists the origin per stage under
``reused``. ``schedule.reuse`` is a run's URI (every key must match, else one
:class:`~pipelines.errors.PreflightError` line naming the first setting that differs, before any
cluster work), ``auto`` (the newest matching run among the sub-folders of ``schedule.history``;
none matching: the stages run as usual) or ``none``.

The keys are read without running anything: :func:`stage_trees` walks the model run's stages with a
stand-in for :class:`~pipelines.cli.stages.Stages` that records each stage's fingerprint tree.
"""
from __future__ import annotations

import copy
import datetime as _dt
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from pipelines.cli.stages import fingerprint, log
from pipelines.errors import PreflightError
from pipelines.storage import layout
from pipelines.storage import uris as storage

__all__ = ["REUSED_STAGES", "ReusePlan", "record_uri", "weights_identity", "stage_trees", "plan_reuse",
           "first_difference", "read_record", "run_dir_for", "history_source"]

#: The stages a run may take from an earlier one; the evaluation always runs on the new data.
REUSED_STAGES = ("curvature", "posterior", "search")
#: What the top-level names of a fingerprint tree stand for, in a mismatch line.
_MEANING = {"train": "the curvature data (train split listing)", "val": "the search split (listing)",
            "input_norm": "the input normalisation", "version": "the fingerprint version"}


def record_uri(output: str) -> str:
    """``<output>/reuse.json``: the run's reuse keys and where its reusable stages live."""
    return storage.join(output, "reuse.json")


def weights_identity(weights: str | None, store: Any = None) -> str | None:
    """``sha256:<hex>`` of a weights file's bytes (streamed); a torchvision enum name, ``random`` or
    None as they are."""
    from pipelines.ingest.models import RANDOM_WEIGHTS, is_enum_name

    if weights is None or weights == RANDOM_WEIGHTS or is_enum_name(weights):
        return weights
    fs, path = storage.get_fs(weights, store)
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()


class _Probe:
    """Stands in for :class:`~pipelines.cli.stages.Stages` while the trees are read: records
    each stage's fingerprint tree and runs nothing (every stage returns "no result")."""

    def __init__(self) -> None:
        self.trees: dict[str, Any] = {}
        self.results: dict[str, Any] = {}

    def run(self, stage: str, fp_obj: Any, fn: Callable[[], Any]) -> None:
        self.trees[stage] = json.loads(json.dumps(fp_obj, sort_keys=True, default=str))
        return None


def stage_trees(model_run: Any) -> dict[str, Any]:
    """The fingerprint tree of every stage of ``model_run`` (a :class:`~pipelines.cli.model_run.ModelRun`),
    read by walking its stages on a copy whose stage runner only records."""
    probe = copy.copy(model_run)
    probe.stages = _Probe()
    probe.run_all()
    return probe.stages.trees


def _keyed_trees(trees: dict[str, Any], identity: str | None, norm: Any) -> dict[str, Any]:
    out = {}
    for stage in REUSED_STAGES:
        t = copy.deepcopy(trees[stage])
        t["model"] = {**t.get("model", {}), "weights": identity}
        t["input_norm"] = norm
        out[stage] = t
    return out


def first_difference(there: Any, here: Any, path: str = "") -> str | None:
    """The first setting (dotted path) whose value differs, as ``path: X there, Y here``."""
    if isinstance(there, dict) and isinstance(here, dict):
        for k in sorted(set(there) | set(here)):
            d = first_difference(there.get(k), here.get(k), f"{path}.{k}" if path else str(k))
            if d:
                return d
        return None
    if there == here:
        return None
    name = _MEANING.get(path, path)

    def short(v: Any) -> str:
        s = json.dumps(v, default=str)
        return s if len(s) <= 40 else s[:37] + "..."
    return f"{name}: {short(there)} there, {short(here)} here"


@dataclass
class ReusePlan:
    """What :class:`~pipelines.cli.model_run.ModelRun` runs with: its stage runner, the posterior
    URIs (the origin's when reused), the origin per reused stage, and where the search table is."""

    stages: Any
    uris: dict[str, str]
    reused: dict[str, str] = field(default_factory=dict)
    search_output: str = ""


class _ReusingStages:
    """Wraps :class:`~pipelines.cli.stages.Stages`: the reused stages are read from their origin's
    markers (this run writes no marker for them); after the search (run or reused) the run's
    ``reuse.json`` is written, so later runs can find it."""

    def __init__(self, inner: Any, output: str, store: Any, record: dict[str, Any], origin: str | None):
        self.inner, self.output, self.store, self.record, self.origin = inner, output, store, record, origin

    @property
    def results(self) -> dict[str, Any]:
        return self.inner.results

    def run(self, stage: str, fp_obj: Any, fn: Callable[[], Any]) -> Any:
        if self.origin is not None and stage in REUSED_STAGES:
            marker = storage.read_json(layout.stage_marker_uri(self.origin, stage), self.store)
            there = float(marker["summary"].get("seconds", 0.0) or 0.0)
            summary = {**marker["summary"], "seconds": 0.0, "seconds_in_origin": there, "reused_from": self.origin}
            log(f"stage {stage}: reused from {self.origin} (computed there in {there:.1f} s; read in place)")
            self.inner.results[stage] = summary
            res = summary
        else:
            res = self.inner.run(stage, fp_obj, fn)
        if stage == "search" and res is not None:
            doc = {**self.record, "written_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
            storage.write_json_atomic(record_uri(self.output), doc, self.store)
        return res


def read_record(run_dir: str, store: Any) -> dict[str, Any] | None:
    uri = record_uri(run_dir)
    try:
        return storage.read_json(uri, store) if storage.exists(uri, store) else None
    except (OSError, ValueError):
        return None


def _origin_complete(origin: str, store: Any) -> bool:
    return all(storage.exists(layout.stage_marker_uri(origin, s), store) for s in REUSED_STAGES)


def run_dir_for(uri: str, model: str, audit: bool) -> str:
    """A run's folder for ``model``: ``<uri>/models/<model>`` when ``uri`` is an audit's root."""
    return layout.model_dir(uri, model) if audit else uri


def _explicit_source(uri: str, model: str, audit: bool, trees: dict[str, Any], keyed: dict[str, Any],
                     store: Any) -> str:
    """The origin of ``--reuse uri`` for ``model`` when every key matches; else one line."""
    run_dir = run_dir_for(uri, model, audit)
    record = read_record(run_dir, store)
    if record is None:  # a run made before reuse.json: its markers' fingerprints must match exactly
        for stage in REUSED_STAGES:
            marker_uri = layout.stage_marker_uri(run_dir, stage)
            if not storage.exists(marker_uri, store):
                raise PreflightError(f"--reuse {uri}: no finished {stage} stage there ({marker_uri})")
            if storage.read_json(marker_uri, store).get("fingerprint") != fingerprint(trees[stage]):
                raise PreflightError(f"--reuse {uri}: its {stage} stage was made with other weights, data or "
                                     f"settings than this run's ({model})")
        return run_dir
    for stage in REUSED_STAGES:
        if record.get("keys", {}).get(stage) != fingerprint(keyed[stage]):
            diff = first_difference((record.get("trees") or {}).get(stage), keyed[stage]) or "its fingerprint"
            raise PreflightError(f"--reuse {uri}: its {stage} stage does not match this run ({diff}); use the "
                                 f"same weights, data and settings, or --reuse auto / none")
    origin = record["origin"]["search"]
    if not _origin_complete(origin, store):
        raise PreflightError(f"--reuse {uri}: the stages it took from {origin} are no longer all there")
    return origin


def history_source(root: str, output: str, model: str, audit: bool, keyed: dict[str, Any],
                    store: Any) -> str | None:
    """The origin of the newest run under ``root`` whose keys all equal this run's."""
    want = {s: fingerprint(keyed[s]) for s in REUSED_STAGES}
    best: tuple[str, str] | None = None
    for name in storage.listdir(root, store):
        cand = storage.join(root, name)
        if cand.rstrip("/") == output.rstrip("/") or name.startswith("."):
            continue
        record = read_record(run_dir_for(cand, model, audit), store)
        if record is None or record.get("keys") != want:
            continue
        origin = record["origin"]["search"]
        when = str(record.get("written_at", ""))
        if (best is None or when > best[0]) and _origin_complete(origin, store):
            best = (when, origin)
    return None if best is None else best[1]


def _computes_itself(cfg: Any, output: str, store: Any) -> bool:
    """The output holds its own curvature already (a re-submission), or a reused stage is forced."""
    return bool(set(cfg.force) & set(REUSED_STAGES)) or storage.exists(
        layout.stage_marker_uri(output, "curvature"), store)


def plan_reuse(model_run: Any, stages: Any) -> ReusePlan:
    """Decide, before any cluster work, which run (if any) this model run takes its curvature,
    posteriors and search from; raises :class:`PreflightError` for an explicit ``--reuse`` that
    does not match."""
    cfg, output, store = model_run.cfg, model_run.output, model_run.store.options
    spec, mode = model_run.spec, cfg.schedule.reuse
    trees = stage_trees(model_run)
    identity = weights_identity(spec.weights, store)
    tc = model_run.splits.train_config
    norm = [None if v is None else [float(x) for x in v] for v in (getattr(tc, "mean", None), getattr(tc, "std", None))]
    keyed = _keyed_trees(trees, identity, norm)
    audit = bool(cfg.models)
    origin = None
    own = _computes_itself(cfg, output, store)
    if own and mode not in ("auto", "none"):
        log(f"reuse: {output} holds its own curvature stage already; --reuse {mode} is not used for it")
    if mode != "none" and not own:
        if mode == "auto":
            if cfg.schedule.history:
                origin = history_source(cfg.schedule.history, output, spec.name, audit, keyed, store)
                log(f"reuse: taking curvature, posteriors and search from {origin} (same weights, data and settings)"
                    if origin else f"reuse: no run under {cfg.schedule.history} has this run's weights, curvature "
                                   "data and settings; computing them")
        else:
            origin = _explicit_source(mode, spec.name, audit, trees, keyed, store)
    record = {"model": {"name": spec.name, "weights": spec.weights, "weights_identity": identity},
              "keys": {s: fingerprint(keyed[s]) for s in REUSED_STAGES}, "trees": keyed,
              "origin": {s: origin or output for s in REUSED_STAGES}}
    base = origin or output
    return ReusePlan(stages=_ReusingStages(stages, output, store, record, origin),
                     uris={m: layout.posterior_uri(base, m) for m in model_run.post_methods},
                     reused={s: origin for s in REUSED_STAGES} if origin else {}, search_output=base)
