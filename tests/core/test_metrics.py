"""laplace_core.metrics against independent implementations (numpy / scikit-learn / scipy).

Every reference here is written without the module's helpers: numpy loops over bins,
scikit-learn for log loss, Brier, AUROC, AUPR and the ROC curve.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy.stats import entropy as scipy_entropy
from sklearn.metrics import (
    accuracy_score,
    average_precision_score,
    brier_score_loss,
    log_loss,
    roc_auc_score,
    roc_curve,
)

from laplace_core.metrics.base import FINE_BINS, NLL_EPS, bin_index
from laplace_core.metrics.calibration import Calibration, Entropy
from laplace_core.metrics.ood import OODDetection
from laplace_core.metrics.scores import NLL, Accuracy, Brier
from laplace_core.metrics.suite import MetricSuite

TOL = 1e-12          # float64 sums vs an independent float64 computation
HIST_TOL = 1e-3      # histogram-mode OOD metrics vs exact ones (10,000 bins)
MASS_TOL = 2e-3      # equal-mass ECE from the fine histogram vs the exact rank rule (continuous data)


def make_data(n=600, c=5, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(n, c, generator=g, dtype=torch.float64)
    probs = torch.softmax(logits, dim=1)
    # labels drawn from a tempered version, so the model is mis-calibrated but informative
    labels = torch.multinomial(torch.softmax(0.7 * logits, dim=1), 1, generator=g)[:, 0]
    return probs, labels


# ----------------------------------------------------------------- independent references
def ref_ece_equal_width(conf, correct, n_bins):
    conf, correct = np.asarray(conf), np.asarray(correct, dtype=float)
    total, table = 0.0, []
    for i in range(n_bins):
        lo, hi = i / n_bins, (i + 1) / n_bins
        inb = (conf > lo) & (conf <= hi)
        if i == 0:
            inb |= conf == 0.0
        k = int(inb.sum())
        table.append(k)
        if k:
            total += k / len(conf) * abs(conf[inb].mean() - correct[inb].mean())
    return total, table


def ref_ece_equal_mass(conf, correct, n_bins):
    """Rank rule: sorted example of rank r -> bin floor(r*n_bins/N); tied values stay with their first member."""
    conf, correct = np.asarray(conf), np.asarray(correct, dtype=float)
    N = len(conf)
    order = np.argsort(conf, kind="stable")
    cs, cor = conf[order], correct[order]
    values, first = np.unique(cs, return_index=True)
    group_of_value = (first * n_bins) // N
    groups = group_of_value[np.searchsorted(values, cs)]
    total = 0.0
    for b in range(n_bins):
        sel = groups == b
        if sel.any():
            total += sel.sum() / N * abs(cs[sel].mean() - cor[sel].mean())
    return total


def ref_fpr_at_95(scores_in, scores_out):
    y = np.r_[np.zeros(len(scores_in)), np.ones(len(scores_out))]
    fpr, tpr, _ = roc_curve(y, np.r_[scores_in, scores_out], drop_intermediate=False)
    return fpr[np.searchsorted(tpr, 0.95, side="left")]


def ref_norm_entropy(p):
    return scipy_entropy(p, axis=1) / math.log(p.shape[1])


def assert_close_tree(a, b, tol=TOL, path="root"):
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), path
        for k in a:
            assert_close_tree(a[k], b[k], tol, f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close_tree(x, y, tol, f"{path}[{i}]")
    elif isinstance(a, float):
        assert isinstance(b, (float, int)) and abs(a - b) <= tol * max(1.0, abs(a)), f"{path}: {a} vs {b}"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


# ----------------------------------------------------------------- scalar metrics
def test_accuracy_nll_brier_against_sklearn():
    p, y = make_data()
    s = MetricSuite().update(p, y).compute()
    P, Y = p.numpy(), y.numpy()
    assert s["count"] == len(Y)
    assert s["accuracy"] == accuracy_score(Y, P.argmax(1))
    assert P.min() > 1e-10  # no clipping involved on either side
    assert abs(s["nll"] - log_loss(Y, P, labels=list(range(P.shape[1])))) < TOL
    onehot = np.eye(P.shape[1])[Y]
    brier_np = ((P - onehot) ** 2).sum(1).mean()
    assert abs(s["brier"] - brier_np) < TOL
    brier_sk = brier_score_loss(Y, P, labels=list(range(P.shape[1])), scale_by_half=False)
    assert abs(s["brier"] - brier_sk) < TOL


def test_nll_clamps_zero_probability_at_eps():
    p = torch.tensor([[1.0, 0.0], [0.25, 0.75]], dtype=torch.float64)
    y = torch.tensor([1, 1])
    nll = NLL().update(p, y).compute()["nll"]
    assert nll == pytest.approx((-math.log(NLL_EPS) - math.log(0.75)) / 2, rel=1e-14)


def test_single_class_present():
    p, _ = make_data(n=200, c=4, seed=3)
    y = torch.zeros(200, dtype=torch.int64)
    s = MetricSuite().update(p, y).compute()
    P = p.numpy()
    assert s["accuracy"] == float(np.mean(P.argmax(1) == 0))
    assert abs(s["nll"] - log_loss(np.zeros(200), P, labels=[0, 1, 2, 3])) < TOL
    assert abs(s["brier"] - ((P - np.eye(4)[np.zeros(200, int)]) ** 2).sum(1).mean()) < TOL
    conf = P.max(1)
    ece_ref, _ = ref_ece_equal_width(conf, P.argmax(1) == 0, 15)
    assert abs(s["ece_equal_width_15"] - ece_ref) < TOL


# ----------------------------------------------------------------- calibration
@pytest.mark.parametrize("n_bins", [15, 10, 7])
def test_ece_equal_width_against_numpy(n_bins):
    p, y = make_data(n=800, c=6, seed=1)
    cal = Calibration("equal_width", n_bins).update(p, y).compute()
    P, Y = p.numpy(), y.numpy()
    conf, correct = P.max(1), P.argmax(1) == Y
    ref, counts = ref_ece_equal_width(conf, correct, n_bins)
    assert cal["name"] == f"ece_equal_width_{n_bins}"
    assert abs(cal["ece"] - ref) < TOL
    assert [b["count"] for b in cal["bins"]] == counts
    for i, b in enumerate(cal["bins"]):
        assert b["lo"] == i / n_bins and b["hi"] == (i + 1) / n_bins
        if b["count"]:
            inb = (conf > b["lo"]) & (conf <= b["hi"])
            assert abs(b["confidence"] - conf[inb].mean()) < TOL
            assert abs(b["accuracy"] - correct[inb].mean()) < TOL
            assert abs(b["gap"] - (conf[inb].mean() - correct[inb].mean())) < TOL
        else:
            assert b["confidence"] is None and b["gap"] is None
    gaps = [abs(b["gap"]) for b in cal["bins"] if b["count"]]
    assert abs(cal["mce"] - max(gaps)) < TOL


def test_ece_against_torchmetrics_if_available():
    tm = pytest.importorskip("torchmetrics.functional.classification")
    p, y = make_data(n=500, c=4, seed=11)
    ours = Calibration("equal_width", 15).update(p, y).compute()["ece"]
    theirs = float(tm.multiclass_calibration_error(p.float(), y, num_classes=4, n_bins=15, norm="l1"))
    assert abs(ours - theirs) < 1e-5  # float32 inside torchmetrics; left-closed bins, no value on an edge here


def test_confidence_exactly_on_bin_edges():
    # C = 2 confidences exactly equal to float64 edges k/15 go to the bin below (right-closed)
    ks = [8, 9, 12, 15]
    conf = torch.tensor([k / 15 for k in ks], dtype=torch.float64)
    p = torch.stack([conf, 1 - conf], dim=1)
    y = torch.tensor([0, 1, 0, 0])
    cal = Calibration("equal_width", 15).update(p, y).compute()
    counts = [b["count"] for b in cal["bins"]]
    expected = [0] * 15
    for k in ks:
        expected[k - 1] += 1
    assert counts == expected
    ref, ref_counts = ref_ece_equal_width(conf.numpy(), [True, False, True, True], 15)
    assert ref_counts == expected and abs(cal["ece"] - ref) < TOL
    # the bin function itself: 0 -> first bin, 1 -> last bin, edge -> lower bin
    idx = bin_index(torch.tensor([0.0, 1 / 15, 1 / 15 + 1e-15, 1.0], dtype=torch.float64), 15)
    assert idx.tolist() == [0, 0, 1, 14]


def test_ece_equal_mass_exact_for_few_distinct_values():
    # confidences on a coarse grid (each value alone in its fine bin) with many ties
    g = torch.Generator().manual_seed(5)
    n = 997
    conf = 0.5 + torch.randint(0, 41, (n,), generator=g).to(torch.float64) / 80  # values in [0.5, 1]
    p = torch.stack([conf, 1 - conf], dim=1)
    y = (torch.rand(n, generator=g, dtype=torch.float64) > conf).to(torch.int64)
    for n_bins in (15, 10):
        ours = Calibration("equal_mass", n_bins).update(p, y).compute()
        ref = ref_ece_equal_mass(conf.numpy(), (y == 0).numpy(), n_bins)
        assert abs(ours["ece"] - ref) < TOL
        assert sum(b["count"] for b in ours["bins"]) == n


def test_ece_equal_mass_continuous_close_to_rank_rule():
    p, y = make_data(n=3000, c=10, seed=2)
    P, Y = p.numpy(), y.numpy()
    conf, correct = P.max(1), P.argmax(1) == Y
    ours = Calibration("equal_mass", 15).update(p, y).compute()
    ref = ref_ece_equal_mass(conf, correct, 15)
    assert abs(ours["ece"] - ref) < MASS_TOL
    counts = [b["count"] for b in ours["bins"]]
    assert sum(counts) == 3000 and max(counts) - min(counts) <= 10  # nearly equal mass
    # bins are ordered and disjoint
    his = [b["hi"] for b in ours["bins"]]
    los = [b["lo"] for b in ours["bins"]]
    assert all(his[i] <= los[i + 1] for i in range(14))


# ----------------------------------------------------------------- entropy
def test_entropy_mean_and_histogram():
    p, y = make_data(n=400, c=7, seed=4, scale=1.0)
    p = torch.cat([p, torch.full((1, 7), 1 / 7, dtype=torch.float64), torch.eye(7, dtype=torch.float64)[:1]])
    y = torch.cat([y, torch.tensor([0, 0])])
    e = Entropy().update(p, y).compute()
    ref = ref_norm_entropy(p.numpy())
    assert abs(e["entropy_mean"] - np.clip(ref, 0, 1).mean()) < TOL
    edges = np.arange(51) / 50
    assert e["entropy_hist"]["edges"] == edges.tolist()
    ref_idx = np.searchsorted(edges[1:-1], np.clip(ref, 0, 1), side="left")  # right-closed bins
    assert e["entropy_hist"]["counts"] == np.bincount(ref_idx, minlength=50).tolist()
    assert e["entropy_hist"]["counts"][0] >= 1 and e["entropy_hist"]["counts"][-1] >= 1  # one-hot, uniform


# ----------------------------------------------------------------- OOD
def ood_scores(seed=7, n_in=700, n_out=500):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.beta(2.0, 5.0, n_in)), torch.from_numpy(rng.beta(3.0, 3.0, n_out))


def test_ood_exact_against_sklearn_and_histogram_close():
    s_in, s_out = ood_scores()
    y = np.r_[np.zeros(len(s_in)), np.ones(len(s_out))]
    s = np.r_[s_in.numpy(), s_out.numpy()]
    ref = {
        "auroc": roc_auc_score(y, s),
        "aupr": average_precision_score(y, s),
        "fpr_at_95_tpr": ref_fpr_at_95(s_in.numpy(), s_out.numpy()),
    }
    exact = OODDetection(exact_limit=10_000).update_scores(s_in, ood=False).update_scores(s_out, ood=True).compute()
    hist = OODDetection().update_scores(s_in, ood=False).update_scores(s_out, ood=True).compute()
    assert exact["mode"] == "exact" and hist["mode"] == "histogram_10000"
    for k, v in ref.items():
        assert abs(exact[k] - v) < TOL, k
        assert abs(hist[k] - v) < HIST_TOL, k
    assert exact["n_in"] == 700 and exact["n_out"] == 500
    assert sum(hist["entropy_hist_in"]["counts"]) == 700 and sum(hist["entropy_hist_out"]["counts"]) == 500


def test_ood_histogram_exact_on_quantised_scores_with_ties():
    g = torch.Generator().manual_seed(1)
    # scores on the centres of the fine bins -> histogram mode is exact, with many ties
    s_in = (torch.randint(0, 300, (500,), generator=g).double() + 0.5) / FINE_BINS * 20
    s_out = (torch.randint(100, 400, (400,), generator=g).double() + 0.5) / FINE_BINS * 20
    s_in, s_out = ((s_in * FINE_BINS).floor() + 0.5) / FINE_BINS, ((s_out * FINE_BINS).floor() + 0.5) / FINE_BINS
    y = np.r_[np.zeros(500), np.ones(400)]
    s = np.r_[s_in.numpy(), s_out.numpy()]
    hist = OODDetection().update_scores(s_in, ood=False).update_scores(s_out, ood=True).compute()
    assert abs(hist["auroc"] - roc_auc_score(y, s)) < TOL
    assert abs(hist["aupr"] - average_precision_score(y, s)) < TOL
    assert abs(hist["fpr_at_95_tpr"] - ref_fpr_at_95(s_in.numpy(), s_out.numpy())) < TOL


def test_ood_from_probs_uses_normalised_entropy():
    p_in, _ = make_data(n=300, c=5, seed=8, scale=3.0)
    p_out, _ = make_data(n=200, c=5, seed=9, scale=0.7)
    r = OODDetection(exact_limit=1000).update(p_in, ood=False).update(p_out, ood=True).compute()
    e_in, e_out = ref_norm_entropy(p_in.numpy()), ref_norm_entropy(p_out.numpy())
    y = np.r_[np.zeros(300), np.ones(200)]
    assert abs(r["auroc"] - roc_auc_score(y, np.r_[e_in, e_out])) < TOL
    assert abs(r["aupr"] - average_precision_score(y, np.r_[e_in, e_out])) < TOL


def test_ood_exact_mode_switches_on_total_count_only():
    s_in, s_out = ood_scores(seed=1, n_in=60, n_out=50)
    a = OODDetection(exact_limit=80).update_scores(s_in[:30], ood=False).update_scores(s_out[:25], ood=True)
    b = OODDetection(exact_limit=80).update_scores(s_in[30:], ood=False).update_scores(s_out[25:], ood=True)
    assert a.exact and b.exact
    merged = a.merge(b)
    whole = OODDetection(exact_limit=80).update_scores(s_in, ood=False).update_scores(s_out, ood=True)
    assert not merged.exact and not whole.exact
    assert_close_tree(merged.compute(), whole.compute())


# ----------------------------------------------------------------- merge / JSON
def shard_suites(p, y, p_ood, cuts, cuts_ood, **kw):
    suites = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        suites.append(MetricSuite.create(**kw).update(p[lo:hi], y[lo:hi]))
    for i, (lo, hi) in enumerate(zip(cuts_ood[:-1], cuts_ood[1:])):
        suites[i % len(suites)] = suites[i % len(suites)].update_ood(p_ood[lo:hi])
    return suites


@pytest.mark.parametrize("exact_limit", [0, 10_000])
def test_merged_shards_equal_whole_set(exact_limit):
    p, y = make_data(n=1000, c=8, seed=12)
    p_ood, _ = make_data(n=400, c=8, seed=13, scale=0.8)
    whole = MetricSuite.create(ood_exact_limit=exact_limit).update(p, y).update_ood(p_ood).compute()
    shards = shard_suites(p, y, p_ood, [0, 137, 500, 501, 1000], [0, 10, 250, 400], ood_exact_limit=exact_limit)
    left = shards[0].merge(shards[1]).merge(shards[2]).merge(shards[3])
    tree = shards[3].merge(shards[1]).merge(shards[2].merge(shards[0]))  # other order
    for merged in (left, tree):
        r = merged.compute()
        assert_close_tree(whole, r)
        assert r["count"] == 1000 and r["ood"]["n_out"] == 400
    assert "ece_equal_width_15" in whole and "ece_equal_mass_15" in whole
    assert "reliability_equal_width_15" in whole and whole["ood"]["mode"] == ("exact" if exact_limit else "histogram_10000")


def test_suite_matches_parts_and_named_variant():
    p, y = make_data(n=300, c=3, seed=14)
    s = MetricSuite.create(ece_bins=10).update(p, y).compute()
    assert s["ece_equal_width_10"] == Calibration("equal_width", 10).update(p, y).compute()["ece"]
    assert s["ece_equal_mass_10"] == Calibration("equal_mass", 10).update(p, y).compute()["ece"]
    assert "ood" not in s
    json.dumps(s)  # JSON-able


def test_json_round_trip_is_exact():
    p, y = make_data(n=250, c=4, seed=15)
    p_ood, _ = make_data(n=90, c=4, seed=16, scale=0.5)
    for limit in (0, 1000):
        suite = MetricSuite.create(ood_exact_limit=limit).update(p, y).update_ood(p_ood)
        back = MetricSuite.from_json(json.loads(json.dumps(suite.to_json())))
        assert back.compute() == suite.compute()
        # and the restored accumulator keeps accumulating
        assert_close_tree(back.update(p, y).compute(), suite.update(p, y).compute())
    with pytest.raises(ValueError, match="not a"):
        NLL.from_json(Brier().to_json())


# ----------------------------------------------------------------- errors
def test_empty_accumulators_raise_on_compute():
    for acc in (Accuracy(), NLL(), Brier(), Calibration(), Calibration("equal_mass"), Entropy()):
        with pytest.raises(ValueError, match="no examples"):
            acc.compute()
    with pytest.raises(ValueError, match="no in-distribution"):
        MetricSuite().compute()
    with pytest.raises(ValueError, match="needs in-distribution and OOD"):
        OODDetection().update_scores(torch.tensor([0.1, 0.2]), ood=False).compute()
    # an empty batch is fine and changes nothing
    p0 = torch.zeros(0, 3, dtype=torch.float64)
    assert Accuracy().update(p0, torch.zeros(0, dtype=torch.int64)).count == 0


@pytest.mark.parametrize(
    "probs,labels,match",
    [
        (torch.tensor([[0.5, 0.6]]), torch.tensor([0]), "sum to 1"),
        (torch.tensor([[float("nan"), 1.0]]), torch.tensor([0]), "NaN"),
        (torch.tensor([[1.2, -0.2]]), torch.tensor([0]), r"lie in \[0, 1\]"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([2]), "labels must lie"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([-1]), "labels must lie"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([0, 1]), "shape"),
        (torch.tensor([0.5, 0.5]), torch.tensor([0]), r"shape \[B, C\]"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([0.0]), "integer"),
        (torch.tensor([[1.0]]), torch.tensor([0]), "at least 2 classes"),
        (torch.tensor([[1, 0]]), torch.tensor([0]), "floating"),
    ],
)
def test_bad_input_raises(probs, labels, match):
    with pytest.raises(ValueError, match=match):
        MetricSuite().update(probs, labels)


def test_class_count_and_config_mismatch():
    p3 = torch.full((2, 3), 1 / 3, dtype=torch.float64)
    p4 = torch.full((2, 4), 1 / 4, dtype=torch.float64)
    y = torch.tensor([0, 1])
    s = MetricSuite().update(p3, y)
    with pytest.raises(ValueError, match="classes"):
        s.update(p4, y)
    with pytest.raises(ValueError, match="classes"):
        s.update_ood(p4)
    with pytest.raises(ValueError, match="classes"):
        s.merge(MetricSuite().update(p4, y))
    with pytest.raises(ValueError, match="n_bins"):
        Calibration("equal_width", 15).merge(Calibration("equal_width", 10))
    with pytest.raises(ValueError, match="valid: equal_width, equal_mass"):
        Calibration("quantile")
