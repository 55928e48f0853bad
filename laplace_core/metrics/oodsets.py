"""Several named OOD sets scored as OpenOOD v1.5 reports them (Zhang et al. 2023, ``openood/evaluation_api``):
per set and per group (the unweighted mean over the group's sets, e.g. ``near`` / ``far``), for each
score (normalised entropy, max probability, mutual information), four metrics:

* ``auroc``: area under the ROC curve (the same whichever class is positive);
* ``fpr95``: the fraction of **OOD** images accepted as in-distribution at the threshold that keeps
  95% of the **in-distribution** images (ID positive, TPR on ID = 95%, FPR on OOD; OpenOOD's
  ``fpr_recall``; the first ROC point with TPR >= 0.95, ties as scikit-learn's ``roc_curve``);
* ``aupr_in``: average precision with **ID positive** (ranked by the ID-ness of the score);
* ``aupr_out``: average precision with **OOD positive**.

The AUPRs are scikit-learn's ``average_precision_score`` (step-wise); OpenOOD integrates its
PR curve with the trapezoidal rule (``metrics.auc``), which differs slightly on small sets.
Every score is oriented "higher = more OOD" (max probability negated). Images of set ``k`` carry
``PerImage.out["set"] == k``; without that field all OOD images are one set.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from .perimage import PerImage

__all__ = ["OOD_SCORES", "SCORE_PREFIX", "OPENOOD_METRICS", "CONVENTION", "openood_rows", "openood_metrics",
           "set_indices", "OODSets", "set_summary", "metric_key"]

#: OOD scores (higher = more OOD): name -> per-image field and sign.
OOD_SCORES = {"entropy": ("entropy", 1.0), "max_prob": ("conf", -1.0), "mutual_information": ("mi", 1.0)}
#: the bootstrap key prefix of each score (entropy, the headline score, has none)
SCORE_PREFIX = {"entropy": "", "max_prob": "maxp_", "mutual_information": "mi_"}
OPENOOD_METRICS = ("auroc", "fpr95", "aupr_in", "aupr_out")
CONVENTION = {"auroc": "either class positive (symmetric)",
              "fpr95": "FPR on OOD at 95% TPR on ID (ID positive), as OpenOOD",
              "aupr_in": "average precision, ID positive", "aupr_out": "average precision, OOD positive",
              "scores": "higher = more OOD (max probability negated)",
              "group": "unweighted mean over the group's sets"}


def metric_key(metric: str, where: str, score: str = "entropy") -> str:
    """The bootstrap / history key of ``metric`` of ``score`` on a set or group, e.g.
    ``ood_auroc@letters`` (entropy), ``ood_maxp_fpr95@far``."""
    return f"ood_{SCORE_PREFIX[score]}{metric}@{where}"


def openood_rows(neg: torch.Tensor, pos: torch.Tensor, tpr_level: float = 0.95) -> dict[str, torch.Tensor]:
    """:data:`OPENOOD_METRICS` for every row of ``neg`` (ID) / ``pos`` (OOD) ``[B, U]``: weights per
    distinct score, ascending (higher = more OOD); zero-weight scores change nothing."""
    neg, pos = neg.to(torch.float64), pos.to(torch.float64)
    P, N = pos.sum(1), neg.sum(1)
    auroc = (pos * (torch.cumsum(neg, 1) - 0.5 * neg)).sum(1) / (P * N)
    out_tp, out_fp = torch.cumsum(pos.flip(1), 1), torch.cumsum(neg.flip(1), 1)  # OOD positive, high -> low
    in_tp, in_fp = torch.cumsum(neg, 1), torch.cumsum(pos, 1)  # ID positive: low OOD score first
    in_recall = in_tp / N[:, None]
    k = torch.argmax((in_recall >= tpr_level).to(torch.int8), dim=1)
    return {"auroc": auroc, "fpr95": in_fp.gather(1, k[:, None])[:, 0] / P,
            "aupr_in": _ap(in_tp, in_fp, N), "aupr_out": _ap(out_tp, out_fp, P)}


def _ap(tp: torch.Tensor, fp: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    recall = tp / total[:, None]
    precision = torch.where(tp + fp > 0, tp / (tp + fp).clamp_min(1e-300), torch.zeros_like(tp))
    return (torch.diff(recall, dim=1, prepend=recall.new_zeros(recall.shape[0], 1)) * precision).sum(1)


class _Ranked:
    """ID and OOD scores of one set, distinct values found once (as ``RankedScores``)."""

    def __init__(self, s_in: torch.Tensor, s_out: torch.Tensor):
        values, inv = torch.unique(torch.cat([s_in, s_out]).to(torch.float64), sorted=True, return_inverse=True)
        self.inv_in, self.inv_out, self.u = inv[: s_in.numel()], inv[s_in.numel():], values.numel()

    def rows(self, W_in: torch.Tensor, W_out: torch.Tensor) -> dict[str, torch.Tensor]:
        neg = W_in.new_zeros(W_in.shape[0], self.u).index_add_(1, self.inv_in, W_in)
        pos = W_in.new_zeros(W_in.shape[0], self.u).index_add_(1, self.inv_out, W_out)
        return openood_rows(neg, pos)


def openood_metrics(s_in: torch.Tensor, s_out: torch.Tensor) -> dict[str, float]:
    """:data:`OPENOOD_METRICS` of ID scores ``s_in`` and OOD scores ``s_out`` (higher = more OOD)."""
    r = _Ranked(s_in, s_out).rows(torch.ones(1, s_in.numel(), dtype=torch.float64),
                                  torch.ones(1, s_out.numel(), dtype=torch.float64))
    return {k: float(v[0]) for k, v in r.items()}


def set_indices(per: PerImage, n_sets: int) -> list[torch.Tensor]:
    """The positions in ``per.out`` of each set's images (all of them for one set without ``set``)."""
    if "set" not in per.out:
        if n_sets != 1:
            raise ValueError(f"{n_sets} OOD sets named but the per-image OOD terms carry no set index")
        return [torch.arange(per.n_ood)]
    s = per.out["set"]
    return [torch.nonzero(s == k)[:, 0] for k in range(n_sets)]


class OODSets:
    """The per-set, per-score ranked scores of one method, for many resamples at once.
    ``sets``: ``(name, group or None)`` in set-index order."""

    def __init__(self, per: PerImage, sets: Sequence[tuple[str, str | None]]):
        self.sets = [(str(n), g) for n, g in sets]
        self.index = set_indices(per, len(self.sets))
        self.ranked: dict[tuple[int, str], _Ranked] = {}
        for k, idx in enumerate(self.index):
            for score, (f, sign) in OOD_SCORES.items():
                if f in per.inp and f in per.out and idx.numel():
                    self.ranked[(k, score)] = _Ranked(sign * per.inp[f], sign * per.out[f][idx])

    def groups(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for k, (_, g) in enumerate(self.sets):
            if g:
                out.setdefault(g, []).append(k)
        return out

    def rows(self, W: torch.Tensor, W_out: torch.Tensor) -> dict[str, torch.Tensor]:
        """``metric_key -> [B]`` for every set and group (W_out: ``[B, n_ood]`` in ``per.out`` order)."""
        per_set: dict[tuple[int, str], dict[str, torch.Tensor]] = {
            (k, s): r.rows(W, W_out[:, self.index[k]]) for (k, s), r in self.ranked.items()}
        out = {metric_key(m, self.sets[k][0], s): v for (k, s), d in per_set.items() for m, v in d.items()}
        for g, ks in self.groups().items():
            for score in OOD_SCORES:
                if all((k, score) in per_set for k in ks):
                    for m in OPENOOD_METRICS:
                        out[metric_key(m, g, score)] = sum(per_set[(k, score)][m] for k in ks) / len(ks)
        return out


def set_summary(per: PerImage, sets: Sequence[tuple[str, str | None]]) -> dict[str, Any]:
    """Exact per-set and per-group metrics: ``{"convention", "sets": {name: {"group", "n_out",
    score: {metric: value}}}, "groups": {group: {"sets": [...], score: {metric: mean}}}}``."""
    o = OODSets(per, sets)
    got = {k: float(v[0]) for k, v in o.rows(torch.ones(1, per.n, dtype=torch.float64),
                                              torch.ones(1, per.n_ood, dtype=torch.float64)).items()}

    def block(where: str) -> dict[str, Any]:
        return {s: {m: got[metric_key(m, where, s)] for m in OPENOOD_METRICS}
                for s in OOD_SCORES if metric_key("auroc", where, s) in got}

    out: dict[str, Any] = {"convention": dict(CONVENTION), "n_in": per.n, "sets": {}, "groups": {}}
    for k, (name, group) in enumerate(o.sets):
        out["sets"][name] = {"group": group, "n_out": int(o.index[k].numel()), **block(name)}
    for g, ks in o.groups().items():
        out["groups"][g] = {"sets": [o.sets[k][0] for k in ks], **block(g)}
    return out


def sets_of(d: Mapping[str, Any]) -> list[tuple[str, str | None]]:
    """The ``(name, group)`` list of a :func:`set_summary` (in its order)."""
    return [(n, v.get("group")) for n, v in (d.get("sets") or {}).items()]
