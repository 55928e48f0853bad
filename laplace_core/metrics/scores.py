"""Accuracy, NLL and Brier: means over examples, each a
:class:`~laplace_core.metrics.base.MeanAccumulator` that defines only its per-example
term (conventions in :mod:`laplace_core.metrics.base`):

* accuracy: ``1[argmax_c p_c = y]`` (ties -> lowest class index);
* NLL: ``-log max(p_y, NLL_EPS)`` from probabilities, exact ``-log p_y`` from log-probabilities;
* Brier: ``Σ_c (p_c - 1[c = y])²`` (range ``[0, 2]``, not divided by ``C`` or 2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import NLL_EPS, MeanAccumulator, conf_correct

__all__ = ["Accuracy", "FloatMean", "NLL", "Brier"]


@dataclass(frozen=True, eq=False)
class Accuracy(MeanAccumulator):
    """Top-1 accuracy: ``correct / count``."""

    kind: ClassVar[str] = "accuracy"
    sum_field: ClassVar[str] = "correct"
    sum_type: ClassVar[type] = int
    count: int = 0
    correct: int = 0
    num_classes: int | None = None

    def terms(self, p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return conf_correct(p, y)[1]


@dataclass(frozen=True, eq=False)
class FloatMean(MeanAccumulator):
    """A :class:`~laplace_core.metrics.base.MeanAccumulator` whose sum is a float ``total``."""

    count: int = 0
    total: float = 0.0
    num_classes: int | None = None


class NLL(FloatMean):
    """Mean negative log-likelihood: from probabilities ``mean(-log max(p_y, NLL_EPS))``
    (:meth:`update`), exactly from log-probabilities with :meth:`add_log` (no floor)."""

    kind: ClassVar[str] = "nll"

    def add_log(self, logp_true: torch.Tensor, num_classes: int) -> "NLL":
        """Add ``-log p_y`` given as log-probabilities ``[B]`` of the true classes (exact)."""
        lp = logp_true.detach().to(device="cpu", dtype=torch.float64)
        return self._with(self.count + lp.shape[0], self.total - float(lp.sum()), num_classes)

    def terms(self, p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -torch.log(p.gather(1, y[:, None])[:, 0].clamp_min(NLL_EPS))


class Brier(FloatMean):
    """Brier score ``mean_i sum_c (p_ic - 1[c = y_i])^2`` (sum over classes, mean over examples)."""

    kind: ClassVar[str] = "brier"

    def terms(self, p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        d = p.clone()
        d[torch.arange(p.shape[0]), y] -= 1.0
        return (d * d).sum(dim=1)
