"""The shift sweep's summaries as the ImageNet-C literature reads them: per corruption family
(noise, blur, weather, digital; :data:`pipelines.config.choices.CORRUPTION_FAMILIES`) and over
all the ImageNet-C corruptions run.

For a group of corruptions ``G`` (those of the family that the sweep ran) and the sweep's
severities ``S``:

* ``accuracy``, ``nll``, ``ece``, ``brier``: the unweighted mean over ``G x S`` of the cell's
  metric (uncertainty-baselines' ImageNet-C NLL / accuracy / ECE are this mean over the 15 x 5);
* ``ce_vs_map``: the corruption error relative to this run's MAP, Hendrycks & Dietterich's
  ``CE_c = Σ_s E_{c,s} / Σ_s E^{ref}_{c,s}`` with the reference model's error ``E^{ref}`` taken
  to be MAP's (not AlexNet's), averaged over ``G``: MAP's is 1 by construction, below 1 is
  fewer errors than MAP under the group's corruptions. It is *not* ImageNet-C's mCE (normalised
  by AlexNet's published errors) and is not comparable with published mCE figures.

* ``mce_alexnet`` (in ``all`` only, and only when the sweep is complete and the model has 1,000
  classes, i.e. ImageNet-1K): ImageNet-C's mCE in percent, ``100 · mean_c (1 − mean_s acc_{c,s}) /
  E^{AlexNet}_c`` with AlexNet's published per-corruption errors (:data:`ALEXNET_ERR`). Comparable
  with uncertainty-baselines' ImageNet-C table only when the test split is ImageNet-1K's
  validation set decoded as here (resize 256, centre crop 224) — the run cannot check that.

``complete`` says whether the group holds every ImageNet-C corruption of the family (for
``all``: all 15) at severities 1..5; only then is the mean the one the literature reports. A
group with a failed cell (for the method or for MAP) has ``None`` for the affected numbers.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from pipelines.config.choices import CORRUPTION_FAMILIES, IMAGENET_C_NAMES, SEVERITIES

__all__ = ["SUMMARY_METRICS", "ALEXNET_ERR", "shift_summary"]

SUMMARY_METRICS = ("accuracy", "nll", "ece", "brier")

#: AlexNet's top-1 error on ImageNet-C per corruption, the mean over severities 1..5
#: (Hendrycks & Dietterich 2019; the values of hendrycks/robustness as used by
#: google-research/augmix's ``imagenet.py`` ``ALEXNET_ERR`` for its mCE), the mCE's normaliser.
ALEXNET_ERR: dict[str, float] = dict(zip(IMAGENET_C_NAMES, (
    0.886428, 0.894468, 0.922640, 0.819880, 0.826268, 0.785948, 0.798360,
    0.866816, 0.826572, 0.819324, 0.564592, 0.853204, 0.646056, 0.717840,
    0.606500,
)))

Metrics = Mapping[str, Mapping[str, Mapping[str, Any]]]


def _cells(metrics: Metrics, names: Sequence[str], severities: Sequence[int]) -> list[Mapping[str, Any]] | None:
    rows = [(metrics.get(c) or {}).get(str(s)) for c in names for s in severities]
    if any(r is None or r.get("status", "ok") != "ok" for r in rows):
        return None
    return rows


def _relative_ce(metrics: Metrics, map_metrics: Metrics, c: str, severities: Sequence[int]) -> float | None:
    mine, ref = _cells(metrics, [c], severities), _cells(map_metrics, [c], severities)
    if mine is None or ref is None:
        return None
    ref_err = sum(1.0 - float(r["accuracy"]) for r in ref)
    return None if ref_err <= 0 else sum(1.0 - float(r["accuracy"]) for r in mine) / ref_err


def _group(metrics: Metrics, map_metrics: Metrics, names: list[str], severities: Sequence[int],
           complete: bool) -> dict[str, Any]:
    rows = _cells(metrics, names, severities)
    out: dict[str, Any] = {"corruptions": names, "complete": complete}
    for k in SUMMARY_METRICS:
        out[k] = None if rows is None else sum(float(r[k]) for r in rows) / len(rows)
    ces = [_relative_ce(metrics, map_metrics, c, severities) for c in names]
    out["ce_vs_map"] = None if any(v is None for v in ces) else sum(ces) / len(ces)
    return out


def _mce_alexnet(metrics: Metrics, severities: Sequence[int]) -> float | None:
    errs = []
    for c in IMAGENET_C_NAMES:
        rows = _cells(metrics, [c], severities)
        if rows is None:
            return None
        errs.append((1.0 - sum(float(r["accuracy"]) for r in rows) / len(rows)) / ALEXNET_ERR[c])
    return 100.0 * sum(errs) / len(errs)


def shift_summary(metrics: Metrics, map_metrics: Metrics, severities: Sequence[int],
                  imagenet_1k: bool = False) -> dict[str, dict[str, Any]]:
    """``{family: summary, ..., "all": summary}`` (module docstring) of one method's
    ``metrics[corruption][severity]``, against MAP's ``map_metrics``; families the sweep did not
    touch are left out, and so are corruptions outside ImageNet-C's 15 (gaussian_blur).
    ``imagenet_1k``: the model has ImageNet-1K's 1,000 classes (``mce_alexnet`` is given then)."""
    sevs = sorted(int(s) for s in severities)
    full = tuple(sevs) == SEVERITIES
    out: dict[str, dict[str, Any]] = {}
    for family, names in CORRUPTION_FAMILIES.items():
        ran = [c for c in names if c in metrics]
        if ran:
            out[family] = _group(metrics, map_metrics, ran, sevs, full and len(ran) == len(names))
    ran = [c for c in IMAGENET_C_NAMES if c in metrics]
    if ran:
        out["all"] = _group(metrics, map_metrics, ran, sevs, full and len(ran) == len(IMAGENET_C_NAMES))
        if out["all"]["complete"] and imagenet_1k:
            out["all"]["mce_alexnet"] = _mce_alexnet(metrics, sevs)
    return out
