"""Per-family and all-15 shift summaries (pipelines.evaluation.shift_summary) against a dense
numpy recomputation: means over corruptions x severities and the corruption error relative to
MAP (Hendrycks & Dietterich's CE with MAP as the reference model). Pure Python, no Ray."""
from __future__ import annotations

import numpy as np
import pytest

from pipelines.config.choices import CORRUPTION_FAMILIES, IMAGENET_C_NAMES
from pipelines.evaluation.shift_summary import shift_summary

KEYS = ("accuracy", "nll", "ece", "brier")


def _metrics(names, sevs, seed):
    rng = np.random.default_rng(seed)
    vals = {c: {str(s): dict(zip(KEYS, rng.uniform(0.05, 0.95, 4)), count=100) for s in sevs} for c in names}
    return vals


def test_family_and_all_means_and_relative_ce_match_a_dense_recomputation():
    names, sevs = list(IMAGENET_C_NAMES) + ["gaussian_blur"], [1, 2, 3, 4, 5]
    mine, ref = _metrics(names, sevs, 0), _metrics(names, sevs, 1)
    out = shift_summary(mine, ref, sevs)
    assert list(out) == [*CORRUPTION_FAMILIES, "all"]
    for group, members in [*CORRUPTION_FAMILIES.items(), ("all", IMAGENET_C_NAMES)]:
        g = out[group]
        assert g["corruptions"] == list(members) and g["complete"] is True
        for k in KEYS:
            dense = np.array([[mine[c][str(s)][k] for s in sevs] for c in members], dtype=np.float64)
            assert g[k] == pytest.approx(dense.mean(), rel=0, abs=1e-12)
        err = np.array([[1 - mine[c][str(s)]["accuracy"] for s in sevs] for c in members])
        err_ref = np.array([[1 - ref[c][str(s)]["accuracy"] for s in sevs] for c in members])
        assert g["ce_vs_map"] == pytest.approx((err.sum(1) / err_ref.sum(1)).mean(), rel=0, abs=1e-12)
    assert shift_summary(ref, ref, sevs)["all"]["ce_vs_map"] == pytest.approx(1.0, abs=1e-12)  # MAP against itself


def test_partial_sweeps_are_marked_incomplete_and_failures_give_none():
    sevs = [1, 5]
    mine = _metrics(["gaussian_noise", "contrast", "gaussian_blur"], sevs, 2)
    out = shift_summary(mine, mine, sevs)
    assert set(out) == {"noise", "digital", "all"}  # gaussian_blur is not one of the 15
    assert out["noise"]["corruptions"] == ["gaussian_noise"] and out["noise"]["complete"] is False
    assert out["all"]["corruptions"] == ["gaussian_noise", "contrast"] and out["all"]["complete"] is False
    mine["contrast"]["5"] = {"status": "failed", "reason": "x"}
    out = shift_summary(mine, _metrics(["gaussian_noise", "contrast"], sevs, 3), sevs)
    assert out["digital"]["accuracy"] is None and out["digital"]["ce_vs_map"] is None
    assert out["noise"]["accuracy"] is not None and out["all"]["nll"] is None


def test_mce_is_normalised_by_alexnets_published_errors_only_for_a_complete_imagenet_sweep():
    from pipelines.evaluation.shift_summary import ALEXNET_ERR

    sevs = [1, 2, 3, 4, 5]
    mine = _metrics(IMAGENET_C_NAMES, sevs, 4)
    err = np.array([[1 - mine[c][str(s)]["accuracy"] for s in sevs] for c in IMAGENET_C_NAMES]).mean(1)
    alexnet = np.array([ALEXNET_ERR[c] for c in IMAGENET_C_NAMES])
    assert list(ALEXNET_ERR) == list(IMAGENET_C_NAMES) and ALEXNET_ERR["gaussian_noise"] == 0.886428
    got = shift_summary(mine, mine, sevs, imagenet_1k=True)["all"]["mce_alexnet"]
    assert got == pytest.approx(100 * (err / alexnet).mean(), rel=0, abs=1e-10)
    assert "mce_alexnet" not in shift_summary(mine, mine, sevs)["all"]  # not ImageNet-1K
    assert "mce_alexnet" not in shift_summary(mine, mine, [1, 3, 5], imagenet_1k=True)["all"]  # incomplete
