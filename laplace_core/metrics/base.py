"""Foundations of the mergeable evaluation metrics: conventions, input checks, binning, base classes.

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

Conventions (named in :meth:`laplace_core.metrics.suite.MetricSuite.compute`'s output under ``"conventions"``):

* prediction = ``argmax_c p_c`` (ties -> lowest class index); confidence = ``max_c p_c``.
* NLL = mean over examples of ``-log max(p_y, NLL_EPS)``, ``NLL_EPS = 1e-12``.
* Brier = mean over examples of ``sum_c (p_c - 1[c = y])^2`` (range ``[0, 2]``; the
  multi-class convention of Brier 1950, *not* divided by ``C`` or by 2).
* ECE = ``sum_b (n_b / N) |conf_b - acc_b|`` over bins of the confidence. Bins are
  right-closed ``(lo, hi]``; the first bin also holds confidence exactly ``0``.
  Equal width: ``n_bins`` bins with float64 edges ``i / n_bins``; a confidence that
  equals an edge (as a float64 number) goes to the bin *below* it, e.g. ``1/15``
  lies in bin 0 and ``1.0`` in the last bin. Equal mass: see :class:`laplace_core.metrics.calibration.Calibration`.
* Normalised predictive entropy ``H(p) / log C`` with ``0 log 0 = 0``, clamped to
  ``[0, 1]`` (rounding can give ``1 + 1e-16`` for a uniform ``p``).
* OOD detection: score = normalised entropy, OOD is the positive class, a higher
  score means "more OOD". AUROC counts ties as 1/2, AUPR is average precision
  ``sum_k (R_k - R_{k-1}) P_k`` over distinct thresholds (scikit-learn's
  ``average_precision_score``), FPR@95TPR is the FPR at the first threshold (from
  high to low scores) whose TPR is ``>= 0.95`` (scikit-learn's ``roc_curve``).
"""
from __future__ import annotations

import math
from dataclasses import fields
from typing import Any, ClassVar, Mapping

import torch

from ..names import DEFAULT_ECE_BINS, ECE_STRATEGIES, ENTROPY_BINS

__all__ = [
    "NLL_EPS",
    "PROB_SUM_TOL",
    "DEFAULT_ECE_BINS",
    "FINE_BINS",
    "ENTROPY_BINS",
    "ECE_STRATEGIES",
    "JSON_FORMAT",
    "check_probs",
    "check_nbins",
    "check_same",
    "merge_classes",
    "normalized_entropy",
    "bin_edges",
    "bin_index",
    "conf_correct",
    "hist_json",
    "MetricAccumulator",
    "MeanAccumulator",
]

NLL_EPS = 1e-12
"""``-log p_y`` is computed as ``-log max(p_y, NLL_EPS)`` (a zero probability gives ~27.6, not inf)."""
PROB_SUM_TOL = 1e-4
"""Rows of ``probs`` must sum to 1 within this absolute tolerance; entries must lie in ``[0, 1 + tol]``."""
FINE_BINS = 10_000
"""Fine fixed-edge histogram on ``[0, 1]`` behind equal-mass ECE and histogram-mode OOD metrics."""

JSON_FORMAT = "infoform.metrics"
"""``format`` tag of every accumulator's JSON."""


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


def merge_classes(a: int | None, b: int | None) -> int | None:
    """The class count of a merge of accumulators for ``a`` and ``b`` classes (``None``: not yet seen)."""
    if a is not None and b is not None and a != b:
        raise ValueError(f"cannot merge accumulators for {a} and {b} classes")
    return a if a is not None else b


def check_same(what: str, a: Any, b: Any) -> None:
    """One-line error when two accumulators to merge differ in ``what``."""
    if a != b:
        raise ValueError(f"cannot merge accumulators with different {what}: {a!r} vs {b!r}")


def check_nbins(n: int, what: str) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{what} must be a positive int, got {n!r}")


# --------------------------------------------------------------------------- binning / entropy
def bin_edges(n_bins: int) -> torch.Tensor:
    """float64 edges ``i / n_bins``, ``i = 0..n_bins`` (each correctly rounded)."""
    return torch.arange(n_bins + 1, dtype=torch.float64) / n_bins


def bin_index(values: torch.Tensor, n_bins: int) -> torch.Tensor:
    """Index of the right-closed bin ``(i/n, (i+1)/n]`` holding each value of ``[0, 1]``.

    A value equal to an interior edge ``i/n`` (float64) goes to bin ``i - 1``; ``0``
    goes to bin 0, ``1`` to bin ``n - 1``. Values are clamped to ``[0, 1]`` first.
    """
    v = values.to(torch.float64).clamp(0.0, 1.0)
    return torch.bucketize(v, bin_edges(n_bins)[1:-1], right=False)


def normalized_entropy(probs: torch.Tensor) -> torch.Tensor:
    """``H(p) / log C = -sum_c p_c log p_c / log C`` per row of ``probs [B, C]`` -> ``[B]``,
    with ``0 log 0 = 0``, clamped to ``[0, 1]``. No input checks (see :func:`check_probs`)."""
    C = probs.shape[-1]
    h = -torch.special.xlogy(probs, probs).sum(dim=-1)
    return (h / math.log(C)).clamp(0.0, 1.0)


def conf_correct(p: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Confidence ``max_c p_c`` and whether the prediction ``argmax_c p_c`` equals ``y``."""
    conf, pred = p.max(dim=1)
    return conf, (pred == y)


def hist_json(n_bins: int, counts: torch.Tensor) -> dict[str, list]:
    """A fixed-edge histogram as JSON: ``{"edges", "counts"}``."""
    return {"edges": bin_edges(n_bins).tolist(), "counts": [int(c) for c in counts.tolist()]}



# --------------------------------------------------------------------------- base classes
class MetricAccumulator:
    """Shared JSON round trip: scalars as JSON numbers, tensors as ``{"dtype", "data"}``."""

    kind: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": JSON_FORMAT, "version": 1, "kind": self.kind}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = {"dtype": str(v.dtype).removeprefix("torch."), "data": v.tolist()}
            out[f.name] = v
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]):
        if d.get("format") != JSON_FORMAT or d.get("kind") != cls.kind:
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

    def require_nonempty(self, count: int) -> None:
        if count == 0:
            raise ValueError(f"{self.kind}: no examples accumulated; nothing to compute")


class MeanAccumulator(MetricAccumulator):
    """A mean over examples as a mergeable sum: ``value = Σ_i term(p_i, y_i) / count``.

    Subclasses are frozen dataclasses with the fields ``count``, the sum (named by
    ``sum_field``, of Python type ``sum_type``) and ``num_classes``, and define only
    :meth:`terms`, the per-example terms of a checked batch. ``update`` adds a batch,
    ``merge`` adds two accumulators of the same kind, ``compute`` returns
    ``{kind: sum / count}``.
    """

    sum_field: ClassVar[str] = "total"
    sum_type: ClassVar[type] = float

    def terms(self, p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per-example terms ``[B]`` of float64 probabilities ``p [B, C]`` and labels ``y [B]``."""
        raise NotImplementedError

    @property
    def sum(self) -> float | int:
        return getattr(self, self.sum_field)

    def _with(self, count: int, total: float | int, num_classes: int | None):
        return type(self)(**{"count": count, self.sum_field: total, "num_classes": num_classes})

    def update(self, probs: torch.Tensor, labels: torch.Tensor):
        p, y = check_probs(probs, labels, num_classes=self.num_classes)
        return self.add_checked(p, y)

    def add_checked(self, p: torch.Tensor, y: torch.Tensor):
        """``update`` for a batch already validated by :func:`check_probs`."""
        return self._with(self.count + p.shape[0], self.sum + self.sum_type(self.terms(p, y).sum()), p.shape[1])

    def merge(self, other: "MeanAccumulator"):
        if type(other) is not type(self):
            raise ValueError(f"cannot merge a {self.kind} accumulator with {type(other).__name__}")
        return self._with(self.count + other.count, self.sum + other.sum,
                          merge_classes(self.num_classes, other.num_classes))

    def compute(self) -> dict[str, float]:
        self.require_nonempty(self.count)
        return {self.kind: self.sum / self.count}
