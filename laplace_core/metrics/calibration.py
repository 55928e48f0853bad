"""Histogram metrics of one prediction set: calibration (ECE, MCE, reliability table) and
the normalised predictive entropy. Conventions (bins, edges, ``0 log 0``) are those of
:mod:`laplace_core.metrics.base`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .base import (
    DEFAULT_ECE_BINS,
    ECE_STRATEGIES,
    ENTROPY_BINS,
    FINE_BINS,
    MetricAccumulator,
    bin_edges,
    bin_index,
    check_nbins,
    check_probs,
    check_same,
    conf_correct,
    hist_json,
    merge_classes,
    normalized_entropy,
)

__all__ = ["Calibration", "Entropy"]


# --------------------------------------------------------------------------- calibration
@dataclass(frozen=True, eq=False)
class Calibration(MetricAccumulator):
    """ECE, MCE and the reliability-diagram table from a histogram of confidences.

    Per histogram bin it keeps ``counts`` (int64), ``conf_sums`` (float64, sum of
    confidences) and ``correct`` (int64, number of correct predictions).

    * ``strategy="equal_width"``: the histogram *is* the ``n_bins`` equal-width
      right-closed bins (exact).
    * ``strategy="equal_mass"``: the histogram is a fine one (``fine_bins``
      equal-width right-closed bins on ``[0, 1]``); at ``compute`` time the fine
      bins are grouped into ``n_bins`` groups of (nearly) equal mass: with the
      examples sorted by confidence, a fine bin whose first example has 0-based
      rank ``r`` joins group ``floor(r * n_bins / N)``. This is exactly the rank
      rule "example of rank ``r`` goes to bin ``floor(r * n_bins / N)``, ties kept
      together in the bin of their first member" whenever each fine bin holds at
      most one distinct confidence (e.g. few distinct values); otherwise examples
      sharing a fine bin (width ``1/fine_bins``) cannot be split across a group
      boundary, which moves at most one fine bin's examples per boundary. The
      mean confidence of each group is exact (per-bin sums), so the approximation
      is only in group membership. Groups can come out empty when one fine bin
      holds more than ``N / n_bins`` examples; empty groups get weight 0.

    ECE = ``sum_b |conf_sum_b - correct_b| / N``; MCE = ``max_b |gap_b|`` over
    non-empty bins; per-bin ``gap = mean confidence - accuracy`` (positive means
    over-confident).
    """

    kind: ClassVar[str] = "calibration"
    strategy: str = "equal_width"
    n_bins: int = DEFAULT_ECE_BINS
    fine_bins: int = FINE_BINS
    num_classes: int | None = None
    counts: torch.Tensor | None = None
    conf_sums: torch.Tensor | None = None
    correct: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.strategy not in ECE_STRATEGIES:
            raise ValueError(f"unknown ECE strategy {self.strategy!r}; valid: {', '.join(ECE_STRATEGIES)}")
        check_nbins(self.n_bins, "n_bins")
        check_nbins(self.fine_bins, "fine_bins")
        H = self.hist_bins
        for name, dt in (("counts", torch.int64), ("conf_sums", torch.float64), ("correct", torch.int64)):
            v = getattr(self, name)
            if v is None:
                object.__setattr__(self, name, torch.zeros(H, dtype=dt))
            elif tuple(v.shape) != (H,) or v.dtype != dt:
                raise ValueError(f"{name} must be a {dt} tensor of shape ({H},), got {v.dtype} {tuple(v.shape)}")

    @property
    def name(self) -> str:
        """Variant name used in reports, e.g. ``ece_equal_width_15``."""
        return f"ece_{self.strategy}_{self.n_bins}"

    @property
    def hist_bins(self) -> int:
        return self.n_bins if self.strategy == "equal_width" else self.fine_bins

    @property
    def count(self) -> int:
        return int(self.counts.sum())

    def update(self, probs: torch.Tensor, labels: torch.Tensor) -> "Calibration":
        p, y = check_probs(probs, labels, num_classes=self.num_classes)
        return self.add_checked(p, y)

    def add_checked(self, p: torch.Tensor, y: torch.Tensor) -> "Calibration":
        conf, ok = conf_correct(p, y)
        H = self.hist_bins
        idx = bin_index(conf, H)
        return dataclasses.replace(
            self,
            num_classes=p.shape[1],
            counts=self.counts + torch.bincount(idx, minlength=H),
            conf_sums=self.conf_sums + torch.bincount(idx, weights=conf, minlength=H),
            correct=self.correct + torch.bincount(idx, weights=ok.to(torch.float64), minlength=H).round().to(torch.int64),
        )

    def merge(self, other: "Calibration") -> "Calibration":
        for what in ("strategy", "n_bins", "hist_bins"):
            check_same(what, getattr(self, what), getattr(other, what))
        return dataclasses.replace(
            self,
            num_classes=merge_classes(self.num_classes, other.num_classes),
            counts=self.counts + other.counts,
            conf_sums=self.conf_sums + other.conf_sums,
            correct=self.correct + other.correct,
        )

    def _groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[float, float] | None]]:
        """Per final bin: counts, conf sums, correct counts and ``(lo, hi)`` edges."""
        if self.strategy == "equal_width":
            e = bin_edges(self.n_bins).tolist()
            return self.counts, self.conf_sums, self.correct, [(e[i], e[i + 1]) for i in range(self.n_bins)]
        N = self.count
        before = torch.cumsum(self.counts, 0) - self.counts  # rank of each fine bin's first example
        group = torch.div(before * self.n_bins, N, rounding_mode="floor").clamp(max=self.n_bins - 1)
        nonempty = self.counts > 0
        g = group[nonempty]
        cnt = torch.zeros(self.n_bins, dtype=torch.int64).index_add_(0, g, self.counts[nonempty])
        cs = torch.zeros(self.n_bins, dtype=torch.float64).index_add_(0, g, self.conf_sums[nonempty])
        cor = torch.zeros(self.n_bins, dtype=torch.int64).index_add_(0, g, self.correct[nonempty])
        fine = bin_edges(self.fine_bins).tolist()
        idx = torch.nonzero(nonempty)[:, 0].tolist()
        spans: list[tuple[float, float] | None] = [None] * self.n_bins
        for k, gi in zip(idx, g.tolist()):
            lo_hi = spans[gi]
            spans[gi] = (fine[k], fine[k + 1]) if lo_hi is None else (lo_hi[0], fine[k + 1])
        return cnt, cs, cor, spans

    def compute(self) -> dict[str, Any]:
        """``{"name", "ece", "mce", "bins": [{lo, hi, count, confidence, accuracy, gap}]}``.

        Empty bins have ``confidence = accuracy = gap = None`` (and, for equal mass,
        ``lo = hi = None``); ``lo``/``hi`` of an equal-mass bin are the outer edges of
        its non-empty fine bins.
        """
        N = self.count
        self.require_nonempty(N)
        cnt, cs, cor, spans = self._groups()
        ece = float((cs - cor.to(torch.float64)).abs().sum()) / N
        bins, gaps = [], []
        for b in range(self.n_bins):
            n = int(cnt[b])
            lo, hi = spans[b] if spans[b] is not None else (None, None)
            if n == 0:
                bins.append({"lo": lo, "hi": hi, "count": 0, "confidence": None, "accuracy": None, "gap": None})
                continue
            conf, acc = float(cs[b]) / n, int(cor[b]) / n
            gaps.append(abs(conf - acc))
            bins.append({"lo": lo, "hi": hi, "count": n, "confidence": conf, "accuracy": acc, "gap": conf - acc})
        return {"name": self.name, "ece": ece, "mce": max(gaps), "bins": bins}


# --------------------------------------------------------------------------- entropy
@dataclass(frozen=True, eq=False)
class Entropy(MetricAccumulator):
    """Normalised predictive entropy ``H(p)/log C``: mean and a fixed-edge histogram
    (``n_bins`` right-closed bins on ``[0, 1]``, see :func:`bin_index`)."""

    kind: ClassVar[str] = "entropy"
    n_bins: int = ENTROPY_BINS
    count: int = 0
    total: float = 0.0
    num_classes: int | None = None
    hist: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_nbins(self.n_bins, "n_bins")
        if self.hist is None:
            object.__setattr__(self, "hist", torch.zeros(self.n_bins, dtype=torch.int64))
        elif tuple(self.hist.shape) != (self.n_bins,) or self.hist.dtype != torch.int64:
            raise ValueError(f"hist must be an int64 tensor of shape ({self.n_bins},)")

    def update(self, probs: torch.Tensor, labels: torch.Tensor | None = None) -> "Entropy":
        p, _ = check_probs(probs, labels, num_classes=self.num_classes)
        return self.add_checked(p)

    def add_checked(self, p: torch.Tensor) -> "Entropy":
        h = normalized_entropy(p)
        return dataclasses.replace(
            self,
            count=self.count + p.shape[0],
            total=self.total + float(h.sum()),
            num_classes=p.shape[1],
            hist=self.hist + torch.bincount(bin_index(h, self.n_bins), minlength=self.n_bins),
        )

    def merge(self, other: "Entropy") -> "Entropy":
        check_same("n_bins", self.n_bins, other.n_bins)
        return dataclasses.replace(
            self,
            count=self.count + other.count,
            total=self.total + other.total,
            num_classes=merge_classes(self.num_classes, other.num_classes),
            hist=self.hist + other.hist,
        )

    def compute(self) -> dict[str, Any]:
        self.require_nonempty(self.count)
        return {"entropy_mean": self.total / self.count, "entropy_hist": hist_json(self.n_bins, self.hist)}

