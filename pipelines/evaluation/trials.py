"""The configurations of a ``(N, τ)`` search and the accumulators of one configuration.

:func:`sample_configs` draws the configurations (``docs/design.md`` §1: ``P = N F/M + τ I``):
``cfg.num_configs`` pairs ``(log10 N, log10 τ)`` uniformly from the method's ranges with
``numpy.random.default_rng(seed)``, configuration ``i`` of every method sharing its random
numbers (Lee et al. 2020's random search). :class:`SearchAccumulator` holds the mergeable
sums (accuracy, NLL, Brier, ECE histogram) of one configuration; the hand-written loop
(:func:`pipelines.evaluation.search.search_shard`) and the Ray Tune trials
(:mod:`pipelines.evaluation.tune`) both use it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from laplace_core.metrics.calibration import Calibration
from laplace_core.metrics.scores import NLL, Accuracy, Brier

from pipelines.evaluation.runtime import SearchConfig

__all__ = ["HyperConfig", "sample_configs", "map_limit_config", "SearchAccumulator"]


@dataclass(frozen=True)
class HyperConfig:
    """One configuration: ``N = 10**log10_n``, ``τ = 10**log10_tau`` (``-inf`` gives ``τ = 0``)."""

    config_id: int
    log10_n: float
    log10_tau: float

    @property
    def n_data(self) -> float:
        return 10.0 ** self.log10_n

    @property
    def prior_precision(self) -> float:
        return 0.0 if self.log10_tau == -math.inf else 10.0 ** self.log10_tau


def sample_configs(cfg: SearchConfig, method: str | None = None) -> tuple[HyperConfig, ...]:
    """The configurations of a search (of ``method``, whose ranges may be its own:
    :meth:`SearchConfig.ranges`): ``cfg.configs`` when given, else ``num_configs`` pairs,
    ``log10 N ~ U(log10_n)`` then ``log10 τ ~ U(log10_tau)`` per draw from
    ``numpy.random.default_rng(seed)`` (same seed -> same list, on every machine; the same
    uniform numbers for every method)."""
    if cfg.configs is not None:
        return tuple(HyperConfig(i, a, b) for i, (a, b) in enumerate(cfg.configs))
    rng = np.random.default_rng(cfg.seed)
    u = rng.random((cfg.num_configs, 2))
    (n0, n1), (t0, t1) = cfg.ranges(method)
    drawn = tuple(
        HyperConfig(i, float(n0 + (n1 - n0) * u[i, 0]), float(t0 + (t1 - t0) * u[i, 1]))
        for i in range(cfg.num_configs)
    )
    return drawn + tuple(c for c in [map_limit_config(cfg, method)] if c is not None)


def map_limit_config(cfg: SearchConfig, method: str | None = None) -> HyperConfig | None:
    """The MAP-limit configuration (issue #38) appended to the draws when
    ``cfg.map_limit_log10_tau`` is set: id ``num_configs``, ``log10 N`` at the top of the
    method's range, ``log10 τ = map_limit_log10_tau`` (at 8 the draws move the weights by
    ~10^-4: the predictive is MAP's within MC noise), so every search can reach MAP."""
    if cfg.map_limit_log10_tau is None or cfg.configs is not None:
        return None
    (_, n1), _ = cfg.ranges(method)
    return HyperConfig(cfg.num_configs, float(n1), float(cfg.map_limit_log10_tau))


# --------------------------------------------------------------------------- accumulator
@dataclass(frozen=True, eq=False)
class SearchAccumulator:
    """Accuracy, NLL, Brier and one ECE histogram for one configuration (mergeable sums)."""

    accuracy: Accuracy
    nll: NLL
    brier: Brier
    ece: Calibration

    @classmethod
    def create(cls, cfg: SearchConfig) -> "SearchAccumulator":
        return cls(Accuracy(), NLL(), Brier(), Calibration(cfg.ece_mode, cfg.ece_bins))

    def update(self, probs: torch.Tensor, labels: torch.Tensor) -> "SearchAccumulator":
        return SearchAccumulator(self.accuracy.update(probs, labels), self.nll.update(probs, labels),
                                 self.brier.update(probs, labels), self.ece.update(probs, labels))

    def merge(self, o: "SearchAccumulator") -> "SearchAccumulator":
        return SearchAccumulator(self.accuracy.merge(o.accuracy), self.nll.merge(o.nll),
                                 self.brier.merge(o.brier), self.ece.merge(o.ece))

    @property
    def count(self) -> int:
        return self.accuracy.count

    def compute(self) -> dict[str, float]:
        return {**self.accuracy.compute(), **self.nll.compute(), **self.brier.compute(),
                "ece": self.ece.compute()["ece"], "count": self.count}

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k).to_json() for k in ("accuracy", "nll", "brier", "ece")}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "SearchAccumulator":
        return cls(Accuracy.from_json(d["accuracy"]), NLL.from_json(d["nll"]), Brier.from_json(d["brier"]),
                   Calibration.from_json(d["ece"]))
