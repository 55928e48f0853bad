"""Settings of the search and evaluation actors: one frozen dataclass per stage.

:class:`RuntimeFields` holds what every round of actors needs (how many actors, their Ray
resources, batch and chunk sizes, dtype and device, retries, logging, placement timeout);
:class:`EvalConfig` (``pipelines.evaluation.evaluate``) and :class:`SearchConfig`
(``pipelines.evaluation.search``) add what their stage computes. Both are built from the
run's YAML/``--set`` tree (``pipelines.config.schema``) without a hand-written field list:
:meth:`RuntimeFields.from_spec` copies every field a spec shares with the runtime class.
:func:`search_config` and :func:`eval_config` give the two settings of a run; the search
takes the actor settings, the predictive type and the ECE variant and bins of
``evaluate`` (so that it scores with the ECE the evaluation reports), and its own
``search`` section over them.
"""
from __future__ import annotations


import math
from dataclasses import dataclass
from typing import Any

import torch

from laplace_core.metrics.base import DEFAULT_ECE_BINS, ECE_STRATEGIES, ENTROPY_BINS

from pipelines.distributed.workers import DTYPES
from pipelines.evaluation.chunks import check_pos_int
from pipelines.evaluation.predictors import check_pred_type
from pipelines.storage import layout

__all__ = [
    "OBJECTIVES",
    "SCHEDULERS",
    "ALGORITHMS",
    "RuntimeFields",
    "EvalConfig",
    "SearchConfig",
    "eval_config",
    "search_config",
    "eval_uri",
]

#: ``search.scheduler`` values (``pipelines.evaluation.tune``).
SCHEDULERS: dict[str, str] = {"none": "every configuration on the whole split",
                              "asha": "ASHA: stop bad configurations after a chunk, 1/reduction_factor go on"}
#: ``search.algorithm`` values (``pipelines.evaluation.tune``).
ALGORITHMS: dict[str, str] = {"random": "the seeded uniform draws of sample_configs (Lee et al. 2020)",
                              "tpe": "Optuna's TPE sampler, seeded"}

#: Search objectives.
OBJECTIVES: dict[str, str] = {
    "nll": "smallest validation NLL",
    "ece": "smallest validation ECE among configurations with accuracy >= accuracy_floor",
}


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
            check_pos_int(n, getattr(self, n))
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
            check_pos_int("torch_threads", self.torch_threads)
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; valid: {', '.join(DTYPES)}")
        if self.device is not None and torch.device(self.device).type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

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

    @classmethod
    def from_spec(cls, *specs: Any, **overrides: Any):
        """An instance from YAML spec dataclasses (``pipelines.config.schema``): every field a
        spec shares with ``cls`` (``dataclasses.fields``) is copied, a later spec over an
        earlier one, then ``overrides`` (:func:`pipelines.config.load.derive`). A spec's null
        for a field that does not admit null (``evaluate.gpus_per_actor``: a share of the
        cluster's GPUs, which only the run can resolve) keeps the default."""
        from pipelines.config.load import derive

        return derive(cls, *specs, **overrides)


def _check_scoring(cfg: Any) -> None:
    """The checks of the fields the search and the evaluation share: ``mc_samples``,
    ``seed``, ``ece_bins``, ``ece_mode``, ``pred_type``."""
    check_pos_int("mc_samples", cfg.mc_samples)
    check_pos_int("ece_bins", cfg.ece_bins)
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int):
        raise ValueError(f"seed must be an int, got {cfg.seed!r}")
    if cfg.ece_mode not in ECE_STRATEGIES:
        raise ValueError(f"unknown ece_mode {cfg.ece_mode!r}; valid: {', '.join(ECE_STRATEGIES)}")
    check_pred_type(cfg.pred_type)


@dataclass(frozen=True)
class EvalConfig(RuntimeFields):
    """What to evaluate. mc_samples: ``K_mc`` weight samples (default 30). seed: run seed
    (sample ``t`` uses ``sample_seed(seed, t)``). ece_bins / ece_mode ("equal_width" or
    "equal_mass"): headline ECE variant (both are always computed). pred_type: "nn" or
    "glm" (``pipelines.evaluation.predictors.PRED_TYPES``).
    sample_cache_mb: keep a method's ``K`` deltas in memory when they fit (MiB).
    entropy_bins: histogram bins for entropies; ood_exact_limit: keep raw OOD scores
    (exact AUROC) while in + out examples <= this (see ``OODDetection``).
    bootstrap: resamples of the paired bootstrap over test images behind every interval
    (:mod:`laplace_core.metrics.bootstrap`, seeded by ``seed``; default 1,000).
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
    bootstrap: int = 1000

    def __post_init__(self) -> None:
        self._check_runtime()
        _check_scoring(self)
        check_pos_int("entropy_bins", self.entropy_bins)
        if isinstance(self.bootstrap, bool) or not isinstance(self.bootstrap, int) or self.bootstrap < 2:
            raise ValueError(f"bootstrap must be an int >= 2 (resamples), got {self.bootstrap!r}")
        if not (self.sample_cache_mb >= 0):
            raise ValueError(f"sample_cache_mb must be >= 0, got {self.sample_cache_mb!r}")
        if isinstance(self.ood_exact_limit, bool) or not isinstance(self.ood_exact_limit, int) or self.ood_exact_limit < 0:
            raise ValueError(f"ood_exact_limit must be an int >= 0, got {self.ood_exact_limit!r}")


def _range(name: str, r: Any) -> tuple[float, float]:
    """``(low, high)`` as floats, finite with ``low <= high``, else a ``ValueError`` naming ``name``."""
    try:
        lo, hi = (float(v) for v in r)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (low, high) pair of numbers, got {r!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
        raise ValueError(f"{name} must be finite with low <= high, got {r!r}")
    return lo, hi


@dataclass(frozen=True)
class SearchConfig(RuntimeFields):
    """Random-search settings. num_configs / log10_n / log10_tau / seed: the configurations
    (``pipelines.evaluation.search.sample_configs``); configs: explicit ``(log10_n,
    log10_tau)`` pairs instead (then num_configs/ranges are ignored). method_ranges: ``(method, log10_n, log10_tau)`` entries
    (or ``pipelines.config.schema.MethodRange`` objects) overriding the ranges for that method; a
    ``None`` range keeps the common one. objective: "nll" or "ece"; accuracy_floor: minimum
    validation accuracy for "ece" (None: no floor). mc_samples: ``K`` per configuration
    (default 10). ece_bins / ece_mode: the ECE used. scheduler: "none" or "asha" (grace
    period one chunk of ``chunk_size`` examples, ``reduction_factor``); algorithm: "random"
    (these configurations) or "tpe" (Optuna) (``pipelines.evaluation.tune``). Runtime fields: see
    ``RuntimeFields`` (chunk_size defaults to 4096 here)."""

    num_configs: int = 100
    log10_n: tuple[float, float] = (0.0, 8.0)
    log10_tau: tuple[float, float] = (-4.0, 4.0)
    objective: str = "nll"
    accuracy_floor: float | None = None
    mc_samples: int = 10
    seed: int = 0
    ece_bins: int = DEFAULT_ECE_BINS
    ece_mode: str = "equal_width"
    configs: tuple[tuple[float, float], ...] | None = None
    chunk_size: int = 4096
    pred_type: str = "nn"
    method_ranges: tuple[tuple[str, tuple[float, float], tuple[float, float]], ...] = ()
    scheduler: str = "none"
    algorithm: str = "random"
    reduction_factor: int = 4

    def __post_init__(self) -> None:
        self._check_runtime()
        _check_scoring(self)
        check_pos_int("num_configs", self.num_configs)
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"unknown search scheduler {self.scheduler!r}; valid: {', '.join(SCHEDULERS)}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown search algorithm {self.algorithm!r}; valid: {', '.join(ALGORITHMS)}")
        if isinstance(self.reduction_factor, bool) or not isinstance(self.reduction_factor, int) \
                or self.reduction_factor < 2:
            raise ValueError(f"reduction_factor must be an int >= 2, got {self.reduction_factor!r}")
        if self.algorithm == "tpe" and self.configs is not None:
            raise ValueError("search.algorithm=tpe samples its own configurations; explicit configs need random")
        object.__setattr__(self, "log10_n", _range("log10_n", self.log10_n))
        object.__setattr__(self, "log10_tau", _range("log10_tau", self.log10_tau))
        object.__setattr__(self, "method_ranges", self._method_ranges())
        if self.objective not in OBJECTIVES:
            raise ValueError(f"unknown search objective {self.objective!r}; valid: {', '.join(OBJECTIVES)}")
        if self.accuracy_floor is not None and not (0.0 <= float(self.accuracy_floor) <= 1.0):
            raise ValueError(f"accuracy_floor must be in [0, 1] or None, got {self.accuracy_floor!r}")
        if self.configs is not None:
            pairs = []
            for c in self.configs:
                try:
                    a, b = (float(v) for v in c)
                except (TypeError, ValueError):
                    raise ValueError(f"configs entries must be (log10_n, log10_tau) pairs, got {c!r}") from None
                if not math.isfinite(a) or math.isnan(b) or b == math.inf:
                    raise ValueError(f"configs entry {c!r}: log10_n must be finite, log10_tau finite or -inf")
                pairs.append((a, b))
            if not pairs:
                raise ValueError("configs must not be empty (or None to sample)")
            object.__setattr__(self, "configs", tuple(pairs))

    def _method_ranges(self) -> tuple[tuple[str, tuple[float, float], tuple[float, float]], ...]:
        """``method_ranges`` normalised: one ``(method, log10_n, log10_tau)`` per method,
        ``None`` ranges filled with the common ones."""
        out, seen = [], set()
        for e in self.method_ranges:
            if hasattr(e, "method"):  # pipelines.config.schema.MethodRange
                e = (e.method, e.log10_n, e.log10_tau)
            try:
                method, rn, rt = e
            except (TypeError, ValueError):
                raise ValueError(f"method_ranges entries must be (method, log10_n, log10_tau), got {e!r}") from None
            if not isinstance(method, str) or not method:
                raise ValueError(f"method_ranges entry {e!r}: the method must be a name")
            if method in seen:
                raise ValueError(f"method_ranges names {method!r} twice")
            seen.add(method)
            out.append((method,
                        self.log10_n if rn is None else _range(f"method_ranges[{method}].log10_n", rn),
                        self.log10_tau if rt is None else _range(f"method_ranges[{method}].log10_tau", rt)))
        return tuple(out)

    def ranges(self, method: str | None = None) -> tuple[tuple[float, float], tuple[float, float]]:
        """``(log10_n, log10_tau)`` searched for ``method`` (the common ranges for ``None``)."""
        for m, rn, rt in self.method_ranges:
            if m == method:
                return rn, rt
        return self.log10_n, self.log10_tau


def eval_config(run: Any, **overrides: Any) -> EvalConfig:
    """The evaluation settings of a run (``pipelines.config.schema.RunConfig``): its
    ``evaluate`` section, then ``overrides`` (what the run resolves: the actors' GPU share,
    the expected row counts)."""
    return EvalConfig.from_spec(run.evaluate, **overrides)


def search_config(run: Any, **overrides: Any) -> SearchConfig:
    """The search settings of a run: the ``evaluate`` section's fields the search shares
    (actors, resources, batch size, retries, ``pred_type``, ``ece_mode``, ``ece_bins``),
    then the ``search`` section over them (its own ``mc_samples``, ``seed``, chunk size),
    then ``overrides``."""
    return SearchConfig.from_spec(run.evaluate, run.search, **overrides)


eval_uri = layout.eval_uri
