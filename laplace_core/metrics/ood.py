"""OOD detection by normalised predictive entropy: AUROC, AUPR and FPR at 95% TPR from
mergeable score histograms (or the exact scores while few). Conventions in
:mod:`laplace_core.metrics.base`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .base import (
    ENTROPY_BINS,
    FINE_BINS,
    MetricAccumulator,
    bin_index,
    check_nbins,
    check_probs,
    check_same,
    hist_json,
    merge_classes,
    normalized_entropy,
)

__all__ = ["OODDetection", "ranking_metrics"]


def ranking_metrics(neg: torch.Tensor, pos: torch.Tensor, tpr_level: float = 0.95) -> dict[str, float]:
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
class OODDetection(MetricAccumulator):
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
        check_nbins(self.fine_bins, "fine_bins")
        check_nbins(self.plot_bins, "plot_bins")
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
        return self.add_scores(normalized_entropy(p), ood=ood, num_classes=p.shape[1])

    def update_scores(self, scores: torch.Tensor, *, ood: bool) -> "OODDetection":
        s = torch.as_tensor(scores).detach().to(device="cpu", dtype=torch.float64)
        if s.dim() != 1:
            raise ValueError(f"scores must be 1-D, got shape {tuple(s.shape)}")
        if s.numel() and not (bool(torch.isfinite(s).all()) and float(s.min()) >= 0.0 and float(s.max()) <= 1.0):
            raise ValueError("scores must be finite and lie in [0, 1] (normalised entropy)")
        return self.add_scores(s, ood=ood, num_classes=self.num_classes)

    def add_scores(self, s: torch.Tensor, *, ood: bool, num_classes: int | None) -> "OODDetection":
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
            check_same(what, getattr(self, what), getattr(other, what))
        exact = self.exact and other.exact
        return dataclasses.replace(
            self,
            num_classes=merge_classes(self.num_classes, other.num_classes),
            in_hist=self.in_hist + other.in_hist,
            out_hist=self.out_hist + other.out_hist,
            in_scores=torch.cat([self.in_scores, other.in_scores]) if exact else None,
            out_scores=torch.cat([self.out_scores, other.out_scores]) if exact else None,
        )

    def _plot_hist(self, fine: torch.Tensor) -> dict[str, list]:
        coarse = fine.reshape(self.plot_bins, -1).sum(dim=1)  # fine edges align with coarse ones
        return hist_json(self.plot_bins, coarse)

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
            **ranking_metrics(neg, pos),
            "entropy_hist_in": self._plot_hist(self.in_hist),
            "entropy_hist_out": self._plot_hist(self.out_hist),
        }

