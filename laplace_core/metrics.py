"""Mergeable evaluation metrics: accuracy, NLL, Brier, ECE, entropy, OOD detection.

Every metric is a frozen-dataclass *accumulator of sufficient statistics* (integer
counts, float64 sums, histograms with fixed edges). ``update`` returns a new
accumulator, ``merge`` adds two accumulators, ``compute`` turns the sums into
numbers, ``to_json`` / ``from_json`` round-trip exactly (JSON floats are written
with ``repr``). Because everything is a sum over examples, the accumulators of
disjoint shards merged in any order give the metrics of the whole set: counts
and histograms exactly, float sums up to float64 rounding (~1e-15 relative).

Inputs: ``probs`` ``[B, C]`` (a floating tensor of class probabilities, ``C >= 2``)
and ``labels`` ``[B]`` (integers in ``[0, C)``). Everything is accumulated on the
CPU in float64. Bad input raises a one-line ``ValueError`` (see :func:`check_probs`).

Conventions (named in :meth:`MetricSuite.compute`'s output under ``"conventions"``):

* prediction = ``argmax_c p_c`` (ties -> lowest class index); confidence = ``max_c p_c``.
* NLL = mean over examples of ``-log max(p_y, NLL_EPS)``, ``NLL_EPS = 1e-12``.
* Brier = mean over examples of ``sum_c (p_c - 1[c = y])^2`` (range ``[0, 2]``; the
  multi-class convention of Brier 1950, *not* divided by ``C`` or by 2).
* ECE = ``sum_b (n_b / N) |conf_b - acc_b|`` over bins of the confidence. Bins are
  right-closed ``(lo, hi]``; the first bin also holds confidence exactly ``0``.
  Equal width: ``n_bins`` bins with float64 edges ``i / n_bins``; a confidence that
  equals an edge (as a float64 number) goes to the bin *below* it, e.g. ``1/15``
  lies in bin 0 and ``1.0`` in the last bin. Equal mass: see :class:`Calibration`.
* Normalised predictive entropy ``H(p) / log C`` with ``0 log 0 = 0``, clamped to
  ``[0, 1]`` (rounding can give ``1 + 1e-16`` for a uniform ``p``).
* OOD detection: score = normalised entropy, OOD is the positive class, a higher
  score means "more OOD". AUROC counts ties as 1/2, AUPR is average precision
  ``sum_k (R_k - R_{k-1}) P_k`` over distinct thresholds (scikit-learn's
  ``average_precision_score``), FPR@95TPR is the FPR at the first threshold (from
  high to low scores) whose TPR is ``>= 0.95`` (scikit-learn's ``roc_curve``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping

import torch

__all__ = [
    "NLL_EPS",
    "PROB_SUM_TOL",
    "DEFAULT_ECE_BINS",
    "FINE_BINS",
    "ENTROPY_BINS",
    "ECE_STRATEGIES",
    "check_probs",
    "normalized_entropy",
    "bin_index",
    "Accuracy",
    "NLL",
    "Brier",
    "Calibration",
    "Entropy",
    "OODDetection",
    "MetricSuite",
]

NLL_EPS = 1e-12
"""``-log p_y`` is computed as ``-log max(p_y, NLL_EPS)`` (a zero probability gives ~27.6, not inf)."""
PROB_SUM_TOL = 1e-4
"""Rows of ``probs`` must sum to 1 within this absolute tolerance; entries must lie in ``[0, 1 + tol]``."""
DEFAULT_ECE_BINS = 15
FINE_BINS = 10_000
"""Fine fixed-edge histogram on ``[0, 1]`` behind equal-mass ECE and histogram-mode OOD metrics."""
ENTROPY_BINS = 50
ECE_STRATEGIES = ("equal_width", "equal_mass")

_JSON_FORMAT = "infoform.metrics"


# --------------------------------------------------------------------------- input checks
def check_probs(
    probs: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    num_classes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validate and return ``(probs, labels)`` as CPU float64 ``[B, C]`` / int64 ``[B]``.

    Raises ``ValueError`` when ``probs`` is not a 2-D floating tensor with ``C >= 2``,
    has NaN/inf, entries outside ``[0, 1 + PROB_SUM_TOL]``, rows not summing to 1
    within ``PROB_SUM_TOL``, ``C != num_classes`` (when given); or when ``labels`` is
    not a 1-D integer tensor of length ``B`` with values in ``[0, C)``.
    """
    if not isinstance(probs, torch.Tensor):
        raise ValueError(f"probs must be a torch.Tensor, got {type(probs).__name__}")
    if probs.dim() != 2:
        raise ValueError(f"probs must have shape [B, C], got {tuple(probs.shape)}")
    if not probs.is_floating_point():
        raise ValueError(f"probs must be a floating tensor, got dtype {probs.dtype}")
    B, C = probs.shape
    if C < 2:
        raise ValueError(f"probs must have at least 2 classes, got C={C}")
    if num_classes is not None and C != num_classes:
        raise ValueError(f"probs has {C} classes but this accumulator holds {num_classes}")
    p = probs.detach().to(device="cpu", dtype=torch.float64)
    if B > 0:
        if not bool(torch.isfinite(p).all()):
            raise ValueError(f"probs contains {int((~torch.isfinite(p)).sum())} NaN/inf entries")
        lo, hi = float(p.min()), float(p.max())
        if lo < 0.0 or hi > 1.0 + PROB_SUM_TOL:
            raise ValueError(f"probs must lie in [0, 1], got min {lo:.3g}, max {hi:.6g}")
        err = (p.sum(dim=1) - 1.0).abs()
        if float(err.max()) > PROB_SUM_TOL:
            row = int(err.argmax())
            raise ValueError(
                f"probs rows must sum to 1 (tolerance {PROB_SUM_TOL}); row {row} sums to {float(p[row].sum()):.6g}"
            )
    if labels is None:
        return p, None
    if not isinstance(labels, torch.Tensor):
        raise ValueError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dim() != 1 or labels.shape[0] != B:
        raise ValueError(f"labels must have shape [{B}] to match probs {tuple(probs.shape)}, got {tuple(labels.shape)}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    y = labels.detach().to(device="cpu", dtype=torch.int64)
    if B > 0:
        ymin, ymax = int(y.min()), int(y.max())
        if ymin < 0 or ymax >= C:
            raise ValueError(f"labels must lie in [0, {C}), got min {ymin}, max {ymax}")
    return p, y


def _merge_classes(a: int | None, b: int | None) -> int | None:
    if a is not None and b is not None and a != b:
        raise ValueError(f"cannot merge accumulators for {a} and {b} classes")
    return a if a is not None else b


def _same(what: str, a: Any, b: Any) -> None:
    if a != b:
        raise ValueError(f"cannot merge accumulators with different {what}: {a!r} vs {b!r}")


def _check_nbins(n: int, what: str) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{what} must be a positive int, got {n!r}")


# --------------------------------------------------------------------------- binning / entropy
def _edges(n_bins: int) -> torch.Tensor:
    """float64 edges ``i / n_bins``, ``i = 0..n_bins`` (each correctly rounded)."""
    return torch.arange(n_bins + 1, dtype=torch.float64) / n_bins


def bin_index(values: torch.Tensor, n_bins: int) -> torch.Tensor:
    """Index of the right-closed bin ``(i/n, (i+1)/n]`` holding each value of ``[0, 1]``.

    A value equal to an interior edge ``i/n`` (float64) goes to bin ``i - 1``; ``0``
    goes to bin 0, ``1`` to bin ``n - 1``. Values are clamped to ``[0, 1]`` first.
    """
    v = values.to(torch.float64).clamp(0.0, 1.0)
    return torch.bucketize(v, _edges(n_bins)[1:-1], right=False)


def normalized_entropy(probs: torch.Tensor) -> torch.Tensor:
    """``H(p) / log C = -sum_c p_c log p_c / log C`` per row of ``probs [B, C]`` -> ``[B]``,
    with ``0 log 0 = 0``, clamped to ``[0, 1]``. No input checks (see :func:`check_probs`)."""
    C = probs.shape[-1]
    h = -torch.special.xlogy(probs, probs).sum(dim=-1)
    return (h / math.log(C)).clamp(0.0, 1.0)


def _conf_correct(p: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    conf, pred = p.max(dim=1)
    return conf, (pred == y)


def _hist_json(n_bins: int, counts: torch.Tensor) -> dict[str, list]:
    return {"edges": _edges(n_bins).tolist(), "counts": [int(c) for c in counts.tolist()]}


# --------------------------------------------------------------------------- base class
class _Accumulator:
    """Shared JSON round trip: scalars as JSON numbers, tensors as ``{"dtype", "data"}``."""

    kind: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": _JSON_FORMAT, "version": 1, "kind": self.kind}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = {"dtype": str(v.dtype).removeprefix("torch."), "data": v.tolist()}
            out[f.name] = v
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]):
        if d.get("format") != _JSON_FORMAT or d.get("kind") != cls.kind:
            raise ValueError(f"not a {cls.kind} accumulator (format/kind tags: {d.get('format')!r}, {d.get('kind')!r})")
        kwargs = {}
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name not in d:
                raise ValueError(f"{cls.kind} accumulator JSON lacks field {f.name!r}")
            v = d[f.name]
            if isinstance(v, Mapping) and set(v) == {"dtype", "data"}:
                v = torch.tensor(v["data"], dtype=getattr(torch, v["dtype"]))
            kwargs[f.name] = v
        return cls(**kwargs)

    def _require_nonempty(self, count: int) -> None:
        if count == 0:
            raise ValueError(f"{self.kind}: no examples accumulated; nothing to compute")


# --------------------------------------------------------------------------- simple sums
@dataclass(frozen=True, eq=False)
class Accuracy(_Accumulator):
    """Top-1 accuracy: ``correct / count``."""

    kind: ClassVar[str] = "accuracy"
    count: int = 0
    correct: int = 0
    num_classes: int | None = None

    def update(self, probs: torch.Tensor, labels: torch.Tensor) -> "Accuracy":
        p, y = check_probs(probs, labels, num_classes=self.num_classes)
        return self._add(p, y)

    def _add(self, p: torch.Tensor, y: torch.Tensor) -> "Accuracy":
        _, ok = _conf_correct(p, y)
        return Accuracy(self.count + p.shape[0], self.correct + int(ok.sum()), p.shape[1])

    def merge(self, other: "Accuracy") -> "Accuracy":
        return Accuracy(self.count + other.count, self.correct + other.correct,
                        _merge_classes(self.num_classes, other.num_classes))

    def compute(self) -> dict[str, float]:
        self._require_nonempty(self.count)
        return {"accuracy": self.correct / self.count}


@dataclass(frozen=True, eq=False)
class NLL(_Accumulator):
    """Mean negative log-likelihood ``mean(-log max(p_y, NLL_EPS))``."""

    kind: ClassVar[str] = "nll"
    count: int = 0
    total: float = 0.0
    num_classes: int | None = None

    def update(self, probs: torch.Tensor, labels: torch.Tensor) -> "NLL":
        p, y = check_probs(probs, labels, num_classes=self.num_classes)
        return self._add(p, y)

    def _add(self, p: torch.Tensor, y: torch.Tensor) -> "NLL":
        py = p.gather(1, y[:, None])[:, 0].clamp_min(NLL_EPS)
        return NLL(self.count + p.shape[0], self.total + float(-torch.log(py).sum()), p.shape[1])

    def merge(self, other: "NLL") -> "NLL":
        return NLL(self.count + other.count, self.total + other.total,
                   _merge_classes(self.num_classes, other.num_classes))

    def compute(self) -> dict[str, float]:
        self._require_nonempty(self.count)
        return {"nll": self.total / self.count}


@dataclass(frozen=True, eq=False)
class Brier(_Accumulator):
    """Brier score ``mean_i sum_c (p_ic - 1[c = y_i])^2`` (sum over classes, mean over examples)."""

    kind: ClassVar[str] = "brier"
    count: int = 0
    total: float = 0.0
    num_classes: int | None = None

    def update(self, probs: torch.Tensor, labels: torch.Tensor) -> "Brier":
        p, y = check_probs(probs, labels, num_classes=self.num_classes)
        return self._add(p, y)

    def _add(self, p: torch.Tensor, y: torch.Tensor) -> "Brier":
        d = p.clone()
        d[torch.arange(p.shape[0]), y] -= 1.0
        return Brier(self.count + p.shape[0], self.total + float((d * d).sum()), p.shape[1])

    def merge(self, other: "Brier") -> "Brier":
        return Brier(self.count + other.count, self.total + other.total,
                     _merge_classes(self.num_classes, other.num_classes))

    def compute(self) -> dict[str, float]:
        self._require_nonempty(self.count)
        return {"brier": self.total / self.count}


# --------------------------------------------------------------------------- calibration
@dataclass(frozen=True, eq=False)
class Calibration(_Accumulator):
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
        _check_nbins(self.n_bins, "n_bins")
        _check_nbins(self.fine_bins, "fine_bins")
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
        return self._add(p, y)

    def _add(self, p: torch.Tensor, y: torch.Tensor) -> "Calibration":
        conf, ok = _conf_correct(p, y)
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
            _same(what, getattr(self, what), getattr(other, what))
        return dataclasses.replace(
            self,
            num_classes=_merge_classes(self.num_classes, other.num_classes),
            counts=self.counts + other.counts,
            conf_sums=self.conf_sums + other.conf_sums,
            correct=self.correct + other.correct,
        )

    def _groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[float, float] | None]]:
        """Per final bin: counts, conf sums, correct counts and ``(lo, hi)`` edges."""
        if self.strategy == "equal_width":
            e = _edges(self.n_bins).tolist()
            return self.counts, self.conf_sums, self.correct, [(e[i], e[i + 1]) for i in range(self.n_bins)]
        N = self.count
        before = torch.cumsum(self.counts, 0) - self.counts  # rank of each fine bin's first example
        group = torch.div(before * self.n_bins, N, rounding_mode="floor").clamp(max=self.n_bins - 1)
        nonempty = self.counts > 0
        g = group[nonempty]
        cnt = torch.zeros(self.n_bins, dtype=torch.int64).index_add_(0, g, self.counts[nonempty])
        cs = torch.zeros(self.n_bins, dtype=torch.float64).index_add_(0, g, self.conf_sums[nonempty])
        cor = torch.zeros(self.n_bins, dtype=torch.int64).index_add_(0, g, self.correct[nonempty])
        fine = _edges(self.fine_bins).tolist()
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
        self._require_nonempty(N)
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
class Entropy(_Accumulator):
    """Normalised predictive entropy ``H(p)/log C``: mean and a fixed-edge histogram
    (``n_bins`` right-closed bins on ``[0, 1]``, see :func:`bin_index`)."""

    kind: ClassVar[str] = "entropy"
    n_bins: int = ENTROPY_BINS
    count: int = 0
    total: float = 0.0
    num_classes: int | None = None
    hist: torch.Tensor | None = None

    def __post_init__(self) -> None:
        _check_nbins(self.n_bins, "n_bins")
        if self.hist is None:
            object.__setattr__(self, "hist", torch.zeros(self.n_bins, dtype=torch.int64))
        elif tuple(self.hist.shape) != (self.n_bins,) or self.hist.dtype != torch.int64:
            raise ValueError(f"hist must be an int64 tensor of shape ({self.n_bins},)")

    def update(self, probs: torch.Tensor, labels: torch.Tensor | None = None) -> "Entropy":
        p, _ = check_probs(probs, labels, num_classes=self.num_classes)
        return self._add(p)

    def _add(self, p: torch.Tensor) -> "Entropy":
        h = normalized_entropy(p)
        return dataclasses.replace(
            self,
            count=self.count + p.shape[0],
            total=self.total + float(h.sum()),
            num_classes=p.shape[1],
            hist=self.hist + torch.bincount(bin_index(h, self.n_bins), minlength=self.n_bins),
        )

    def merge(self, other: "Entropy") -> "Entropy":
        _same("n_bins", self.n_bins, other.n_bins)
        return dataclasses.replace(
            self,
            count=self.count + other.count,
            total=self.total + other.total,
            num_classes=_merge_classes(self.num_classes, other.num_classes),
            hist=self.hist + other.hist,
        )

    def compute(self) -> dict[str, Any]:
        self._require_nonempty(self.count)
        return {"entropy_mean": self.total / self.count, "entropy_hist": _hist_json(self.n_bins, self.hist)}


# --------------------------------------------------------------------------- OOD detection
def _ranking_metrics(neg: torch.Tensor, pos: torch.Tensor, tpr_level: float = 0.95) -> dict[str, float]:
    """AUROC, AUPR (average precision), FPR at ``tpr_level`` TPR from per-score counts.

    ``neg[k]``/``pos[k]`` = number of negatives/positives whose score is the ``k``-th
    smallest distinct value (or lies in the ``k``-th histogram bin; a bin then acts
    as one tied score). Positives should score higher.
    """
    keep = (neg + pos) > 0
    neg, pos = neg[keep].to(torch.float64), pos[keep].to(torch.float64)
    P, N = float(pos.sum()), float(neg.sum())
    neg_below = torch.cumsum(neg, 0) - neg
    auroc = float((pos * (neg_below + 0.5 * neg)).sum()) / (P * N)
    tp, fp = torch.cumsum(pos.flip(0), 0), torch.cumsum(neg.flip(0), 0)  # thresholds high -> low
    recall = tp / tp[-1]
    precision = tp / (tp + fp)
    aupr = float((torch.diff(recall, prepend=recall.new_zeros(1)) * precision).sum())
    k = int(torch.nonzero(recall >= tpr_level)[0, 0])
    return {"auroc": auroc, "aupr": aupr, "fpr_at_95_tpr": float(fp[k] / fp[-1])}


@dataclass(frozen=True, eq=False)
class OODDetection(_Accumulator):
    """Separating an OOD set from the in-distribution set by normalised entropy.

    Keeps ``fine_bins``-bin histograms (right-closed, on ``[0, 1]``) of the scores of
    both sets. *Histogram mode*: each fine bin acts as one tied score, so the metrics
    are exact for scores quantised to the bins and otherwise differ from the exact
    ones only through pairs/ties inside one bin of width ``1/fine_bins`` (in tests:
    within ``1e-3`` at 10,000 bins). *Exact mode*: while the total number of scores
    (in + out) is ``<= exact_limit`` the raw float64 scores are kept too and the
    metrics are computed from them exactly (ties as in scikit-learn). The rule depends
    only on the total count, so merged shards choose the same mode as the whole set.
    ``exact_limit = 0`` (default) keeps histograms only (small JSON).

    ``update(probs, ood=...)`` adds a batch to the in-distribution (``ood=False``) or
    the OOD set; ``update_scores`` adds precomputed scores in ``[0, 1]``.
    """

    kind: ClassVar[str] = "ood"
    fine_bins: int = FINE_BINS
    plot_bins: int = ENTROPY_BINS
    exact_limit: int = 0
    num_classes: int | None = None
    in_hist: torch.Tensor | None = None
    out_hist: torch.Tensor | None = None
    in_scores: torch.Tensor | None = None
    out_scores: torch.Tensor | None = None

    def __post_init__(self) -> None:
        _check_nbins(self.fine_bins, "fine_bins")
        _check_nbins(self.plot_bins, "plot_bins")
        if self.fine_bins % self.plot_bins:
            raise ValueError(f"fine_bins ({self.fine_bins}) must be a multiple of plot_bins ({self.plot_bins})")
        if not isinstance(self.exact_limit, int) or self.exact_limit < 0:
            raise ValueError(f"exact_limit must be an int >= 0, got {self.exact_limit!r}")
        for name in ("in_hist", "out_hist"):
            v = getattr(self, name)
            if v is None:
                object.__setattr__(self, name, torch.zeros(self.fine_bins, dtype=torch.int64))
            elif tuple(v.shape) != (self.fine_bins,) or v.dtype != torch.int64:
                raise ValueError(f"{name} must be an int64 tensor of shape ({self.fine_bins},)")
        keep = self.n_in + self.n_out <= self.exact_limit
        for name in ("in_scores", "out_scores"):
            v = getattr(self, name)
            if not keep:
                object.__setattr__(self, name, None)
            elif v is None:
                if self.n_in + self.n_out > 0:
                    raise ValueError("exact mode needs the raw scores of every accumulated example")
                object.__setattr__(self, name, torch.zeros(0, dtype=torch.float64))
            elif v.dtype != torch.float64 or v.dim() != 1:
                raise ValueError(f"{name} must be a 1-D float64 tensor")

    @property
    def n_in(self) -> int:
        return int(self.in_hist.sum())

    @property
    def n_out(self) -> int:
        return int(self.out_hist.sum())

    @property
    def exact(self) -> bool:
        return self.in_scores is not None

    def update(self, probs: torch.Tensor, *, ood: bool) -> "OODDetection":
        p, _ = check_probs(probs, num_classes=self.num_classes)
        return self._add_scores(normalized_entropy(p), ood=ood, num_classes=p.shape[1])

    def update_scores(self, scores: torch.Tensor, *, ood: bool) -> "OODDetection":
        s = torch.as_tensor(scores).detach().to(device="cpu", dtype=torch.float64)
        if s.dim() != 1:
            raise ValueError(f"scores must be 1-D, got shape {tuple(s.shape)}")
        if s.numel() and not (bool(torch.isfinite(s).all()) and float(s.min()) >= 0.0 and float(s.max()) <= 1.0):
            raise ValueError("scores must be finite and lie in [0, 1] (normalised entropy)")
        return self._add_scores(s, ood=ood, num_classes=self.num_classes)

    def _add_scores(self, s: torch.Tensor, *, ood: bool, num_classes: int | None) -> "OODDetection":
        if not isinstance(ood, bool):
            raise ValueError(f"ood must be True or False, got {ood!r}")
        h = torch.bincount(bin_index(s, self.fine_bins), minlength=self.fine_bins)
        side_h, side_s = ("out_hist", "out_scores") if ood else ("in_hist", "in_scores")
        changes: dict[str, Any] = {"num_classes": num_classes, side_h: getattr(self, side_h) + h}
        if self.exact:
            changes[side_s] = torch.cat([getattr(self, side_s), s])
        return dataclasses.replace(self, **changes)

    def merge(self, other: "OODDetection") -> "OODDetection":
        for what in ("fine_bins", "plot_bins", "exact_limit"):
            _same(what, getattr(self, what), getattr(other, what))
        exact = self.exact and other.exact
        return dataclasses.replace(
            self,
            num_classes=_merge_classes(self.num_classes, other.num_classes),
            in_hist=self.in_hist + other.in_hist,
            out_hist=self.out_hist + other.out_hist,
            in_scores=torch.cat([self.in_scores, other.in_scores]) if exact else None,
            out_scores=torch.cat([self.out_scores, other.out_scores]) if exact else None,
        )

    def _plot_hist(self, fine: torch.Tensor) -> dict[str, list]:
        coarse = fine.reshape(self.plot_bins, -1).sum(dim=1)  # fine edges align with coarse ones
        return _hist_json(self.plot_bins, coarse)

    def compute(self) -> dict[str, Any]:
        """``auroc``, ``aupr``, ``fpr_at_95_tpr``, ``mode`` (``"exact"`` or
        ``"histogram_<fine_bins>"``), counts, and ``plot_bins``-bin histograms
        ``entropy_hist_in`` / ``entropy_hist_out``."""
        n_in, n_out = self.n_in, self.n_out
        if n_in == 0 or n_out == 0:
            raise ValueError(f"ood: needs in-distribution and OOD examples, got {n_in} and {n_out}")
        if self.exact:
            values, inv = torch.unique(torch.cat([self.in_scores, self.out_scores]), sorted=True, return_inverse=True)
            neg = torch.bincount(inv[:n_in], minlength=values.numel())
            pos = torch.bincount(inv[n_in:], minlength=values.numel())
            mode = "exact"
        else:
            neg, pos, mode = self.in_hist, self.out_hist, f"histogram_{self.fine_bins}"
        return {
            "score": "normalized_entropy",
            "positive": "ood",
            "mode": mode,
            "n_in": n_in,
            "n_out": n_out,
            **_ranking_metrics(neg, pos),
            "entropy_hist_in": self._plot_hist(self.in_hist),
            "entropy_hist_out": self._plot_hist(self.out_hist),
        }


# --------------------------------------------------------------------------- suite
@dataclass(frozen=True, eq=False)
class MetricSuite:
    """All metrics with one ``update`` / ``update_ood`` / ``merge`` / ``compute``.

    ``update(probs, labels)`` feeds the in-distribution set (accuracy, NLL, Brier,
    ECE equal width and equal mass, entropy, and the in-distribution side of OOD);
    ``update_ood(probs)`` feeds the OOD set. Build with :meth:`create` to change bin
    counts. ``compute`` returns a flat JSON-able dict; the ECE keys carry the variant
    (``ece_equal_width_15``, ``ece_equal_mass_15``, ``reliability_<variant>``) and
    ``ood`` is present only when OOD examples were added.
    """

    kind: ClassVar[str] = "suite"
    accuracy: Accuracy = field(default_factory=Accuracy)
    nll: NLL = field(default_factory=NLL)
    brier: Brier = field(default_factory=Brier)
    ece: Calibration = field(default_factory=lambda: Calibration("equal_width"))
    ece_mass: Calibration = field(default_factory=lambda: Calibration("equal_mass"))
    entropy: Entropy = field(default_factory=Entropy)
    ood: OODDetection = field(default_factory=OODDetection)

    _PARTS: ClassVar[dict[str, type]] = {
        "accuracy": Accuracy, "nll": NLL, "brier": Brier, "ece": Calibration,
        "ece_mass": Calibration, "entropy": Entropy, "ood": OODDetection,
    }

    @classmethod
    def create(
        cls,
        *,
        num_classes: int | None = None,
        ece_bins: int = DEFAULT_ECE_BINS,
        fine_bins: int = FINE_BINS,
        entropy_bins: int = ENTROPY_BINS,
        ood_exact_limit: int = 0,
    ) -> "MetricSuite":
        return cls(
            accuracy=Accuracy(num_classes=num_classes),
            nll=NLL(num_classes=num_classes),
            brier=Brier(num_classes=num_classes),
            ece=Calibration("equal_width", ece_bins, fine_bins, num_classes),
            ece_mass=Calibration("equal_mass", ece_bins, fine_bins, num_classes),
            entropy=Entropy(entropy_bins, num_classes=num_classes),
            ood=OODDetection(fine_bins, entropy_bins, ood_exact_limit, num_classes),
        )

    @property
    def num_classes(self) -> int | None:
        return _merge_classes(self.accuracy.num_classes, self.ood.num_classes)

    @property
    def count(self) -> int:
        return self.accuracy.count

    def update(self, probs: torch.Tensor, labels: torch.Tensor) -> "MetricSuite":
        p, y = check_probs(probs, labels, num_classes=self.num_classes)
        return MetricSuite(
            accuracy=self.accuracy._add(p, y),
            nll=self.nll._add(p, y),
            brier=self.brier._add(p, y),
            ece=self.ece._add(p, y),
            ece_mass=self.ece_mass._add(p, y),
            entropy=self.entropy._add(p),
            ood=self.ood._add_scores(normalized_entropy(p), ood=False, num_classes=p.shape[1]),
        )

    def update_ood(self, probs: torch.Tensor) -> "MetricSuite":
        p, _ = check_probs(probs, num_classes=self.num_classes)
        return dataclasses.replace(
            self, ood=self.ood._add_scores(normalized_entropy(p), ood=True, num_classes=p.shape[1])
        )

    def merge(self, other: "MetricSuite") -> "MetricSuite":
        return MetricSuite(**{k: getattr(self, k).merge(getattr(other, k)) for k in self._PARTS})

    def compute(self) -> dict[str, Any]:
        if self.count == 0:
            raise ValueError("MetricSuite: no in-distribution examples accumulated; nothing to compute")
        out: dict[str, Any] = {"count": self.count}
        out.update(self.accuracy.compute())
        out.update(self.nll.compute())
        out.update(self.brier.compute())
        for cal in (self.ece, self.ece_mass):
            c = cal.compute()
            out[c["name"]] = c["ece"]
            out["m" + c["name"]] = c["mce"]
            out["reliability_" + c["name"][len("ece_"):]] = c["bins"]
        out.update(self.entropy.compute())
        if self.ood.n_out > 0:
            out["ood"] = self.ood.compute()
        out["conventions"] = {
            "prediction": "argmax (ties -> lowest index); confidence = max prob",
            "nll": f"mean of -log(max(p_y, {NLL_EPS:g}))",
            "brier": "mean over examples of sum over classes of (p - onehot)^2, range [0, 2]",
            "ece_bins": "right-closed (lo, hi], confidence 0 in the first bin; float64 edges i/n_bins",
            "ece_equal_mass": f"groups of fine bins ({self.ece_mass.fine_bins}) by rank of the first example",
            "entropy": "H(p)/log C, 0 log 0 = 0",
            "ood": "score = normalised entropy, OOD positive; FPR at first threshold with TPR >= 0.95",
        }
        return out

    def to_json(self) -> dict[str, Any]:
        return {"format": _JSON_FORMAT, "version": 1, "kind": self.kind,
                **{k: getattr(self, k).to_json() for k in self._PARTS}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "MetricSuite":
        if d.get("format") != _JSON_FORMAT or d.get("kind") != cls.kind:
            raise ValueError("not a MetricSuite JSON (format/kind tags missing)")
        return cls(**{k: t.from_json(d[k]) for k, t in cls._PARTS.items()})
