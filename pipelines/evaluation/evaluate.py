"""Parallel Monte-Carlo evaluation of Laplace posteriors on Ray actors (DESIGN §1 "Predictive", §2).

Flow::

    results = evaluate(model_spec, {"inf": uri, ...}, in_ds, ood_ds, EvalConfig(), output=out)
    # results["map"], results["inf"], ... -> computed metrics (+ timings); writes
    # <out>/eval/<method>/metrics.json and accumulators.json

Parallelism: ``cfg.num_actors`` explicit Ray actors (:class:`EvalWorker`). Each one
loads the model (``pipelines.ingest.models.load_model`` from a name + weights URI) and every
posterior (``laplace_core.load_posterior``) **once**, then consumes one iterator of
``in_ds.streaming_split(num_actors, equal=False)`` (and of the OOD dataset's split),
and returns, per method (``"map"`` plus every posterior), a mergeable
:class:`EvalAccumulator` as JSON — sums, counts and fixed-edge histograms, never
per-image lists. The driver merges them in actor order and computes the metrics.

Why 1 actor and 2 actors give the same predictions (the sample ``θ_t`` depends only
on ``(seed, t)``, :func:`laplace_core.predictive.sample_seed`):

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

ECE: both variants are accumulated (``ece_equal_width_<bins>`` and
``ece_equal_mass_<bins>``); ``cfg.ece_mode`` names the headline ``"ece"`` key and
``"ece_variant"`` says which one it is. OOD: the OOD set only updates the OOD part
(normalised-entropy AUROC/AUPR/FPR95 and the exact mean OOD entropy
``ood_entropy_mean``).
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import torch
from torch import nn

from laplace_core.metrics.base import DEFAULT_ECE_BINS, ECE_STRATEGIES, ENTROPY_BINS
from laplace_core.metrics.calibration import Entropy
from laplace_core.metrics.suite import MetricSuite

from pipelines.storage import uris as storage
from pipelines.errors import StageError, cause_line
from pipelines.distributed.malloc import tune_malloc

__all__ = [
    "PRED_TYPES",
    "MAP",
    "EvalConfig",
    "EvalAccumulator",
    "Chunk",
    "iter_chunks",
    "model_ref",
    "load_eval_model",
    "load_posteriors",
    "evaluate_shard",
    "EvalWorker",
    "evaluate",
    "eval_uri",
]

#: Predictive types: "nn" = MC over weight samples through the network. "glm" (linearised,
#: Immer et al.) is planned; asking for it raises a ValueError.
PRED_TYPES: dict[str, str] = {
    "nn": "Monte-Carlo over weight samples, average of softmax",
    "glm": "linearised (GLM) predictive, MC-GLM: the same weight samples pushed through the Jacobian (JVP)",
}
_PLANNED_PRED_TYPES: tuple[str, ...] = ()
#: Name of the MAP baseline in every result dict.
MAP = "map"
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _pos_int(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


def make_predictor(model: nn.Module, post: Any, pred_type: str, mc_samples: int, seed: int, cache_bytes: int):
    """``MCPredictor`` (``"nn"``: weight sampling) or ``GLMPredictor`` (``"glm"``: MC-GLM,
    Banerjee et al. Alg. 4, one JVP per sample); both draw sample ``t`` from ``(seed, t)``."""
    check_pred_type(pred_type)
    if pred_type == "nn":
        from laplace_core.predictive import MCPredictor

        return MCPredictor(model, post, mc_samples, seed, cache_bytes=cache_bytes)
    if pred_type == "glm":
        from laplace_core.glm import GLMPredictor

        return GLMPredictor(model, post, mc_samples, seed, link="mc", variance="mc", cache_bytes=cache_bytes)
    raise ValueError(f"unknown pred_type {pred_type!r}; valid: {', '.join(PRED_TYPES)}")  # pragma: no cover


def check_pred_type(pred_type: str) -> None:
    """``ValueError`` for an unknown or not-yet-implemented predictive type."""
    if pred_type in _PLANNED_PRED_TYPES:
        raise ValueError(
            f"pred_type {pred_type!r} (linearised predictive) is not implemented yet; valid now: {', '.join(PRED_TYPES)}"
        )
    if pred_type not in PRED_TYPES:
        raise ValueError(f"unknown pred_type {pred_type!r}; valid: {', '.join(PRED_TYPES)}")


@dataclass(frozen=True)
class RuntimeFields:
    """Actor/runtime settings shared by :class:`EvalConfig` and ``pipelines.evaluation.search.SearchConfig``.

    num_actors: Ray actors. batch_size: rows per forward pass (fixed; the last batch of
    a shard is zero-padded). chunk_size: examples per group of weight samples (rounded
    up to whole batches). cpus_per_actor / gpus_per_actor: Ray resources per actor
    (0.5 CPU leaves Ray Data a CPU to decode with on a 2-core machine; raise it on real
    clusters). torch_threads: intra-op threads per actor (None: ``max(1, round(cpus))``).
    device: "cpu" / "cuda" (None: "cuda" when gpus_per_actor > 0). dtype: model and
    input dtype, "float32" or "float64" (posterior samples are cast to it).
    max_failures: times the round of actors is started again when an actor dies (its
    process exits, is killed for memory, or its node goes away); the results do not
    depend on which attempt they come from (every sample is a function of ``(seed, t)``).
    An exception raised by the actors' code is not retried. fault_marker: test-only; the
    first actor to finish a batch while this file (a URI) does not exist writes it and
    exits its process, so that the next attempt runs clean. log_every_s: actor 0 logs the
    progress (images, images/s, ETA when ``expected_rows`` gives the split's size:
    ``(in-domain or validation rows, OOD rows)``) this often. placement_timeout_s: actors
    not placed by then (the cluster lacks what they ask for) end the stage in one line.
    """

    num_actors: int = 2
    batch_size: int = 64
    chunk_size: int = 1024
    cpus_per_actor: float = 0.5
    gpus_per_actor: float = 0.0
    torch_threads: int | None = None
    device: str | None = None
    dtype: str = "float32"
    max_failures: int = 2
    fault_marker: str | None = None
    log_every_s: float = 30.0
    expected_rows: tuple[int | None, int | None] = (None, None)
    placement_timeout_s: float = 900.0

    def _check_runtime(self) -> None:
        for n in ("num_actors", "batch_size", "chunk_size"):
            _pos_int(n, getattr(self, n))
        if isinstance(self.max_failures, bool) or not isinstance(self.max_failures, int) or self.max_failures < 0:
            raise ValueError(f"max_failures must be an int >= 0, got {self.max_failures!r}")
        if not self.log_every_s > 0:
            raise ValueError(f"log_every_s must be > 0, got {self.log_every_s!r}")
        if not self.placement_timeout_s > 0:
            raise ValueError(f"placement_timeout_s must be > 0, got {self.placement_timeout_s!r}")
        if not (self.cpus_per_actor >= 0 and math.isfinite(self.cpus_per_actor)):
            raise ValueError(f"cpus_per_actor must be >= 0, got {self.cpus_per_actor!r}")
        if not (self.gpus_per_actor >= 0 and math.isfinite(self.gpus_per_actor)):
            raise ValueError(f"gpus_per_actor must be >= 0, got {self.gpus_per_actor!r}")
        if self.torch_threads is not None:
            _pos_int("torch_threads", self.torch_threads)
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; valid: {', '.join(_DTYPES)}")
        if self.device is not None and torch.device(self.device).type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        return "cuda" if self.gpus_per_actor > 0 else "cpu"

    @property
    def threads(self) -> int:
        return self.torch_threads if self.torch_threads is not None else max(1, round(self.cpus_per_actor))

    @property
    def batches_per_chunk(self) -> int:
        return max(1, math.ceil(self.chunk_size / self.batch_size))


@dataclass(frozen=True)
class EvalConfig(RuntimeFields):
    """What to evaluate. mc_samples: ``K_mc`` weight samples (default 30). seed: run seed
    (sample ``t`` uses ``sample_seed(seed, t)``). ece_bins / ece_mode ("equal_width" or
    "equal_mass"): headline ECE variant (both are always computed). pred_type: "nn".
    sample_cache_mb: keep a method's ``K`` deltas in memory when they fit (MiB).
    entropy_bins: histogram bins for entropies; ood_exact_limit: keep raw OOD scores
    (exact AUROC) while in + out examples <= this (see ``OODDetection``).
    Runtime fields: see ``RuntimeFields``.
    """

    mc_samples: int = 30
    seed: int = 0
    ece_bins: int = DEFAULT_ECE_BINS
    ece_mode: str = "equal_width"
    pred_type: str = "nn"
    sample_cache_mb: float = 256.0
    entropy_bins: int = ENTROPY_BINS
    ood_exact_limit: int = 0

    def __post_init__(self) -> None:
        self._check_runtime()
        _pos_int("mc_samples", self.mc_samples)
        _pos_int("ece_bins", self.ece_bins)
        _pos_int("entropy_bins", self.entropy_bins)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.ece_mode not in ECE_STRATEGIES:
            raise ValueError(f"unknown ece_mode {self.ece_mode!r}; valid: {', '.join(ECE_STRATEGIES)}")
        check_pred_type(self.pred_type)
        if not (self.sample_cache_mb >= 0):
            raise ValueError(f"sample_cache_mb must be >= 0, got {self.sample_cache_mb!r}")
        if isinstance(self.ood_exact_limit, bool) or not isinstance(self.ood_exact_limit, int) or self.ood_exact_limit < 0:
            raise ValueError(f"ood_exact_limit must be an int >= 0, got {self.ood_exact_limit!r}")

    @classmethod
    def from_spec(cls, spec: Any, **overrides: Any) -> "EvalConfig":
        """From ``pipelines.config.schema.EvalSpec`` (mc_samples, num_actors, batch_size, ece_bins,
        ece_mode, pred_type, seed, max_failures) plus keyword overrides for the runtime fields."""
        names = ("mc_samples", "num_actors", "batch_size", "ece_bins", "ece_mode", "pred_type", "seed",
                 "max_failures")
        kw = {n: getattr(spec, n) for n in names if hasattr(spec, n)}
        kw.update(overrides)
        return cls(**kw)


# --------------------------------------------------------------------------- accumulator
@dataclass(frozen=True, eq=False)
class EvalAccumulator:
    """One method's mergeable evaluation state: a :class:`MetricSuite` (in-distribution
    metrics + OOD detection) and an :class:`Entropy` over the OOD set (exact mean OOD
    entropy, which the suite's OOD histograms only approximate)."""

    suite: MetricSuite
    ood_entropy: Entropy

    @classmethod
    def create(cls, cfg: EvalConfig) -> "EvalAccumulator":
        return cls(
            MetricSuite.create(ece_bins=cfg.ece_bins, entropy_bins=cfg.entropy_bins, ood_exact_limit=cfg.ood_exact_limit),
            Entropy(cfg.entropy_bins),
        )

    def update(self, probs: torch.Tensor, labels: torch.Tensor) -> "EvalAccumulator":
        return dataclasses.replace(self, suite=self.suite.update(probs, labels))

    def update_ood(self, probs: torch.Tensor) -> "EvalAccumulator":
        return EvalAccumulator(self.suite.update_ood(probs), self.ood_entropy.update(probs))

    def merge(self, other: "EvalAccumulator") -> "EvalAccumulator":
        return EvalAccumulator(self.suite.merge(other.suite), self.ood_entropy.merge(other.ood_entropy))

    def compute(self, ece_mode: str = "equal_width") -> dict[str, Any]:
        out = self.suite.compute()
        key = f"ece_{ece_mode}_{self.suite.ece.n_bins}"
        out["ece"] = out[key]
        out["ece_variant"] = key
        if self.ood_entropy.count:
            e = self.ood_entropy.compute()
            out["ood_entropy_mean"] = e["entropy_mean"]
            out["ood_entropy_hist"] = e["entropy_hist"]
        return out

    def to_json(self) -> dict[str, Any]:
        return {"format": "infoform.eval_accumulator", "version": 1,
                "suite": self.suite.to_json(), "ood_entropy": self.ood_entropy.to_json()}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "EvalAccumulator":
        if d.get("format") != "infoform.eval_accumulator":
            raise ValueError("not an EvalAccumulator JSON (format tag missing)")
        return cls(MetricSuite.from_json(d["suite"]), Entropy.from_json(d["ood_entropy"]))


# --------------------------------------------------------------------------- fixed-size batches
class Chunk(NamedTuple):
    """``xs``: list of ``[batch_size, ...]`` inputs (the last one may be zero-padded);
    ``ys``: list of int64 labels ``[b_j]`` of the real rows; ``sizes``: ``b_j`` (real rows
    in batch ``j``, a prefix of the batch)."""

    xs: list[torch.Tensor]
    ys: list[torch.Tensor]
    sizes: list[int]

    @property
    def count(self) -> int:
        return sum(self.sizes)


def _as_xy(b: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(b, Mapping):
        x = b["image"] if "image" in b else b["x"]
        y = b["label"] if "label" in b else b.get("y")
    else:
        x, y = b[0], b[1]
    x = torch.as_tensor(np.asarray(x)) if not isinstance(x, torch.Tensor) else x
    if y is None:
        y = torch.full((x.shape[0],), -1, dtype=torch.int64)
    y = torch.as_tensor(np.asarray(y)) if not isinstance(y, torch.Tensor) else y
    return x, y.to(torch.int64)


def iter_chunks(
    batches: Iterable[Any],
    batch_size: int,
    batches_per_chunk: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Iterator[Chunk]:
    """Re-batch ``(x, y)`` pairs (or dicts with image/label) into fixed-size batches and
    group them into chunks of ``batches_per_chunk`` batches. Inputs are converted to
    ``dtype`` / ``device``. Every yielded batch has exactly ``batch_size`` rows."""
    _pos_int("batch_size", batch_size)
    _pos_int("batches_per_chunk", batches_per_chunk)
    buf_x: list[torch.Tensor] = []
    buf_y: list[torch.Tensor] = []
    buffered = 0
    xs: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    sizes: list[int] = []

    def emit(n_real: int) -> None:
        nonlocal buf_x, buf_y, buffered
        x = torch.cat(buf_x) if len(buf_x) > 1 else buf_x[0]
        y = torch.cat(buf_y) if len(buf_y) > 1 else buf_y[0]
        take_x, rest_x = x[:n_real], x[n_real:]
        take_y, rest_y = y[:n_real], y[n_real:]
        if n_real < batch_size:
            pad = take_x.new_zeros((batch_size - n_real, *take_x.shape[1:]))
            take_x = torch.cat([take_x, pad])
        xs.append(take_x.to(device=device, dtype=dtype).contiguous())
        ys.append(take_y.clone())
        sizes.append(n_real)
        buf_x, buf_y = ([rest_x], [rest_y]) if rest_x.shape[0] else ([], [])
        buffered = int(rest_x.shape[0])

    for b in batches:
        x, y = _as_xy(b)
        if x.shape[0] == 0:
            continue
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"batch has {x.shape[0]} inputs but {y.shape[0]} labels")
        buf_x.append(x)
        buf_y.append(y)
        buffered += int(x.shape[0])
        while buffered >= batch_size:
            emit(batch_size)
            if len(xs) == batches_per_chunk:
                yield Chunk(xs, ys, sizes)
                xs, ys, sizes = [], [], []
    if buffered:
        emit(buffered)
    if xs:
        yield Chunk(xs, ys, sizes)


# --------------------------------------------------------------------------- loading
def model_ref(spec: Any) -> dict[str, Any]:
    """``{"name", "weights", "num_classes"}`` from a ``pipelines.config.schema.ModelSpec``-like object
    or a mapping (what actors receive; they call ``load_model`` with it)."""
    if isinstance(spec, Mapping):
        get = spec.get
    else:
        get = lambda k, d=None: getattr(spec, k, d)  # noqa: E731
    name = get("name")
    if not name or not isinstance(name, str):
        raise ValueError(f"model spec needs a model name, got {spec!r}")
    return {"name": name, "weights": get("weights"), "num_classes": get("num_classes")}


def load_eval_model(ref: Mapping[str, Any], *, dtype: torch.dtype, device: str,
                    endpoint_url: str | None = None) -> nn.Module:
    """``load_model(name, weights, num_classes)`` in eval mode, cast to ``dtype``, on ``device``."""
    from pipelines.ingest.models import load_model

    model = load_model(ref["name"], ref.get("weights"), ref.get("num_classes"), endpoint_url=endpoint_url)
    return model.to(device=device, dtype=dtype).eval()


def load_posteriors(uris: Mapping[str, str], hyper: Mapping[str, Sequence[float]] | None = None,
                    endpoint_url: storage.Store = None) -> dict[str, Any]:
    """``method -> Posterior`` from artifact URIs; ``hyper[method] = (N, τ)`` re-targets a
    posterior with ``laplace_core.posterior.with_hyper`` (no eigendecomposition redone)."""
    from laplace_core.structures.base import load_posterior
    from laplace_core.posterior import with_hyper

    out = {}
    for method, uri in uris.items():
        if method == MAP:
            raise ValueError(f"{MAP!r} is the baseline and always evaluated; do not pass a posterior under that name")
        post = load_posterior(uri, storage.fsspec_options(uri, endpoint_url))
        if hyper and method in hyper and hyper[method] is not None:
            n_data, tau = hyper[method]
            post = with_hyper(post, n_data, tau)
        out[method] = post
    if hyper:
        unknown = sorted(set(hyper) - set(uris))
        if unknown:
            raise ValueError(f"hyper given for methods without a posterior: {unknown}; posteriors: {sorted(uris)}")
    return out


# --------------------------------------------------------------------------- one shard
def finite_or_reason(p: torch.Tensor) -> str:
    if bool(torch.isfinite(p).all()):
        return ""
    return f"non-finite predictions ({int((~torch.isfinite(p)).sum())} entries NaN/inf)"


def predict_chunk(model: nn.Module, predictor: Any, chunk: Chunk) -> list[torch.Tensor]:
    """Probabilities of the real rows of each batch: MAP when ``predictor`` is None."""
    from laplace_core.predictive import map_predict

    if predictor is None:
        probs = [map_predict(model, x) for x in chunk.xs]
    else:
        probs = predictor.predict_batches(chunk.xs)
    return [p[:n].detach().cpu() for p, n in zip(probs, chunk.sizes)]


def evaluate_shard(
    model: nn.Module,
    posteriors: Mapping[str, Any],
    in_batches: Iterable[Any],
    ood_batches: Iterable[Any] | None,
    cfg: EvalConfig,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, EvalAccumulator], dict[str, Any]]:
    """Evaluate ``"map"`` and every posterior on one shard, in this process.

    ``in_batches`` / ``ood_batches``: iterables of ``(x, y)`` or dicts with image/label
    (invalid rows already removed). Returns ``(accumulators, info)``; ``info`` holds
    ``seconds`` per method (predictions + metric updates), ``failed`` (method -> reason,
    e.g. non-finite predictions; that method's accumulator is dropped), ``examples``
    and ``ood_examples``. ``progress(split, n)``: called after each chunk, every method
    done, with ``split`` 0 (in-domain) or 1 (OOD) and the chunk's example count.
    """
    cache_bytes = int(cfg.sample_cache_mb * 2**20)
    predictors: dict[str, Any] = {MAP: None}
    for m, post in posteriors.items():
        predictors[m] = make_predictor(model, post, cfg.pred_type, cfg.mc_samples, cfg.seed, cache_bytes)
    acc = {m: EvalAccumulator.create(cfg) for m in predictors}
    seconds = {m: 0.0 for m in predictors}
    failed: dict[str, str] = {}
    counts = {"examples": 0, "ood_examples": 0}
    dt, dev = cfg.torch_dtype, cfg.resolved_device

    def run(batches: Iterable[Any], ood: bool) -> None:
        for chunk in iter_chunks(batches, cfg.batch_size, cfg.batches_per_chunk, dtype=dt, device=dev):
            counts["ood_examples" if ood else "examples"] += chunk.count
            for m, pred in predictors.items():
                if m in failed:
                    continue
                t0 = time.perf_counter()
                probs = predict_chunk(model, pred, chunk)
                p_all = torch.cat(probs)
                reason = finite_or_reason(p_all)
                if reason:
                    failed[m] = reason
                    continue
                a = acc[m]
                if ood:
                    a = a.update_ood(p_all)
                else:
                    a = a.update(p_all, torch.cat(chunk.ys))
                acc[m] = a
                seconds[m] += time.perf_counter() - t0
            if progress is not None:
                progress(int(ood), chunk.count)

    with torch.no_grad():
        run(in_batches, ood=False)
        if ood_batches is not None:
            run(ood_batches, ood=True)
    for m in failed:
        acc.pop(m, None)
    return acc, {"seconds": seconds, "failed": failed, **counts}


# --------------------------------------------------------------------------- Ray actor
def valid_batches(shard: Any, batch_size: int):
    """(iterator of (x, y) without invalid rows, callable returning the SkipReport so far)."""
    from pipelines.ingest.batches import SkipReport, iter_valid_batches

    state = {"skipped": SkipReport()}

    def gen():
        for b in iter_valid_batches(shard, batch_size=batch_size):
            state["skipped"] = state["skipped"].merge(b.skipped)
            if b.y.shape[0]:
                yield b.x, b.y

    return gen(), lambda: state["skipped"]


class ActorProgress:
    """Progress log of a round of actors, written by actor 0 only: every ``cfg.log_every_s``
    seconds one line with the images done (estimated for all actors as actor 0's count
    times ``num_actors``: the shards are split dynamically), images/s and the ETA when
    ``cfg.expected_rows`` (or ``totals``) gives the split's size. ``__call__(split, n)``
    counts ``n`` units (images, or for the search examples x configurations) of ``split``
    (0: in-domain or validation, 1: OOD)."""

    def __init__(self, what: str, index: int, cfg: RuntimeFields, splits: Sequence[str] = ("test", "ood"),
                 totals: Sequence[int | None] | None = None, unit: str = "images"):
        self.what, self.on, self.k = what, index == 0, cfg.num_actors
        self.every, self.names, self.unit = cfg.log_every_s, splits, unit
        self.totals = tuple(cfg.expected_rows if totals is None else totals)
        self.done = [0, 0]
        self.t0 = [None, None]
        self.last = time.perf_counter()

    def __call__(self, split: int, n: int) -> None:
        now = time.perf_counter()
        if self.t0[split] is None:
            self.t0[split] = now
        self.done[split] += n
        if not self.on or now - self.last < self.every:
            return
        self.last = now
        est = self.done[split] * self.k
        rate = est / max(now - self.t0[split], 1e-9)
        total = self.totals[split] if split < len(self.totals) else None
        eta = "?" if not total else f"{max(total - est, 0) / max(rate, 1e-9):.0f}s"
        print(f"[{self.what}] {self.names[split]}: ~{est}/{total or '?'} {self.unit}, {rate:.1f}/s, ETA {eta}",
              flush=True)


class EvalWorker:
    """Ray actor body (wrapped with ``ray.remote`` by :func:`evaluate`): loads the model
    and the posteriors once in ``__init__``; ``run(in_shard, ood_shard)`` evaluates one
    ``streaming_split`` iterator of each dataset and returns JSON-able accumulators."""

    def __init__(self, model: Mapping[str, Any], posterior_uris: Mapping[str, str],
                 hyper: Mapping[str, Sequence[float]] | None, cfg: EvalConfig,
                 endpoint_url: storage.Store = None):
        # an exception here is kept, not raised: Ray would print its traceback from every
        # actor; the driver asks ``started()`` and reports the first one in one line
        self.cfg = cfg
        self.init_error: str | None = None
        try:
            self._load(model, posterior_uris, hyper, cfg, endpoint_url)
        except Exception as e:  # noqa: BLE001 - reported to the driver, which stops the stage
            self.init_error = f"{type(e).__name__}: {e}"

    def started(self) -> str | None:
        """``None`` once the model and posteriors are loaded, else the error, in one line."""
        return self.init_error

    def _load(self, model, posterior_uris, hyper, cfg, endpoint_url) -> None:
        t0 = time.perf_counter()
        torch.set_num_threads(cfg.threads)
        tune_malloc()  # reuse the per-batch buffers instead of page-faulting them in again
        self.model = load_eval_model(model, dtype=cfg.torch_dtype, device=cfg.resolved_device,
                                     endpoint_url=endpoint_url)
        dev = torch.device(cfg.resolved_device)
        # draws happen where the model runs (the posterior's device, laplace_core.predictive)
        self.posteriors = {m: p if dev.type == "cpu" else p.to(dev)
                           for m, p in load_posteriors(posterior_uris, hyper, endpoint_url).items()}
        self.load_seconds = time.perf_counter() - t0

    def run(self, in_shard: Any, ood_shard: Any = None, actor_index: int = 0) -> dict[str, Any]:
        if self.init_error is not None:  # the driver stops the stage on ``started()``
            return {"init_error": self.init_error}
        t0 = time.perf_counter()
        in_it, in_skipped = valid_batches(in_shard, self.cfg.batch_size)
        if self.cfg.fault_marker is not None:
            in_it = _exit_once_after_first(in_it, self.cfg.fault_marker)
        ood_it, ood_skipped = (None, None) if ood_shard is None else valid_batches(ood_shard, self.cfg.batch_size)
        acc, info = evaluate_shard(self.model, self.posteriors, in_it, ood_it, self.cfg,
                                   progress=ActorProgress("evaluate", actor_index, self.cfg))
        return {
            "accumulators": {m: a.to_json() for m, a in acc.items()},
            "seconds": info["seconds"],
            "failed": info["failed"],
            "examples": info["examples"],
            "ood_examples": info["ood_examples"],
            "skipped": in_skipped().to_dict(),
            "ood_skipped": None if ood_skipped is None else ood_skipped().to_dict(),
            "load_seconds": self.load_seconds,
            "run_seconds": time.perf_counter() - t0,
        }


def _exit_once_after_first(batches, marker: str):
    """Test-only fault (``RuntimeFields.fault_marker``): after the first batch, exit the
    process unless ``marker`` exists; write it first, so that a retried round runs clean."""
    for i, b in enumerate(batches):
        yield b
        if i == 0 and not storage.exists(marker):
            storage.write_json_atomic(marker, {"pid": os.getpid(), "time": time.time()})
            print(f"[evaluate] fault injection: actor process {os.getpid()} exits", flush=True)
            os._exit(1)


def _actor_options(cfg: RuntimeFields) -> dict[str, Any]:
    return {"num_cpus": cfg.cpus_per_actor, "num_gpus": cfg.gpus_per_actor}


def _wait_for_actors(ready: Sequence[Any], cfg: RuntimeFields, what: str) -> None:
    """Return once every actor is placed and constructed (or has died: ``run`` then raises).
    ``ready``: each actor's ``__ray_ready__`` ref, queued before any other call. While some
    wait for resources, print every ``cfg.log_every_s`` seconds what each asks for and what
    the cluster has: an actor that asks for a GPU on a cluster without one (and no autoscaler
    to add one) would otherwise wait silently forever. After ``cfg.placement_timeout_s``
    seconds the wait ends with a :class:`pipelines.errors.StageError` saying the same."""
    import ray

    pending = list(ready)
    t0 = time.perf_counter()
    deadline = t0 + cfg.placement_timeout_s
    while pending:
        wait = max(0.0, min(cfg.log_every_s, deadline - time.perf_counter()))
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=wait)
        if not pending:
            break
        have = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
        asks = f"each asks for {_actor_options(cfg)}, the cluster has {have}"
        if time.perf_counter() >= deadline:
            raise StageError(f"{what}: {len(pending)} of {len(ready)} actor(s) could not be placed within "
                             f"{cfg.placement_timeout_s:g} s: {asks} (lower evaluate.gpus_per_actor or "
                             "evaluate.cpus_per_actor, add nodes, or raise evaluate.placement_timeout_s)")
        print(f"[{what}] {len(pending)} of {len(ready)} actor(s) not started after "
              f"{time.perf_counter() - t0:.0f} s: {asks} "
              "(on a cluster without GPUs, set evaluate.gpus_per_actor=0)", flush=True)


def run_actors(actor_cls: type, init_args: tuple, datasets: Sequence[Any], cfg: RuntimeFields) -> list[dict[str, Any]]:
    """Start ``cfg.num_actors`` actors of ``actor_cls(*init_args)``, give actor ``i`` the
    ``i``-th ``streaming_split(num_actors, equal=False)`` iterator of every dataset in
    ``datasets`` (``None`` entries stay ``None``) and return their ``run`` results in actor
    order. Actors are killed afterwards. When an actor dies (``ray.exceptions.RayActorError``)
    the whole round starts again with new actors and new splits, at most ``cfg.max_failures``
    times. An error raised by the actors' code (in ``__init__``, reported by ``started()``, or in
    ``run``) stops the round at once as a :class:`pipelines.errors.StageError` carrying the
    cause's own one-line message (which names the URI), not the remote tracebacks."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    n = cfg.num_actors
    name = actor_cls.__name__
    remote_cls = ray.remote(actor_cls).options(**_actor_options(cfg))
    for attempt in range(cfg.max_failures + 1):
        actors = [remote_cls.remote(*init_args) for _ in range(n)]
        # queued before ``run`` (an actor runs its calls in order): resolves once it is constructed;
        # actors with a ``started()`` method report an error of their ``__init__`` through it
        ready = [(a.started if hasattr(actor_cls, "started") else a.__ray_ready__).remote() for a in actors]
        try:
            splits = [None if ds is None else ds.streaming_split(n, equal=False) for ds in datasets]
            refs = [a.run.remote(*[None if s is None else s[i] for s in splits], actor_index=i)
                    for i, a in enumerate(actors)]
            _wait_for_actors(ready, cfg, name)
            errors = [e for e in ray.get(ready) if isinstance(e, str)]
            if errors:
                raise StageError(f"{name}: {len(errors)} of {n} actor(s) could not start: {errors[0]}")
            try:
                return ray.get(refs)
            except RayTaskError as e:  # the actors' own code raised: its message, not the remote traceback
                raise StageError(f"{name} failed: {cause_line(e)}") from None
        except RayActorError as e:
            if attempt == cfg.max_failures:
                raise
            why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            print(f"[{actor_cls.__name__}] an actor died ({why}); starting the round again "
                  f"(attempt {attempt + 2} of {cfg.max_failures + 1})", flush=True)
        finally:
            for a in actors:
                ray.kill(a)
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- driver
def eval_uri(output: str, method: str) -> str:
    """``<output>/eval/<method>``."""
    return storage.join(output, "eval", method)


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


def evaluate(
    model_spec: Any,
    posterior_uris: Mapping[str, str],
    in_ds: Any,
    ood_ds: Any | None,
    cfg: EvalConfig = EvalConfig(),
    *,
    output: str | None = None,
    hyper: Mapping[str, Sequence[float]] | None = None,
    endpoint_url: str | None = None,
) -> dict[str, dict[str, Any]]:
    """MC evaluation of the MAP baseline and every posterior on Ray actors.

    ``model_spec``: ``ModelSpec``-like (name, weights URI, num_classes) or a mapping.
    ``posterior_uris``: ``method -> artifact URI`` (``Posterior.save``). ``in_ds``: Ray
    Dataset with columns image/label/path/valid (``pipelines.ingest.batches.build_dataset``; the
    labelled test split). ``ood_ds``: the same for an OOD set, or None. ``hyper``: optional
    ``method -> (N, τ)`` applied with ``with_hyper`` inside the actors (e.g. the search's
    choice). Returns ``method -> metrics`` (``"map"`` always first): the output of
    :meth:`EvalAccumulator.compute` plus ``method``, ``status`` ("ok"/"failed"),
    ``reason``, ``pred_type``, ``mc_samples``, ``seed``, ``n_data``, ``prior_precision``,
    ``timing`` (``seconds_sum`` / ``seconds_max`` over actors, ``wall_s``, ``load_s_max``),
    ``skipped`` / ``ood_skipped`` (invalid images). With ``output``, writes
    ``<output>/eval/<method>/metrics.json`` and ``accumulators.json`` (atomic).
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
    methods = [MAP, *uris]
    t0 = time.perf_counter()
    results = run_actors(EvalWorker, (ref, uris, dict(hyper) if hyper else None, cfg, endpoint_url),
                         [in_ds, ood_ds], cfg)
    wall = time.perf_counter() - t0
    merged = merge_worker_results(results, methods, cfg)
    skipped = _merge_skips([r["skipped"] for r in results])
    ood_skipped = _merge_skips([r["ood_skipped"] for r in results])
    hyper_used = _hyper_of(uris, hyper, endpoint_url)
    out: dict[str, dict[str, Any]] = {}
    for m in methods:
        e = merged[m]
        res: dict[str, Any] = {"method": m, "pred_type": "map" if m == MAP else cfg.pred_type,
                               "mc_samples": None if m == MAP else cfg.mc_samples, "seed": cfg.seed}
        res.update(hyper_used.get(m, {}))
        if e["failed"] is None:
            res.update(e["accumulator"].compute(cfg.ece_mode))
            res["status"], res["reason"] = "ok", ""
        else:
            res["status"], res["reason"] = "failed", e["failed"]
        res["timing"] = {"seconds_sum": e["seconds_sum"], "seconds_max": e["seconds_max"], "wall_s": wall,
                         "load_s_max": max(r["load_seconds"] for r in results), "num_actors": cfg.num_actors}
        res["skipped"], res["ood_skipped"] = skipped, ood_skipped
        out[m] = res
        if output is not None:
            d = eval_uri(output, m)
            storage.write_json_atomic(storage.join(d, "metrics.json"), res, endpoint_url)
            if e["accumulator"] is not None:
                storage.write_json_atomic(storage.join(d, "accumulators.json"), e["accumulator"].to_json(),
                                          endpoint_url)
    return out


def _hyper_of(uris: Mapping[str, str], hyper: Mapping[str, Sequence[float]] | None,
              endpoint_url: str | None = None) -> dict[str, dict[str, Any]]:
    """``method -> {"n_data", "prior_precision", "hyper_source"}`` as evaluated: from ``hyper``
    when given, else from the artifact's manifest (``meta.n_data`` / ``meta.prior_precision``)."""
    from laplace_core.io import MANIFEST_FILE

    out: dict[str, dict[str, Any]] = {}
    for m, uri in uris.items():
        if hyper and hyper.get(m) is not None:
            n, t = hyper[m]
            out[m] = {"n_data": float(n), "prior_precision": float(t), "hyper_source": "given"}
        else:
            meta = storage.read_json(storage.join(uri, MANIFEST_FILE), endpoint_url).get("meta", {})
            out[m] = {"n_data": meta.get("n_data"), "prior_precision": meta.get("prior_precision"),
                      "hyper_source": "artifact"}
    return out
