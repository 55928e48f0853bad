"""Per-image quantities of one method, kept in image order for paired bootstrap intervals.

The mergeable sums of :class:`~laplace_core.metrics.suite.MetricSuite` give the point values;
intervals and paired differences need the per-image terms (the same test images under every
method). :class:`PerImage` keeps a few float64 scalars per image, concatenated shard by shard
(merge = concatenation, in the driver's fixed actor order, so every method's vectors are in the
same image order):

* in-distribution: ``correct`` (0/1), ``logp`` (``log p̄_y``, exact from log-probabilities
  where the predictor gives them), ``brier``, ``conf`` (max probability), ``entropy``
  (normalised), and for MC / GLM predictives ``mi`` (mutual information in nats,
  ``H(p̄) − E_t H(p_t)``);
* OOD: ``entropy``, ``conf`` and ``mi``, and ``set`` (the index of the image's OOD set, when several
  are named: :mod:`laplace_core.metrics.oodsets`).

Memory: 6 numbers per image and method (ImageNet's 50,000 test images: 2.4 MB per method).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .base import normalized_entropy

__all__ = ["IN_FIELDS", "OUT_FIELDS", "per_image_terms", "PerImage"]

IN_FIELDS = ("correct", "logp", "brier", "conf", "entropy", "mi")
OUT_FIELDS = ("entropy", "conf", "mi", "set")


def per_image_terms(log_probs: torch.Tensor, labels: torch.Tensor | None = None,
                    expected_entropy: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The per-image fields of ``log_probs`` ``[B, C]`` (natural log; float64 on the CPU),
    ``labels`` ``[B]`` (None for the OOD set) and ``expected_entropy`` ``[B]`` (the draws'
    mean entropy in nats, None for a single prediction)."""
    lp = log_probs.detach().to(device="cpu", dtype=torch.float64)
    p = torch.exp(lp)
    conf, pred = p.max(dim=1)
    out = {"conf": conf, "entropy": normalized_entropy(p)}
    if expected_entropy is not None:
        h = -torch.special.xlogy(p, p).sum(dim=1)
        out["mi"] = (h - expected_entropy.detach().to(device="cpu", dtype=torch.float64)).clamp_min(0.0)
    if labels is not None:
        y = labels.detach().to(device="cpu", dtype=torch.int64)
        d = p.clone()
        d[torch.arange(p.shape[0]), y] -= 1.0
        out.update(correct=(pred == y).to(torch.float64), logp=lp.gather(1, y[:, None])[:, 0],
                   brier=(d * d).sum(dim=1))
    return out


def _cat(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names: tuple[str, ...],
         n_a: int, n_b: int) -> dict[str, torch.Tensor]:
    """Concatenate two field dicts; a field missing on a non-empty side is dropped."""
    out = {}
    for k in names:
        if (k in a or n_a == 0) and (k in b or n_b == 0) and (k in a or k in b):
            parts = [d[k] for d in (a, b) if k in d]
            out[k] = torch.cat(parts) if len(parts) > 1 else parts[0]
    return out


@dataclass(frozen=True, eq=False)
class PerImage:
    """Per-image vectors of the in-distribution (``inp``) and OOD (``out``) sets (module docstring).
    ``exact_nll``: every ``logp`` came from log-probabilities (False: from probabilities)."""

    inp: dict[str, torch.Tensor] = field(default_factory=dict)
    out: dict[str, torch.Tensor] = field(default_factory=dict)
    exact_nll: bool = True

    @property
    def n(self) -> int:
        return int(self.inp["correct"].numel()) if "correct" in self.inp else 0

    @property
    def n_ood(self) -> int:
        return int(self.out["conf"].numel()) if "conf" in self.out else 0

    def add(self, terms: Mapping[str, torch.Tensor], *, ood: bool, exact_nll: bool = True) -> "PerImage":
        new = dict(terms)
        n_new = int(new["conf"].numel())
        if ood:
            return PerImage(self.inp, _cat(self.out, new, OUT_FIELDS, self.n_ood, n_new), self.exact_nll)
        return PerImage(_cat(self.inp, new, IN_FIELDS, self.n, n_new), self.out, self.exact_nll and exact_nll)

    def merge(self, other: "PerImage") -> "PerImage":
        return PerImage(_cat(self.inp, other.inp, IN_FIELDS, self.n, other.n),
                        _cat(self.out, other.out, OUT_FIELDS, self.n_ood, other.n_ood),
                        self.exact_nll and other.exact_nll)

    def to_json(self) -> dict[str, Any]:
        return {"inp": {k: v.tolist() for k, v in self.inp.items()},
                "out": {k: v.tolist() for k, v in self.out.items()}, "exact_nll": self.exact_nll}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "PerImage":
        def tens(m: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            return {k: torch.tensor([math.nan if x is None else x for x in v], dtype=torch.float64)
                    for k, v in m.items()}

        return cls(tens(d.get("inp", {})), tens(d.get("out", {})), bool(d.get("exact_nll", True)))
