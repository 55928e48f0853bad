"""Several named OOD sets (issue 39): OpenOOD's AUROC / FPR@95 / AUPR-In / AUPR-Out per set, per
score and per group against scikit-learn on the same scores, and the per-set bootstrap."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve

from laplace_core.metrics.bootstrap import bootstrap, ood_summary
from laplace_core.metrics.oodsets import OOD_SCORES, metric_key, openood_metrics
from laplace_core.metrics.perimage import PerImage, per_image_terms

TOL = 1e-12  # float64 against scikit-learn's float64 computation


def _sklearn(s_in: np.ndarray, s_out: np.ndarray) -> dict[str, float]:
    """OpenOOD's definitions, written with scikit-learn (ID label 1, ID score = -OOD score)."""
    y_in = np.r_[np.ones(len(s_in)), np.zeros(len(s_out))]
    conf = -np.r_[s_in, s_out]
    fpr, tpr, _ = roc_curve(y_in, conf, drop_intermediate=False)
    return {"auroc": roc_auc_score(1 - y_in, -conf), "fpr95": fpr[np.argmax(tpr >= 0.95)],
            "aupr_in": average_precision_score(y_in, conf), "aupr_out": average_precision_score(1 - y_in, -conf)}


@pytest.mark.parametrize("seed", [0, 1])
def test_openood_metrics_equal_sklearn_with_ties(seed):
    rng = np.random.default_rng(seed)
    s_in = np.round(rng.beta(2, 5, 300), 2)  # rounded: ties inside and across the sets
    s_out = np.round(rng.beta(4, 3, 170), 2)
    got = openood_metrics(torch.tensor(s_in), torch.tensor(s_out))
    ref = _sklearn(s_in, s_out)
    for k in ref:
        assert abs(got[k] - ref[k]) < TOL, (k, got[k], ref[k])
    assert got["aupr_in"] != pytest.approx(got["aupr_out"], abs=1e-3)  # the two conventions differ here


def _two_sets(seed: int) -> tuple[PerImage, dict]:
    g = torch.Generator().manual_seed(seed)
    lp_in = torch.log_softmax(3 * torch.randn(200, 5, generator=g, dtype=torch.float64), 1)
    y = torch.randint(0, 5, (200,), generator=g)
    ee = {"in": torch.rand(200, generator=g, dtype=torch.float64) * 0.2}
    per = PerImage().add(per_image_terms(lp_in, y, ee["in"]), ood=False)
    outs = {}
    for k, (n, scale) in enumerate(((120, 1.0), (80, 0.3))):
        lp = torch.log_softmax(scale * torch.randn(n, 5, generator=g, dtype=torch.float64), 1)
        t = per_image_terms(lp, None, torch.rand(n, generator=g, dtype=torch.float64) * 0.2)
        t["set"] = torch.full((n,), float(k), dtype=torch.float64)
        outs[k] = t
        per = per.add(t, ood=True)
    return per, outs


def test_per_set_and_group_summary_equal_sklearn():
    per, outs = _two_sets(0)
    sets = [("letters", "near"), ("noise", "near")]
    s = ood_summary(per, sets)["per_set"]
    assert s["convention"]["fpr95"].startswith("FPR on OOD at 95% TPR on ID")
    for k, (name, _) in enumerate(sets):
        assert s["sets"][name]["n_out"] == outs[k]["conf"].numel()
        for score, (f, sign) in OOD_SCORES.items():
            ref = _sklearn((sign * per.inp[f]).numpy(), (sign * outs[k][f]).numpy())
            for m, v in ref.items():
                assert abs(s["sets"][name][score][m] - v) < TOL, (name, score, m)
    for score in OOD_SCORES:
        for m in ("auroc", "fpr95", "aupr_in", "aupr_out"):
            mean = (s["sets"]["letters"][score][m] + s["sets"]["noise"][score][m]) / 2
            assert abs(s["groups"]["near"][score][m] - mean) < TOL


def test_per_set_bootstrap_keys_points_and_single_set_compatibility():
    per, outs = _two_sets(1)
    sets = [("letters", "far"), ("noise", None)]
    other = PerImage(dict(per.inp), dict(per.out), per.exact_nll)  # the same predictions
    b = bootstrap({"map": per, "inf": other}, resamples=50, seed=0, ood_sets=sets)
    ref = _sklearn(per.inp["entropy"].numpy(), outs[1]["entropy"].numpy())
    assert abs(b["map"]["point"][metric_key("auroc", "noise")] - ref["auroc"]) < TOL
    assert metric_key("fpr95", "far", "max_prob") in b["inf"]["ci"]
    assert metric_key("auroc", "none") not in b["inf"]["ci"]  # ungrouped sets make no group
    lo, hi = b["inf"]["ci"]["ood_auroc@letters"]
    assert lo <= b["inf"]["point"]["ood_auroc@letters"] <= hi and lo < hi
    d = b["inf"]["paired"]["map"]["ood_auroc@letters"]  # the same predictions: a zero paired difference
    assert d["lo"] == d["hi"] == 0.0 and not d["significant"]
    # one set named: the pooled metrics and their intervals are today's (the same draws)
    one = PerImage(per.inp, {k: v for k, v in per.out.items() if k != "set"}, per.exact_nll)
    old, new = bootstrap({"map": one}, 50, 0), bootstrap({"map": one}, 50, 0, ood_sets=[("ood", None)])
    assert old["map"]["ci"]["ood_auroc"] == new["map"]["ci"]["ood_auroc"]
    assert new["map"]["point"]["ood_auroc@ood"] == pytest.approx(new["map"]["point"]["ood_auroc"], abs=TOL)
