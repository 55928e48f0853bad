"""Intervals on every headline metric and paired differences between methods, by a seeded
bootstrap over test images (Efron & Tibshirani 1993, percentile intervals).

One resample draws ``n`` in-distribution images with replacement (and, independently, ``n_ood``
OOD images); a resample is a vector of per-image counts ``w``, and every metric is computed as
a ``w``-weighted metric of the per-image quantities (:class:`~laplace_core.metrics.perimage.PerImage`).
The **same** resample is applied to every method, so the difference ``metric_m(w) − metric_ref(w)``
is a paired difference over the same images; its 2.5% and 97.5% quantiles over the resamples
are the 95% paired interval. A difference is *significant* when that interval excludes 0
(two methods that predict the same on every image have the interval ``[0, 0]``: never
significant).

Metrics (:data:`BOOT_METRICS`): accuracy, NLL, Brier, ECE (equal width; equal mass groups
by weighted rank, ties not kept together), AURC and the accuracy at 90% / 95% coverage
(:mod:`laplace_core.metrics.selective`), and the OOD AUROC / FPR at 95% TPR / AUPR of the
normalised predictive entropy (OOD positive; ties as scikit-learn,
:func:`laplace_core.metrics.ood.ranking_metrics`).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from .base import bin_index
from .ood import ranking_metrics
from .perimage import PerImage
from .selective import RankedConfidence

__all__ = ["BOOT_METRICS", "LEVEL", "RankedScores", "ood_summary", "weighted_metrics", "bootstrap", "bootstrap_means"]

LEVEL = 0.95
BOOT_METRICS = ("accuracy", "nll", "brier", "ece", "aurc", "acc_at_90", "acc_at_95",
                "ood_auroc", "ood_fpr95", "ood_aupr")
#: OOD scores (higher = more OOD): name -> per-image field and sign.
OOD_SCORES = {"entropy": ("entropy", 1.0), "max_prob": ("conf", -1.0), "mutual_information": ("mi", 1.0)}


class RankedScores:
    """In-distribution (negative) and OOD (positive) scores, distinct values found once."""

    def __init__(self, s_in: torch.Tensor, s_out: torch.Tensor):
        values, inv = torch.unique(torch.cat([s_in, s_out]).to(torch.float64), sorted=True, return_inverse=True)
        self.inv_in, self.inv_out, self.u = inv[: s_in.numel()], inv[s_in.numel():], values.numel()

    def metrics(self, w_in: torch.Tensor | None = None, w_out: torch.Tensor | None = None) -> dict[str, float]:
        neg = torch.bincount(self.inv_in, weights=w_in, minlength=self.u).to(torch.float64)
        pos = torch.bincount(self.inv_out, weights=w_out, minlength=self.u).to(torch.float64)
        return ranking_metrics(neg, pos)


def ood_summary(per: PerImage) -> dict[str, Any]:
    """Exact OOD metrics per score (entropy, max probability, mutual information where kept)."""
    out: dict[str, Any] = {"positive": "ood", "n_in": per.n, "n_out": per.n_ood}
    for name, (f, sign) in OOD_SCORES.items():
        if f in per.inp and f in per.out:
            out[name] = RankedScores(sign * per.inp[f], sign * per.out[f]).metrics()
    return out


class _Method:
    """One method's per-image vectors, prepared for weighted metrics."""

    def __init__(self, per: PerImage, ece_bins: int, ece_mode: str):
        d = per.inp
        self.correct, self.nll, self.brier, self.conf = d["correct"], -d["logp"], d["brier"], d["conf"]
        self.ece_bins, self.ece_mode = ece_bins, ece_mode
        self.bins = bin_index(self.conf, ece_bins)
        self.order = torch.argsort(self.conf, stable=True)
        self.ranked = RankedConfidence(self.conf, self.correct)
        self.ood = RankedScores(d["entropy"], per.out["entropy"]) if per.n_ood and "entropy" in d else None

    def ece(self, w: torch.Tensor) -> float:
        if self.ece_mode == "equal_mass":
            ws = w[self.order]
            rank = torch.cumsum(ws, 0) - ws
            groups = torch.clamp((rank * self.ece_bins / ws.sum()).floor().long(), max=self.ece_bins - 1)
            conf, corr = self.conf[self.order], self.correct[self.order]
        else:
            groups, ws, conf, corr = self.bins, w, self.conf, self.correct
        gap = (torch.bincount(groups, weights=ws * conf, minlength=self.ece_bins)
               - torch.bincount(groups, weights=ws * corr, minlength=self.ece_bins))
        return float(gap.abs().sum() / ws.sum())

    def metrics(self, w: torch.Tensor, w_out: torch.Tensor | None) -> dict[str, float]:
        n = float(w.sum())
        out = {"accuracy": float((w * self.correct).sum()) / n, "nll": float((w * self.nll).sum()) / n,
               "brier": float((w * self.brier).sum()) / n, "ece": self.ece(w), "aurc": self.ranked.aurc(w),
               "acc_at_90": self.ranked.accuracy_at(0.90, w), "acc_at_95": self.ranked.accuracy_at(0.95, w)}
        if self.ood is not None:
            r = self.ood.metrics(w, w_out)
            out.update(ood_auroc=r["auroc"], ood_fpr95=r["fpr_at_95_tpr"], ood_aupr=r["aupr"])
        return out


def weighted_metrics(per: PerImage, w: torch.Tensor | None = None, w_out: torch.Tensor | None = None,
                     ece_bins: int = 15, ece_mode: str = "equal_width") -> dict[str, float]:
    """:data:`BOOT_METRICS` of one method under per-image weights (None: every image once)."""
    w = torch.ones(per.n, dtype=torch.float64) if w is None else w
    w_out = torch.ones(per.n_ood, dtype=torch.float64) if w_out is None and per.n_ood else w_out
    return _Method(per, ece_bins, ece_mode).metrics(w, w_out)


def _counts(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.bincount(torch.randint(n, (n,), generator=gen), minlength=n).to(torch.float64)


def _interval(values: torch.Tensor, level: float) -> list[float]:
    a = (1.0 - level) / 2
    q = torch.quantile(values, torch.tensor([a, 1.0 - a], dtype=torch.float64))
    return [float(q[0]), float(q[1])]


def bootstrap(per_method: Mapping[str, PerImage], resamples: int = 1000, seed: int = 0,
              refs: tuple[str, ...] = ("map", "temperature"), *, ece_bins: int = 15,
              ece_mode: str = "equal_width", level: float = LEVEL) -> dict[str, dict[str, Any]]:
    """Per method: ``{"n", "n_ood", "resamples", "seed", "level", "point", "ci": {metric: [lo, hi]},
    "paired": {ref: {metric: {"diff", "lo", "hi", "significant"}}}}`` for every ``ref`` in ``refs``
    that is among the methods (not against itself). All methods must hold the same images."""
    if not isinstance(resamples, int) or resamples < 2:
        raise ValueError(f"bootstrap resamples must be an int >= 2, got {resamples!r}")
    names = list(per_method)
    if not names:
        return {}
    ns = {(p.n, p.n_ood) for p in per_method.values()}
    if len(ns) != 1:
        raise ValueError(f"paired bootstrap needs the same images for every method, got (n, n_ood) {sorted(ns)}")
    n, n_ood = ns.pop()
    if n == 0:
        raise ValueError("bootstrap: no per-image quantities kept")
    prepared = {m: _Method(per_method[m], ece_bins, ece_mode) for m in names}
    ones_out = torch.ones(n_ood, dtype=torch.float64) if n_ood else None
    point = {m: p.metrics(torch.ones(n, dtype=torch.float64), ones_out) for m, p in prepared.items()}
    gen = torch.Generator().manual_seed(int(seed))
    draws: dict[str, dict[str, list[float]]] = {m: {k: [] for k in point[m]} for m in names}
    for _ in range(resamples):
        w = _counts(n, gen)
        w_out = _counts(n_ood, gen) if n_ood else None
        for m, p in prepared.items():
            for k, v in p.metrics(w, w_out).items():
                draws[m][k].append(v)
    vals = {m: {k: torch.tensor(v, dtype=torch.float64) for k, v in d.items()} for m, d in draws.items()}
    out: dict[str, dict[str, Any]] = {}
    for m in names:
        res: dict[str, Any] = {"n": n, "n_ood": n_ood, "resamples": resamples, "seed": int(seed), "level": level,
                               "point": point[m], "ci": {k: _interval(v, level) for k, v in vals[m].items()},
                               "paired": {}}
        for ref in refs:
            if ref == m or ref not in vals:
                continue
            res["paired"][ref] = {}
            for k in vals[m]:
                if k not in vals[ref]:
                    continue
                lo, hi = _interval(vals[m][k] - vals[ref][k], level)
                diff = point[m][k] - point[ref][k]
                res["paired"][ref][k] = {"diff": diff, "lo": lo, "hi": hi,
                                         "significant": bool(lo > 0 or hi < 0) and math.isfinite(diff)}
        out[m] = res
    return out


def bootstrap_means(cells: list[Mapping[str, PerImage]], resamples: int = 1000, seed: int = 0,
                    refs: tuple[str, ...] = ("map", "temperature"), keys: tuple[str, ...] = ("accuracy", "nll", "ece"),
                    *, ece_bins: int = 15, ece_mode: str = "equal_width", level: float = LEVEL,
                    prefix: str = "shift_") -> dict[str, dict[str, Any]]:
    """Intervals of the unweighted mean over ``cells`` (e.g. corruption x severity) of ``keys``,
    paired across methods inside each cell. Each cell is resampled on its own (its images are
    aligned across methods, not across cells), so the interval treats the cells as independent
    samples. Returns ``method -> {"ci": {prefix + key: [lo, hi]}, "paired": {ref: {prefix + key:
    {"diff", "lo", "hi", "significant"}}}}`` for the methods present in every cell."""
    names = [m for m in (cells[0] if cells else {}) if all(m in c and c[m].n for c in cells)]
    if not names:
        return {}
    prep = [{m: _Method(c[m], ece_bins, ece_mode) for m in names} for c in cells]
    ns = [next(iter(c.values())).correct.numel() for c in prep]

    def means(ws: list[torch.Tensor]) -> dict[str, dict[str, float]]:
        out = {m: {k: 0.0 for k in keys} for m in names}
        for c, w in zip(prep, ws):
            for m, p in c.items():
                n = float(w.sum())
                vals = {"accuracy": float((w * p.correct).sum()) / n, "nll": float((w * p.nll).sum()) / n,
                        "brier": float((w * p.brier).sum()) / n}
                for k in keys:
                    out[m][k] += (vals[k] if k in vals else p.ece(w)) / len(prep)
        return out

    point = means([torch.ones(n, dtype=torch.float64) for n in ns])
    gen = torch.Generator().manual_seed(int(seed))
    draws = [means([_counts(n, gen) for n in ns]) for _ in range(resamples)]
    vals = {m: {k: torch.tensor([d[m][k] for d in draws], dtype=torch.float64) for k in keys} for m in names}
    res: dict[str, dict[str, Any]] = {}
    for m in names:
        paired = {}
        for ref in refs:
            if ref == m or ref not in vals:
                continue
            paired[ref] = {}
            for k in keys:
                lo, hi = _interval(vals[m][k] - vals[ref][k], level)
                paired[ref][prefix + k] = {"diff": point[m][k] - point[ref][k], "lo": lo, "hi": hi,
                                           "significant": bool(lo > 0 or hi < 0)}
        res[m] = {"point": {prefix + k: point[m][k] for k in keys},
                  "ci": {prefix + k: _interval(vals[m][k], level) for k in keys}, "paired": paired}
    return res
