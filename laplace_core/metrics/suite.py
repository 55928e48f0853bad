"""All evaluation metrics of one method in one mergeable accumulator (:class:`MetricSuite`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch

from .base import DEFAULT_ECE_BINS, ENTROPY_BINS, FINE_BINS, JSON_FORMAT, NLL_EPS, check_probs, merge_classes, normalized_entropy
from .calibration import Calibration, Entropy
from .ood import OODDetection
from .scores import NLL, Accuracy, Brier

__all__ = ["MetricSuite"]


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
        return merge_classes(self.accuracy.num_classes, self.ood.num_classes)

    @property
    def count(self) -> int:
        return self.accuracy.count

    def update(self, probs: torch.Tensor, labels: torch.Tensor,
               log_probs: torch.Tensor | None = None) -> "MetricSuite":
        """``log_probs`` (``[B, C]``, natural log, optional): the NLL is then the exact
        ``-log p_y`` from them; without, ``-log max(p_y, NLL_EPS)`` from ``probs``."""
        p, y = check_probs(probs, labels, num_classes=self.num_classes)
        if log_probs is None:
            nll = self.nll.add_checked(p, y)
        else:
            lp = log_probs.detach().to(device="cpu", dtype=torch.float64)
            nll = self.nll.add_log(lp.gather(1, y[:, None])[:, 0], p.shape[1])
        return MetricSuite(
            accuracy=self.accuracy.add_checked(p, y),
            nll=nll,
            brier=self.brier.add_checked(p, y),
            ece=self.ece.add_checked(p, y),
            ece_mass=self.ece_mass.add_checked(p, y),
            entropy=self.entropy.add_checked(p),
            ood=self.ood.add_scores(normalized_entropy(p), ood=False, num_classes=p.shape[1]),
        )

    def update_ood(self, probs: torch.Tensor) -> "MetricSuite":
        p, _ = check_probs(probs, num_classes=self.num_classes)
        return dataclasses.replace(
            self, ood=self.ood.add_scores(normalized_entropy(p), ood=True, num_classes=p.shape[1])
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
            "nll": f"mean of -log p_y: exact from log-probabilities (log-softmax; log-mean-exp over MC draws) "
                   f"where the predictor gives them, else -log(max(p_y, {NLL_EPS:g})) from probabilities",
            "brier": "mean over examples of sum over classes of (p - onehot)^2, range [0, 2]",
            "ece_bins": "right-closed (lo, hi], confidence 0 in the first bin; float64 edges i/n_bins",
            "ece_equal_mass": f"groups of fine bins ({self.ece_mass.fine_bins}) by rank of the first example",
            "entropy": "H(p)/log C, 0 log 0 = 0",
            "ood": "score = normalised entropy, OOD positive; FPR at first threshold with TPR >= 0.95",
        }
        return out

    def to_json(self) -> dict[str, Any]:
        return {"format": JSON_FORMAT, "version": 1, "kind": self.kind,
                **{k: getattr(self, k).to_json() for k in self._PARTS}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "MetricSuite":
        if d.get("format") != JSON_FORMAT or d.get("kind") != cls.kind:
            raise ValueError("not a MetricSuite JSON (format/kind tags missing)")
        return cls(**{k: t.from_json(d[k]) for k, t in cls._PARTS.items()})
