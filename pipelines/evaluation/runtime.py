"""Settings of the search and evaluation actors: the run's config sections, plus what the run resolves.

:class:`RuntimeFields` is :class:`pipelines.config.schema.ActorSpec` (the ``evaluate`` keys of
the actors) plus the three fields only the run or the tests set (``device``, ``fault_marker``,
``expected_rows``); :class:`EvalConfig` is the ``evaluate`` section with them,
:class:`SearchConfig` the ``search`` section with them. No setting is written here: the
fields, defaults, ranges and help are the sections'. :func:`search_config` and
:func:`eval_config` build the two settings of a run (:func:`pipelines.config.load.derive`:
every field a section shares with the class, no field named).
"""
from __future__ import annotations


import math
from dataclasses import dataclass
from typing import Any

import torch

from pipelines.config.choices import PRED_TYPES
from laplace_core.curvature.batch_loop import DTYPES
from pipelines.config.schema import (ALGORITHMS, OBJECTIVES, SCHEDULERS, ActorSpec, EvalSpec, SearchSpec,
                                     method_range_entry)
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


@dataclass(frozen=True)
class RuntimeFields(ActorSpec):
    """The actors' settings (:class:`ActorSpec`: ``evaluate.num_actors``, resources, batch and
    chunk sizes, dtype, retries, logging, placement timeout) and what the run resolves:

    device: "cpu" / "cuda" (None: "cuda" when gpus_per_actor > 0). fault_marker: test-only;
    the first actor to finish a batch while this file (a URI) does not exist writes it and
    exits its process, so that the next attempt runs clean. expected_rows: ``(in-domain or
    validation rows, OOD rows)`` for the progress lines' ETA. decode_cpus: the CPUs each Ray
    Data decode task of the round's datasets asks for (``data.decode_num_cpus``): the round
    keeps them free (:func:`pipelines.evaluation.actors.round_size`). ``gpus_per_actor=None`` here
    means no GPU: the run resolves the share first (``pipelines.cli.model_run.actor_resources``).
    max_failures: times the round of actors is started again when an actor dies; the results
    do not depend on which attempt they come from (every sample is a function of ``(seed, t)``).
    """

    device: str | None = None
    fault_marker: str | None = None
    expected_rows: tuple[int | None, int | None] = (None, None)
    decode_cpus: float = 1.0

    def _check(self) -> None:
        if not (self.decode_cpus >= 0 and math.isfinite(self.decode_cpus)):
            raise ValueError(f"decode_cpus must be >= 0, got {self.decode_cpus!r}")
        if self.gpus_per_actor is None:
            object.__setattr__(self, "gpus_per_actor", 0.0)
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
        """An instance from config sections: every field a section shares with ``cls`` is
        copied, a later section over an earlier one, then ``overrides``
        (:func:`pipelines.config.load.derive`)."""
        from pipelines.config.load import derive

        return derive(cls, *specs, **overrides)


@dataclass(frozen=True)
class EvalConfig(EvalSpec, RuntimeFields):
    """What to evaluate: the ``evaluate`` section (:class:`EvalSpec`) with the run's fields
    (:class:`RuntimeFields`), and ``method_pred_types``: ``(method, pred_type)`` pairs, the
    predictive the search chose per method (``search.pred_types``); a method not listed uses
    ``pred_type``."""

    method_pred_types: tuple[tuple[str, str], ...] = ()

    def _check(self) -> None:
        for m, pt in self.method_pred_types:
            if pt not in PRED_TYPES:
                raise ValueError(f"method_pred_types[{m}]: unknown pred_type {pt!r}; valid: {', '.join(PRED_TYPES)}")
            if pt != "nn" and self.precision != "fp32":
                raise ValueError(f"precision {self.precision} applies to pred_type nn; {m}'s chosen pred_type {pt} "
                                 "runs in fp32")

    def pred_type_of(self, method: str) -> str:
        """The predictive ``method`` is evaluated with (the search's choice, else ``pred_type``)."""
        return dict(self.method_pred_types).get(method, self.pred_type)


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
class SearchConfig(SearchSpec, RuntimeFields):
    """The ``search`` section (:class:`SearchSpec`: the configurations, objective, ``K``,
    ASHA / TPE) over the actors' settings (:class:`RuntimeFields`; ``chunk_size``,
    ``mc_samples`` and ``seed`` are the search's own), and ``configs``: explicit ``(log10_n,
    log10_tau)`` pairs instead of the draws (then num_configs and the ranges are ignored).
    ``method_ranges`` entries (``MethodRange`` or ``(method, log10_n, log10_tau)``) are
    normalised to ``(method, log10_n, log10_tau)`` with the common ranges filled in."""

    configs: tuple[tuple[float, float], ...] | None = None

    def _check(self) -> None:
        if self.algorithm == "tpe" and self.configs is not None:
            raise ValueError("search.algorithm=tpe samples its own configurations; explicit configs need random")
        if self.precision != "fp32" and any(pt != "nn" for pt in self.searched_pred_types):
            raise ValueError(f"precision {self.precision} applies to pred_type nn; search.pred_types "
                             f"{list(self.searched_pred_types)} needs precision fp32")
        object.__setattr__(self, "log10_n", _range("log10_n", self.log10_n))
        object.__setattr__(self, "log10_tau", _range("log10_tau", self.log10_tau))
        object.__setattr__(self, "method_ranges", self._method_ranges())
        if self.configs is not None:
            object.__setattr__(self, "configs", _pairs(self.configs))

    def _method_ranges(self) -> tuple[tuple[str, tuple[float, float], tuple[float, float]], ...]:
        """``method_ranges`` normalised: one ``(method, log10_n, log10_tau)`` per method,
        ``None`` ranges filled with the common ones."""
        out = []
        for entry in self.method_ranges:
            method, range_n, range_tau = method_range_entry(entry)
            if not isinstance(method, str) or not method:
                raise ValueError(f"method_ranges entry {entry!r}: the method must be a name")
            out.append((method,
                        self.log10_n if range_n is None else _range(f"method_ranges[{method}].log10_n", range_n),
                        self.log10_tau if range_tau is None else _range(f"method_ranges[{method}].log10_tau",
                                                                        range_tau)))
        return tuple(out)

    @property
    def trials_at_once(self) -> int:
        """Trials run at once: ``concurrent_trials``, else ``num_actors``."""
        return int(self.concurrent_trials or self.num_actors)

    @property
    def searched_pred_types(self) -> tuple[str, ...]:
        """The predictives the search covers: ``pred_types``, else ``(pred_type,)``."""
        return tuple(self.pred_types) if self.pred_types else (self.pred_type,)

    def ranges(self, method: str | None = None) -> tuple[tuple[float, float], tuple[float, float]]:
        """``(log10_n, log10_tau)`` searched for ``method`` (the common ranges for ``None``)."""
        for m, rn, rt in self.method_ranges:
            if m == method:
                return rn, rt
        return self.log10_n, self.log10_tau


def _pairs(configs: Any) -> tuple[tuple[float, float], ...]:
    """Explicit ``(log10_n, log10_tau)`` configurations as float pairs (``log10_tau`` may be -inf)."""
    pairs = []
    for c in configs:
        try:
            a, b = (float(v) for v in c)
        except (TypeError, ValueError):
            raise ValueError(f"configs entries must be (log10_n, log10_tau) pairs, got {c!r}") from None
        if not math.isfinite(a) or math.isnan(b) or b == math.inf:
            raise ValueError(f"configs entry {c!r}: log10_n must be finite, log10_tau finite or -inf")
        pairs.append((a, b))
    if not pairs:
        raise ValueError("configs must not be empty (or None to sample)")
    return tuple(pairs)


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
