"""Selective prediction: abstain on the least confident inputs (Geifman & El-Yaniv 2017).

Sort the test images by confidence ``max_c p_c``, high to low; at each distinct confidence
``t_j`` keep the images with confidence ``>= t_j``: coverage ``c_j`` (their share) and risk
``r_j`` (their error rate). Ties share a threshold (no arbitrary order inside a tie).

* risk–coverage curve: the points ``(c_j, r_j)``;
* AURC = ``Σ_j (c_j − c_{j−1}) r_j`` (``c_0 = 0``): without ties this is
  ``(1/n) Σ_k risk(top k)``, the usual definition; lower is better;
* accuracy at coverage ``q``: ``1 − r_j`` at the first threshold with ``c_j >= q``.

Every function takes optional per-image ``weights`` (bootstrap resampling counts); all in float64.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["RankedConfidence", "risk_coverage", "aurc", "accuracy_at_coverage", "selective_summary"]

_COVERAGE_EPS = 1e-12


class RankedConfidence:
    """The thresholds of one set of confidences, computed once; :meth:`curve` per weighting."""

    def __init__(self, conf: torch.Tensor, correct: torch.Tensor):
        c = torch.as_tensor(conf, dtype=torch.float64)
        values, inv = torch.unique(-c, sorted=True, return_inverse=True)  # high confidence first
        self.inv, self.groups = inv, values.numel()
        self.correct = torch.as_tensor(correct, dtype=torch.float64)

    def curve(self, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(coverage [J], risk [J])`` over the thresholds that hold any weight."""
        w = torch.ones_like(self.correct) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
        n_g = torch.bincount(self.inv, weights=w, minlength=self.groups)
        c_g = torch.bincount(self.inv, weights=w * self.correct, minlength=self.groups)
        keep = n_g > 0
        cum_n, cum_c = torch.cumsum(n_g[keep], 0), torch.cumsum(c_g[keep], 0)
        return cum_n / cum_n[-1], 1.0 - cum_c / cum_n

    def aurc(self, weights: torch.Tensor | None = None) -> float:
        cov, risk = self.curve(weights)
        return float((torch.diff(cov, prepend=cov.new_zeros(1)) * risk).sum())

    def accuracy_at(self, level: float, weights: torch.Tensor | None = None) -> float:
        cov, risk = self.curve(weights)
        j = int(torch.nonzero(cov >= level - _COVERAGE_EPS)[0, 0])
        return float(1.0 - risk[j])


def risk_coverage(conf: torch.Tensor, correct: torch.Tensor, weights: torch.Tensor | None = None):
    """``(coverage, risk)`` of the module docstring."""
    return RankedConfidence(conf, correct).curve(weights)


def aurc(conf: torch.Tensor, correct: torch.Tensor, weights: torch.Tensor | None = None) -> float:
    """Area under the risk–coverage curve (module docstring)."""
    return RankedConfidence(conf, correct).aurc(weights)


def accuracy_at_coverage(conf: torch.Tensor, correct: torch.Tensor, level: float,
                         weights: torch.Tensor | None = None) -> float:
    """Accuracy of the most confident share ``level`` of the images (module docstring)."""
    return RankedConfidence(conf, correct).accuracy_at(level, weights)


def selective_summary(conf: torch.Tensor, correct: torch.Tensor, max_points: int = 200) -> dict[str, Any]:
    """``aurc``, ``acc_at_90``, ``acc_at_95`` and the curve (at most ``max_points`` points, the
    last one at full coverage) for the report."""
    r = RankedConfidence(conf, correct)
    cov, risk = r.curve()
    idx = torch.unique(torch.linspace(0, cov.numel() - 1, min(max_points, cov.numel())).round().long())
    return {"aurc": r.aurc(), "acc_at_90": r.accuracy_at(0.90), "acc_at_95": r.accuracy_at(0.95),
            "curve": {"coverage": cov[idx].tolist(), "risk": risk[idx].tolist()},
            "convention": "confidence = max probability; ties share a threshold; lower AURC is better"}
