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
from typing import Any, Mapping, Sequence

import torch

from .base import bin_index
from .ood import ranking_metrics
from .oodsets import OOD_SCORES, OODSets, set_summary
from .perimage import PerImage

__all__ = ["BOOT_METRICS", "LEVEL", "RankedScores", "canonical", "ood_summary", "weighted_metrics", "bootstrap", "bootstrap_means"]

LEVEL = 0.95
BOOT_METRICS = ("accuracy", "nll", "brier", "ece", "aurc", "acc_at_90", "acc_at_95",
                "ood_auroc", "ood_fpr95", "ood_aupr")


class RankedScores:
    """In-distribution (negative) and OOD (positive) scores, distinct values found once."""

    def __init__(self, s_in: torch.Tensor, s_out: torch.Tensor):
        values, inv = torch.unique(torch.cat([s_in, s_out]).to(torch.float64), sorted=True, return_inverse=True)
        self.inv_in, self.inv_out, self.u = inv[: s_in.numel()], inv[s_in.numel():], values.numel()

    def metrics(self, w_in: torch.Tensor | None = None, w_out: torch.Tensor | None = None) -> dict[str, float]:
        neg = torch.bincount(self.inv_in, weights=w_in, minlength=self.u).to(torch.float64)
        pos = torch.bincount(self.inv_out, weights=w_out, minlength=self.u).to(torch.float64)
        return ranking_metrics(neg, pos)

    def rows(self, W_in: torch.Tensor, W_out: torch.Tensor) -> dict[str, torch.Tensor]:
        """:meth:`metrics` for every row of the weights ``[B, n_in]`` / ``[B, n_out]``."""
        neg = W_in.new_zeros(W_in.shape[0], self.u).index_add_(1, self.inv_in, W_in)
        pos = W_in.new_zeros(W_in.shape[0], self.u).index_add_(1, self.inv_out, W_out)
        return _ranking_rows(neg, pos)


def ood_summary(per: PerImage, ood_sets: Sequence[tuple[str, str | None]] | None = None) -> dict[str, Any]:
    """Exact OOD metrics per score (entropy, max probability, mutual information where kept) over
    all OOD images; with ``ood_sets`` also per set and group (``"per_set"``:
    :func:`laplace_core.metrics.oodsets.set_summary`)."""
    out: dict[str, Any] = {"positive": "ood", "n_in": per.n, "n_out": per.n_ood}
    for name, (f, sign) in OOD_SCORES.items():
        if f in per.inp and f in per.out:
            out[name] = RankedScores(sign * per.inp[f], sign * per.out[f]).metrics()
    if ood_sets:
        out["per_set"] = set_summary(per, ood_sets)
    return out


def _ranking_rows(neg: torch.Tensor, pos: torch.Tensor, tpr_level: float = 0.95) -> dict[str, torch.Tensor]:
    """:func:`laplace_core.metrics.ood.ranking_metrics` for every row of ``neg`` / ``pos``
    ``[B, U]`` (weights per distinct score, ascending); zero-weight scores change nothing."""
    P, N = pos.sum(1), neg.sum(1)
    neg_below = torch.cumsum(neg, 1) - neg
    auroc = (pos * (neg_below + 0.5 * neg)).sum(1) / (P * N)
    tp, fp = torch.cumsum(pos.flip(1), 1), torch.cumsum(neg.flip(1), 1)  # thresholds high -> low
    recall = tp / P[:, None]
    precision = torch.where(tp + fp > 0, tp / (tp + fp).clamp_min(1e-300), torch.zeros_like(tp))
    aupr = (torch.diff(recall, dim=1, prepend=recall.new_zeros(recall.shape[0], 1)) * precision).sum(1)
    k = torch.argmax((recall >= tpr_level).to(torch.int8), dim=1)
    return {"auroc": auroc, "aupr": aupr, "fpr_at_95_tpr": fp.gather(1, k[:, None])[:, 0] / N}


class _Method:
    """One method's per-image vectors, prepared for weighted metrics of many resamples at once
    (``W`` ``[B, n]``: one row of per-image counts per resample)."""

    def __init__(self, per: PerImage, ece_bins: int, ece_mode: str, ood_sets: Any = None):
        d = per.inp
        self.correct, self.nll, self.brier, self.conf = d["correct"], -d["logp"], d["brier"], d["conf"]
        self.gap = self.conf - self.correct
        self.ece_bins, self.ece_mode = ece_bins, ece_mode
        self.bins = bin_index(self.conf, ece_bins)
        self.order = torch.argsort(self.conf, stable=True)
        values, self.inv = torch.unique(-self.conf, sorted=True, return_inverse=True)  # high confidence first
        self.groups = values.numel()
        self.ood = RankedScores(d["entropy"], per.out["entropy"]) if per.n_ood and "entropy" in d else None
        self.sets = OODSets(per, ood_sets) if ood_sets and per.n_ood else None

    def ece(self, W: torch.Tensor) -> torch.Tensor:
        total = W.sum(1)
        if self.ece_mode == "equal_mass":
            ws = W[:, self.order]
            rank = torch.cumsum(ws, 1) - ws
            groups = torch.clamp((rank * self.ece_bins / total[:, None]).floor().long(), max=self.ece_bins - 1)
            sums = W.new_zeros(W.shape[0], self.ece_bins).scatter_add_(1, groups, ws * self.gap[self.order])
        else:
            sums = W.new_zeros(W.shape[0], self.ece_bins).index_add_(1, self.bins, W * self.gap)
        return sums.abs().sum(1) / total

    def selective(self, W: torch.Tensor) -> dict[str, torch.Tensor]:
        """AURC and the accuracy at 90% / 95% coverage per row (:mod:`laplace_core.metrics.selective`)."""
        n_g = W.new_zeros(W.shape[0], self.groups).index_add_(1, self.inv, W)
        c_g = W.new_zeros(W.shape[0], self.groups).index_add_(1, self.inv, W * self.correct)
        cum_n, cum_c = torch.cumsum(n_g, 1), torch.cumsum(c_g, 1)
        cov = cum_n / cum_n[:, -1:]
        risk = torch.where(cum_n > 0, 1.0 - cum_c / cum_n.clamp_min(1e-300), torch.zeros_like(cum_n))
        out = {"aurc": (torch.diff(cov, dim=1, prepend=cov.new_zeros(cov.shape[0], 1)) * risk).sum(1)}
        for q, key in ((0.90, "acc_at_90"), (0.95, "acc_at_95")):
            j = torch.argmax((cov >= q - 1e-12).to(torch.int8), dim=1)
            out[key] = 1.0 - risk.gather(1, j[:, None])[:, 0]
        return out

    def metrics(self, W: torch.Tensor, W_out: torch.Tensor | None) -> dict[str, torch.Tensor]:
        n = W.sum(1)
        out = {"accuracy": W @ self.correct / n, "nll": W @ self.nll / n, "brier": W @ self.brier / n,
               "ece": self.ece(W), **self.selective(W)}
        if self.ood is not None:
            r = self.ood.rows(W, W_out)
            out.update(ood_auroc=r["auroc"], ood_fpr95=r["fpr_at_95_tpr"], ood_aupr=r["aupr"])
        if self.sets is not None:
            out.update(self.sets.rows(W, W_out))
        return out


def weighted_metrics(per: PerImage, w: torch.Tensor | None = None, w_out: torch.Tensor | None = None,
                     ece_bins: int = 15, ece_mode: str = "equal_width") -> dict[str, float]:
    """:data:`BOOT_METRICS` of one method under per-image weights (None: every image once)."""
    w = torch.ones(per.n, dtype=torch.float64) if w is None else w
    w_out = torch.ones(per.n_ood, dtype=torch.float64) if w_out is None and per.n_ood else w_out
    got = _Method(per, ece_bins, ece_mode).metrics(w[None], None if w_out is None else w_out[None])
    return {k: float(v[0]) for k, v in got.items()}


def _counts(n: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    """``[rows, n]`` per-image counts of ``rows`` resamples of ``n`` images with replacement."""
    idx = torch.randint(n, (rows, n), generator=gen)
    return torch.zeros(rows, n, dtype=torch.float64).scatter_add_(1, idx, torch.ones(rows, n, dtype=torch.float64))


def _ood_counts(n_ood: int, strata: OODSets | None, rows: int, gen: torch.Generator) -> torch.Tensor | None:
    """``[rows, n_ood]`` OOD counts: one resample of all OOD images, or of each set on its own."""
    if not n_ood:
        return None
    if strata is None:
        return _counts(n_ood, rows, gen)
    W = torch.zeros(rows, n_ood, dtype=torch.float64)
    for idx in strata.index:
        if idx.numel():
            W[:, idx] = _counts(idx.numel(), rows, gen)
    return W


def _blocks(resamples: int, width: int) -> list[int]:
    """Resamples per block: ``[B, width]`` float64 blocks of about 16 MB."""
    per = max(1, min(resamples, 2_000_000 // max(width, 1)))
    return [min(per, resamples - i) for i in range(0, resamples, per)]


def _interval(values: torch.Tensor, level: float) -> list[float]:
    a = (1.0 - level) / 2
    q = torch.quantile(values, torch.tensor([a, 1.0 - a], dtype=torch.float64))
    return [float(q[0]), float(q[1])]


def _paired(vals: Mapping[str, Mapping[str, torch.Tensor]], point: Mapping[str, Mapping[str, float]], m: str,
            refs: tuple[str, ...], level: float, prefix: str = "") -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for ref in refs:
        if ref == m or ref not in vals:
            continue
        out[ref] = {}
        for k in vals[m]:
            if k not in vals[ref]:
                continue
            lo, hi = _interval(vals[m][k] - vals[ref][k], level)
            diff = point[m][k] - point[ref][k]
            out[ref][prefix + k] = {"diff": diff, "lo": lo, "hi": hi,
                                    "significant": bool(lo > 0 or hi < 0) and math.isfinite(diff)}
    return out


def canonical(per_method: Mapping[str, PerImage]) -> dict[str, PerImage]:
    """Every method's vectors in one order that does not depend on how the actors split the
    images (a lexicographic sort on all methods' per-image values, which are the same whatever
    the sharding), the same permutation for every method (pairing kept): the resamples then pick
    the same images for any number of actors."""
    import numpy as np

    names = sorted(per_method)
    out = {m: per_method[m] for m in names}
    for side in ("inp", "out"):
        keys = [getattr(per_method[m], side)[f].numpy() for m in reversed(names)
                for f in ("mi", "entropy", "conf", "logp", "correct") if f in getattr(per_method[m], side)]
        if side == "out" and keys and "set" in per_method[names[0]].out:  # the set first: contiguous sets
            keys.append(per_method[names[0]].out["set"].numpy())
        if not keys or not keys[0].size:
            continue
        order = torch.from_numpy(np.lexsort(keys))
        out = {m: PerImage(*((({k: v[order] for k, v in d.items()}) if sd == side else d)
                             for sd, d in (("inp", p.inp), ("out", p.out))), p.exact_nll) for m, p in out.items()}
    return {m: out[m] for m in per_method}


def bootstrap(per_method: Mapping[str, PerImage], resamples: int = 1000, seed: int = 0,
              refs: tuple[str, ...] = ("map", "temperature"), *, ece_bins: int = 15,
              ece_mode: str = "equal_width", level: float = LEVEL,
              ood_sets: Sequence[tuple[str, str | None]] | None = None) -> dict[str, dict[str, Any]]:
    """Per method: ``{"n", "n_ood", "resamples", "seed", "level", "point", "ci": {metric: [lo, hi]},
    "paired": {ref: {metric: {"diff", "lo", "hi", "significant"}}}}`` for every ``ref`` in ``refs``
    that is among the methods (not against itself). All methods must hold the same images.
    ``ood_sets``: ``(name, group)`` of the OOD sets (``PerImage.out["set"]`` indices): each set is
    resampled on its own (its size kept) and every set's and group's metrics of every score get
    intervals too (keys :func:`laplace_core.metrics.oodsets.metric_key`)."""
    if not isinstance(resamples, int) or isinstance(resamples, bool) or resamples < 2:
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
    per_method = canonical(per_method)
    prepared = {m: _Method(per_method[m], ece_bins, ece_mode, ood_sets) for m in names}
    strata = next(iter(prepared.values())).sets
    ones_out = torch.ones(1, n_ood, dtype=torch.float64) if n_ood else None
    point = {m: {k: float(v[0]) for k, v in p.metrics(torch.ones(1, n, dtype=torch.float64), ones_out).items()}
             for m, p in prepared.items()}
    gen = torch.Generator().manual_seed(int(seed))
    parts: dict[str, dict[str, list[torch.Tensor]]] = {m: {k: [] for k in point[m]} for m in names}
    for rows in _blocks(resamples, n + n_ood):
        W = _counts(n, rows, gen)
        W_out = _ood_counts(n_ood, strata, rows, gen)
        for m, p in prepared.items():
            for k, v in p.metrics(W, W_out).items():
                parts[m][k].append(v)
    vals = {m: {k: torch.cat(v) for k, v in d.items()} for m, d in parts.items()}
    return {m: {"n": n, "n_ood": n_ood, "resamples": resamples, "seed": int(seed), "level": level,
                "point": point[m], "ci": {k: _interval(v, level) for k, v in vals[m].items()},
                "paired": _paired(vals, point, m, refs, level)} for m in names}


def bootstrap_means(cells: list[Mapping[str, PerImage]], resamples: int = 1000, seed: int = 0,
                    refs: tuple[str, ...] = ("map", "temperature"), keys: tuple[str, ...] = ("accuracy", "nll", "ece"),
                    *, ece_bins: int = 15, ece_mode: str = "equal_width", level: float = LEVEL,
                    prefix: str = "shift_") -> dict[str, dict[str, Any]]:
    """Intervals of the unweighted mean over ``cells`` (e.g. corruption x severity) of ``keys``,
    paired across methods inside each cell. Each cell is resampled on its own (its images are
    aligned across methods, not across cells), so the interval treats the cells as independent
    samples. Returns ``method -> {"point", "ci": {prefix + key: [lo, hi]}, "paired": {ref:
    {prefix + key: {"diff", "lo", "hi", "significant"}}}}`` for the methods present in every cell."""
    names = [m for m in (cells[0] if cells else {}) if all(m in c and c[m].n for c in cells)]
    if not names:
        return {}
    prep = [{m: _Method(p, ece_bins, ece_mode) for m, p in canonical({m: c[m] for m in names}).items()}
            for c in cells]
    ns = [c[names[0]].correct.numel() for c in prep]

    def means(ws: list[torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {m: {} for m in names}
        for c, W in zip(prep, ws):
            for m, p in c.items():
                tot = W.sum(1)
                vals = {"accuracy": lambda: W @ p.correct / tot, "nll": lambda: W @ p.nll / tot,
                        "brier": lambda: W @ p.brier / tot, "ece": lambda: p.ece(W)}
                for k in keys:
                    out[m][k] = out[m].get(k, 0.0) + vals[k]() / len(prep)
        return out

    point = {m: {k: float(v[0]) for k, v in d.items()}
             for m, d in means([torch.ones(1, n, dtype=torch.float64) for n in ns]).items()}
    gen = torch.Generator().manual_seed(int(seed))
    parts: dict[str, dict[str, list[torch.Tensor]]] = {m: {k: [] for k in keys} for m in names}
    for rows in _blocks(resamples, sum(ns)):
        for m, d in means([_counts(n, rows, gen) for n in ns]).items():
            for k, v in d.items():
                parts[m][k].append(v)
    vals = {m: {k: torch.cat(v) for k, v in d.items()} for m, d in parts.items()}
    return {m: {"point": {prefix + k: point[m][k] for k in keys},
                "ci": {prefix + k: _interval(vals[m][k], level) for k in keys},
                "paired": _paired(vals, point, m, refs, level, prefix)} for m in names}
