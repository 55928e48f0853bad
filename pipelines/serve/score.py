"""``infoform score``: per-image predictive and uncertainty of a finished run's posterior on new
data, as a streaming Ray Data pipeline.

    read (the index, scanned on the driver) -> decode with the run's transforms (Ray Data tasks,
    :func:`pipelines.ingest.batches.build_dataset`) -> ``map_batches`` on an actor pool of
    :class:`ScoreActor` (each holds the model and the posterior at the run's chosen ``(N, τ)``,
    with the evaluation's predictor and keyed draws; fractional CPU / GPU shares as the
    evaluation's actors) -> one Parquet file per block of the index, written by the driver.

Blocks: the index is cut into fixed, contiguous blocks of ``block_size`` images
(:func:`pipelines.ingest.index.partition`, the same cut on every run); block ``i`` is
``<output>/part-<i>-of-<n>.parquet``, written atomically once all its rows are in. A re-run
computes only the blocks whose file is missing (a killed run resumes). ``<output>/_score.json``
records the settings; an output holding a scoring with other settings is refused.

Rows (one per image, in index order within a block): ``path`` (relative to the data root),
``label`` (-1 unlabeled), ``valid`` / ``error`` (undecodable images keep a row, with NaN
scores), the columns of :mod:`pipelines.serve.uncertainty` and ``flag`` (``entropy >
threshold``; the threshold is ``--flag-at`` or the entropy at 95% TPR on the run's own
in-distribution test split: :func:`flag_threshold`, computed once with this pipeline and stored
in the run under ``score/``).
"""
from __future__ import annotations

import dataclasses
import io
import time
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from pipelines.evaluation.actors import ModelActor
from pipelines.serve.run_loader import RunError, RunInfo, make_method_predictor
from pipelines.storage import uris as storage
from pipelines.storage.store import RunStore

__all__ = ["ScoreSettings", "ScoreActor", "block_uri", "score_index", "flag_threshold", "read_scores",
           "TPR", "MANIFEST"]

#: The share of the run's in-distribution test images left unflagged by the default threshold.
TPR = 0.95
#: The settings file of a scoring output.
MANIFEST = "_score.json"


@dataclass(frozen=True)
class ScoreSettings:
    """What to score with. ``method`` (``map``, a posterior, ``temperature``), ``pred_type``
    (``nn`` / ``glm``), ``n_samples`` / ``seed`` (the run's ``evaluate.mc_samples`` / ``seed``
    by default: the audit's draws), ``top_k``, ``block_size`` (images per output file),
    ``keep_probs`` (also the full probability vector), ``pool_size`` / ``map_batch_size``
    (actors, rows per call; None: the run's ``evaluate.num_actors`` / ``batch_size``)."""

    method: str
    pred_type: str
    n_samples: int
    seed: int
    top_k: int = 5
    block_size: int = 1024
    keep_probs: bool = False
    pool_size: int | None = None
    map_batch_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("n_samples", "top_k", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise RunError(f"{name} must be a positive integer, got {v!r}")

    def key(self) -> str:
        """A short name of the predictive: ``<method>-<pred_type>-k<K>-s<seed>``."""
        if self.method in ("map", "temperature"):
            return self.method
        return f"{self.method}-{self.pred_type}-k{self.n_samples}-s{self.seed}"


def block_uri(output: str, part: Any) -> str:
    return storage.join(output, f"{part.name}.parquet")


class ScoreActor(ModelActor):
    """The ``map_batches`` actor: loads the model and the one posterior once
    (:class:`pipelines.evaluation.actors.ModelActor`), builds the evaluation's predictor, and
    turns a batch of decoded images into the score columns."""

    def __init__(self, model: Mapping[str, Any], posterior_uris: Mapping[str, str], hyper, cfg: Any,
                 store: RunStore, settings: ScoreSettings, temperature: float | None):
        super().__init__(model, posterior_uris, hyper, cfg, store)
        self.settings = settings
        if self.init_error is None:
            try:
                self.predictor = make_method_predictor(
                    self.model, self.posteriors, settings.method, settings.pred_type, settings.n_samples,
                    settings.seed, int(cfg.sample_cache_mb * 2**20), temperature=temperature)
            except Exception as e:  # noqa: BLE001 - reported on the first batch, in one line
                self.init_error = f"{type(e).__name__}: {e}"

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        from pipelines.serve.uncertainty import predict_columns

        if self.init_error is not None:
            raise RuntimeError(f"ScoreActor could not start: {self.init_error}")
        x = torch.from_numpy(np.ascontiguousarray(batch["image"])).to(self.cfg.resolved_device,
                                                                      self.cfg.torch_dtype)
        cols = self._fixed_size_columns(x, predict_columns)
        bad = ~np.asarray(batch["valid"], dtype=bool)
        if bad.any():  # undecodable images: a row each, no scores
            for k, v in cols.items():
                if v.dtype.kind == "f":
                    v[bad] = np.nan
                else:
                    v[bad] = -1
        return {"path": batch["path"], "label": batch["label"], "valid": batch["valid"], "error": batch["error"],
                **cols}


    def _fixed_size_columns(self, x, predict_columns) -> dict[str, np.ndarray]:
        """The columns of ``x``, every forward on exactly ``batch_size`` rows (the last piece
        zero-padded, its padding dropped), as the evaluation's actors do
        (:mod:`pipelines.evaluation.chunks`): an image's numbers then do not depend on which
        rows Ray Data put beside it, so a resumed run writes the same bytes as an uninterrupted one."""
        import torch

        size = self.settings.map_batch_size or self.cfg.batch_size
        pieces = []
        for i in range(0, x.shape[0], size):
            part = x[i:i + size]
            real = part.shape[0]
            if real < size:
                part = torch.cat([part, part.new_zeros((size - real, *part.shape[1:]))])
            cols = predict_columns(self.model, self.predictor, part, self.settings.top_k, self.settings.keep_probs)
            pieces.append({k: v[:real] for k, v in cols.items()})
        return {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}


# --------------------------------------------------------------------------- output files
def _table(rows: dict[str, np.ndarray], threshold: float | None):
    import pyarrow as pa

    cols: dict[str, Any] = {}
    for k, v in rows.items():
        if v.ndim == 2:  # topk_*, probs: one list per row
            cols[k] = pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), v.shape[1])
        elif v.dtype == object:
            cols[k] = pa.array([str(s) for s in v], pa.string())
        else:
            cols[k] = pa.array(v)
    ent = rows["entropy"]
    cols["flag"] = (pa.nulls(len(ent), pa.bool_()) if threshold is None
                    else pa.array(np.where(np.isnan(ent), False, ent > threshold)))
    return pa.table(cols)


def _write_block(uri: str, rows: dict[str, np.ndarray], threshold: float | None, store: RunStore) -> None:
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(_table(rows, threshold), buf)
    store.write_bytes_atomic(uri, buf.getvalue())


def read_scores(output: str, store: RunStore = RunStore()):
    """Every block of a scoring output as one ``pyarrow.Table``, in index order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = sorted(n for n in store.listdir(output) if n.rsplit("/", 1)[-1].startswith("part-")
                   and n.endswith(".parquet"))
    tables = [pq.read_table(io.BytesIO(store.read_bytes(storage.join(output, n.rsplit("/", 1)[-1]))))
              for n in names]
    return pa.concat_tables(tables) if tables else None


class _Blocks:
    """The driver's buffer: rows arrive in any order; a block is written once it is complete."""

    def __init__(self, todo: list, output: str, threshold: float | None, store: RunStore):
        self.where = {p: (b.id, i) for b in todo for i, p in enumerate(b.paths)}
        self.size = {b.id: len(b) for b in todo}
        self.parts = {b.id: b for b in todo}
        self.buf: dict[int, list] = {b.id: [] for b in todo}
        self.got = dict.fromkeys(self.size, 0)
        self.output, self.threshold, self.store = output, threshold, store
        self.written = 0

    def add(self, batch: dict[str, np.ndarray]) -> None:
        loc = np.asarray([self.where[str(p)] for p in batch["path"]], dtype=np.int64).reshape(-1, 2)
        for b in np.unique(loc[:, 0]):
            sel = loc[:, 0] == b
            self.buf[int(b)].append((loc[sel, 1], {k: np.asarray(v)[sel] for k, v in batch.items()}))
            self.got[int(b)] += int(sel.sum())
            if self.got[int(b)] == self.size[int(b)]:
                self._flush(int(b))

    def _flush(self, b: int) -> None:
        pieces = self.buf.pop(b)
        pos = np.concatenate([p for p, _ in pieces])
        order = np.argsort(pos, kind="stable")
        rows = {k: np.concatenate([d[k] for _, d in pieces])[order] for k in pieces[0][1]}
        _write_block(block_uri(self.output, self.parts[b]), rows, self.threshold, self.store)
        self.written += 1

    def missing(self) -> list[int]:
        return sorted(self.buf)


# --------------------------------------------------------------------------- the pipeline
def _manifest(info: RunInfo, index: Any, s: ScoreSettings, n_blocks: int, threshold: float | None) -> dict:
    return {"format": "infoform.score", "version": 1, "run": info.uri, "model": info.model["name"],
            "method": s.method, "pred_type": s.pred_type, "n_samples": s.n_samples, "seed": s.seed,
            "hyper": list(info.hyper[s.method]) if s.method in info.hyper else None,
            "top_k": s.top_k, "keep_probs": s.keep_probs,
            "block_size": s.block_size, "num_blocks": n_blocks, "data_root": index.root,
            "data_fingerprint": index.fingerprint, "num_images": len(index), "flag_threshold": threshold}


def plan_blocks(info: RunInfo, index: Any, output: str, s: ScoreSettings, threshold: float | None,
                check_only: bool = False) -> tuple[list, list]:
    """``(all blocks, blocks still to compute)``; writes the manifest, or refuses (RunError) an
    output that holds a scoring with other settings. No cluster work. ``check_only``: only the
    refusal (a ``threshold`` of None, not known yet, is not compared)."""
    from pipelines.ingest.index import partition

    if len(set(index.paths)) != len(index.paths):
        raise RunError(f"{index.root}: the same path appears twice in the data; cannot key rows by path")
    blocks = partition(index, partition_size=s.block_size)
    man = _manifest(info, index, s, len(blocks), threshold)
    uri = storage.join(output, MANIFEST)
    if info.store.exists(uri):
        old = info.store.read_json(uri)
        diff = sorted(k for k in man if old.get(k) != man[k]
                      and not (check_only and threshold is None and k == "flag_threshold"))
        if diff:
            raise RunError(f"{output} already holds a scoring with other settings ({', '.join(diff)}); "
                           "use a new --output")
    elif not check_only:
        info.store.write_json_atomic(uri, man)
    todo = [b for b in blocks if not info.store.exists(block_uri(output, b))]
    return blocks, todo


def _resources(ev: Any, num_actors: int) -> tuple[float, float]:
    """``(CPUs, GPUs)`` per actor: ``evaluate.cpus_per_actor``; ``evaluate.gpus_per_actor``, or
    when null a share of the cluster's declared GPUs (0 without GPUs). Needs Ray initialised."""
    import ray

    from pipelines.distributed.cluster import gpu_share

    gpus = ev.gpus_per_actor
    if gpus is None:
        gpus = gpu_share(num_actors, float(ray.cluster_resources().get("GPU", 0.0)))
    return float(ev.cpus_per_actor), float(gpus)


def score_index(info: RunInfo, index: Any, data_cfg: Any, output: str, s: ScoreSettings,
                threshold: float | None, log=print) -> dict[str, Any]:
    """Score ``index`` (decoded with ``data_cfg``) into ``output`` (with the run's storage options); only the blocks without a
    file are computed. Returns ``{"blocks", "computed", "images", "seconds", "images_per_s"}``."""
    import ray.data

    from pipelines.errors import StageError, cause_line
    from pipelines.ingest.batches import build_dataset

    blocks, todo = plan_blocks(info, index, output, s, threshold)
    out = {"blocks": len(blocks), "computed": len(todo), "images": sum(len(b) for b in todo), "output": output}
    log(f"[score] {output}: {len(todo)} of {len(blocks)} block(s) to compute ({out['images']} images)")
    if not todo:
        return {**out, "seconds": 0.0, "images_per_s": None}
    t0 = time.perf_counter()
    n_act = s.pool_size or info.config.evaluate.num_actors
    cpus, gpus = _resources(info.config.evaluate, n_act)
    cfg = info.eval_config(num_actors=n_act, cpus_per_actor=cpus, gpus_per_actor=gpus, pred_type=s.pred_type,
                           mc_samples=s.n_samples, seed=s.seed)
    uris = {s.method: info.posterior_uris[s.method]} if s.method in info.posterior_uris else {}
    hyper = {s.method: info.hyper[s.method]} if s.method in info.hyper else None
    part = dataclasses.replace(index, paths=tuple(p for b in todo for p in b.paths),
                               labels=tuple(y for b in todo for y in b.labels),
                               locations=tuple(loc for b in todo for loc in b.locations))
    ds = build_dataset(part, data_cfg).map_batches(
        ScoreActor, fn_constructor_args=(info.model, uris, hyper, cfg, info.store, s, info.temperature),
        batch_size=s.map_batch_size or cfg.batch_size, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=n_act), num_cpus=cpus, num_gpus=gpus)
    sink = _Blocks(todo, output, threshold, info.store)
    done, last = 0, t0
    try:
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            sink.add(batch)
            done += len(batch["path"])
            if time.perf_counter() - last > cfg.log_every_s:
                last = time.perf_counter()
                log(f"[score] {done}/{out['images']} images, {done / (last - t0):.1f}/s, "
                    f"{sink.written}/{len(todo)} block(s) written")
    except Exception as e:  # noqa: BLE001 - the actors' or the decode tasks' cause, in one line
        raise StageError(f"score failed: {cause_line(e)}") from None
    if sink.missing():
        raise StageError(f"score: block(s) {sink.missing()[:5]} did not receive all their rows")
    secs = time.perf_counter() - t0
    log(f"[score] {len(todo)} block(s), {done} images in {secs:.1f} s ({done / secs:.1f} images/s)")
    return {**out, "seconds": secs, "images_per_s": done / secs}


def flag_threshold(info: RunInfo, s: ScoreSettings, log=print) -> dict[str, Any]:
    """The entropy at 95% TPR on the run's in-distribution test split for this predictive: the
    smallest entropy that at least 95% of those images do not exceed (``flag`` = entropy above
    it). Read from ``<run>/score/flag-<key>.json``, or computed once by scoring the test split
    into ``<run>/score/test-<key>/`` (resumable as any scoring) and stored there."""
    uri = storage.join(info.uri, "score", f"flag-{s.key()}.json")
    if info.store.exists(uri):
        return info.store.read_json(uri)
    index, dcfg = info.split("test")
    scores_uri = storage.join(info.uri, "score", f"test-{s.key()}")
    log(f"[score] flag threshold: scoring the run's test split ({len(index)} images) into {scores_uri}")
    score_index(info, index, dcfg, scores_uri, dataclasses.replace(s, keep_probs=False, top_k=1), None, log)
    ent = read_scores(scores_uri, info.store).column("entropy").to_numpy()
    ent = ent[~np.isnan(ent)]
    value = float(np.quantile(ent, TPR, method="inverted_cdf"))
    doc = {"entropy": value, "tpr": TPR, "num_images": int(ent.size), "scores": scores_uri, "predictive": s.key(),
           "source": "the run's in-distribution test split"}
    info.store.write_json_atomic(uri, doc)
    log(f"[score] flag threshold: entropy > {value:.4g} nats (95% TPR on {ent.size} test images), stored at {uri}")
    return doc
