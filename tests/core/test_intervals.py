"""Intervals, selective prediction, OOD per score and exact NLL (issue 27) against independent
references: scikit-learn, a normal-approximation (McNemar) interval, dense loops, log-softmax."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve

from laplace_core.metrics.bootstrap import RankedScores, bootstrap, weighted_metrics
from laplace_core.metrics.perimage import PerImage, per_image_terms
from laplace_core.metrics.selective import accuracy_at_coverage, aurc, risk_coverage
from laplace_core.metrics.suite import MetricSuite
from laplace_core.predictive.monte_carlo import DrawStats, draw_stats

TOL = 1e-12            # float64 against an independent float64 computation
WIDTH_TOL = 0.10       # bootstrap interval width against the normal approximation (issue 27)


def _per(log_probs: torch.Tensor, y: torch.Tensor, ood_log_probs: torch.Tensor | None = None) -> PerImage:
    per = PerImage().add(per_image_terms(log_probs, y), ood=False)
    return per if ood_log_probs is None else per.add(per_image_terms(ood_log_probs), ood=True)


def _planted(correct: np.ndarray, conf: float = 0.8, C: int = 3) -> torch.Tensor:
    """Log-probabilities whose argmax is class 0, right where ``correct`` (labels 0) else wrong."""
    p = np.full((len(correct), C), (1 - conf) / (C - 1))
    p[:, 0] = conf
    return torch.log(torch.tensor(p))


@pytest.mark.parametrize("seed", [0, 1])
def test_ood_metrics_equal_sklearn_with_ties(seed):
    rng = np.random.default_rng(seed)
    s_in = np.round(rng.beta(2, 5, 300), 2)  # rounded: many ties, inside and across the sets
    s_out = np.round(rng.beta(4, 3, 170), 2)
    got = RankedScores(torch.tensor(s_in), torch.tensor(s_out)).metrics()
    y = np.r_[np.zeros(len(s_in)), np.ones(len(s_out))]
    s = np.r_[s_in, s_out]
    fpr, tpr, _ = roc_curve(y, s, drop_intermediate=False)
    assert abs(got["auroc"] - roc_auc_score(y, s)) < TOL
    assert abs(got["aupr"] - average_precision_score(y, s)) < TOL
    assert abs(got["fpr_at_95_tpr"] - fpr[np.argmax(tpr >= 0.95)]) < TOL
    # integer weights (a bootstrap resample) equal the metrics of the repeated rows
    w_in, w_out = rng.integers(0, 3, len(s_in)), rng.integers(0, 3, len(s_out))
    wt = RankedScores(torch.tensor(s_in), torch.tensor(s_out)).metrics(torch.tensor(w_in, dtype=torch.float64),
                                                                       torch.tensor(w_out, dtype=torch.float64))
    rep = RankedScores(torch.tensor(np.repeat(s_in, w_in)), torch.tensor(np.repeat(s_out, w_out))).metrics()
    for k in rep:
        assert abs(wt[k] - rep[k]) < TOL, k


def _dense_risk_coverage(conf: np.ndarray, correct: np.ndarray):
    """O(n^2): for every distinct confidence t (high to low), the images with conf >= t."""
    cov, risk = [], []
    for t in sorted(set(conf.tolist()), reverse=True):
        keep = conf >= t
        cov.append(keep.mean())
        risk.append(1.0 - correct[keep].mean())
    return np.array(cov), np.array(risk)


def test_aurc_and_coverage_accuracy_equal_a_dense_computation():
    rng = np.random.default_rng(3)
    conf = np.round(rng.uniform(0.3, 1.0, 400), 2)  # ties
    correct = (rng.uniform(size=400) < conf).astype(float)
    cov, risk = _dense_risk_coverage(conf, correct)
    dense_aurc = float(np.sum(np.diff(np.r_[0.0, cov]) * risk))
    c_t, r_t = risk_coverage(torch.tensor(conf), torch.tensor(correct))
    assert np.allclose(c_t.numpy(), cov, rtol=0, atol=TOL) and np.allclose(r_t.numpy(), risk, rtol=0, atol=TOL)
    assert abs(aurc(torch.tensor(conf), torch.tensor(correct)) - dense_aurc) < TOL
    for q in (0.9, 0.95):
        j = int(np.argmax(cov >= q))
        assert abs(accuracy_at_coverage(torch.tensor(conf), torch.tensor(correct), q) - (1 - risk[j])) < TOL
    # without ties AURC is the mean over k of the risk of the k most confident
    conf2 = rng.permutation(400) / 400.0
    order = np.argsort(-conf2)
    topk = np.cumsum(1 - correct[order]) / np.arange(1, 401)
    assert abs(aurc(torch.tensor(conf2), torch.tensor(correct)) - topk.mean()) < TOL


def test_paired_accuracy_interval_agrees_with_the_normal_approximation():
    """Two methods on n = 2000 images, 180 + 100 discordant: the bootstrap's 95% interval of the
    accuracy difference has the width of the McNemar normal-approximation interval within 10%."""
    rng = np.random.default_rng(7)
    n, b, c = 2000, 180, 100  # b: only A right, c: only B right
    kind = rng.permutation(np.r_[np.full(b, 1), np.full(c, 2), np.full(1300, 3), np.full(n - b - c - 1300, 0)])
    a_right, b_right = np.isin(kind, (1, 3)), np.isin(kind, (2, 3))
    y = torch.zeros(n, dtype=torch.int64)
    per = {"a": _per(_planted(a_right), torch.where(torch.tensor(a_right), 0, 1)),
           "map": _per(_planted(b_right), torch.where(torch.tensor(b_right), 0, 1))}
    del y
    res = bootstrap(per, resamples=2000, seed=0, refs=("map",))
    p = res["a"]["paired"]["map"]["accuracy"]
    d = (b - c) / n
    se = math.sqrt(((b + c) / n - d * d) / n)
    assert p["diff"] == pytest.approx(d, abs=TOL)
    width, ref = p["hi"] - p["lo"], 2 * 1.959963984540054 * se
    assert abs(width - ref) / ref < WIDTH_TOL, (width, ref)
    assert p["significant"] and p["lo"] > 0


def test_identical_methods_are_not_different_and_a_clearly_better_one_is_better():
    from pipelines.report.verdict import summary_table, verdict_sentences

    rng = np.random.default_rng(11)
    n = 400
    y = torch.tensor(rng.integers(0, 3, n))
    logits = torch.tensor(rng.normal(size=(n, 3))) * 0.5
    good = logits.clone()
    good[torch.arange(n), y] += 4.0  # right with a margin on (nearly) every image
    lp = torch.log_softmax(logits, -1)
    per = {"map": _per(lp, y), "diag": _per(lp.clone(), y), "inf": _per(torch.log_softmax(good, -1), y)}
    res = bootstrap(per, resamples=300, seed=0)
    assert all(not v["significant"] and v["lo"] == v["hi"] == 0 for v in res["diag"]["paired"]["map"].values())
    assert res["inf"]["paired"]["map"]["accuracy"]["significant"] and res["inf"]["paired"]["map"]["accuracy"]["lo"] > 0
    results = {m: {"status": "ok", **r["point"], "intervals": r} for m, r in res.items()}
    said = verdict_sentences(results)
    diag = next(s for s in said if s.startswith("Diag"))
    inf = next(s for s in said if s.startswith("INF"))
    assert diag == f"Diag vs MAP: no significant difference at n = {n} on any metric."
    assert inf.startswith("INF vs MAP: better Accuracy, NLL, ECE, Brier, AURC") and "worse" not in inf
    header, rows, marked, keys = summary_table(results)
    acc = dict(zip(header, rows[keys.index("accuracy")]))
    assert acc["Better"] == "↑ higher" and acc["Best"] == "INF" and "[" in acc["MAP"]
    same = {m: {"status": "ok", "accuracy": 0.9} for m in ("map", "diag")}
    row = dict(zip(*[summary_table(same)[i] for i in (0,)], summary_table(same)[1][0]))
    assert row["Best"] == "all tied"
    three = {**same, "inf": {"status": "ok", "accuracy": 0.8}}
    assert dict(zip(summary_table(three)[0], summary_table(three)[1][0]))["Best"] == "MAP = Diag (tie)"


def test_bootstrap_is_seeded_and_checks_its_input():
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    lp = torch.log_softmax(torch.arange(18, dtype=torch.float64).reshape(6, 3).sin(), -1)
    lp2 = torch.log_softmax(lp * 3.0, -1)
    per = {"map": _per(lp, y), "x": _per(lp2, y)}
    a, b = bootstrap(per, 50, seed=3), bootstrap(per, 50, seed=3)
    assert a == b and bootstrap(per, 50, seed=4)["x"]["ci"] != a["x"]["ci"]
    with pytest.raises(ValueError, match="same images"):
        bootstrap({"map": per["map"], "y": _per(lp[:5], y[:5])}, 10)
    with pytest.raises(ValueError, match="resamples"):
        bootstrap(per, 1)
    pt = weighted_metrics(per["x"])
    ref = MetricSuite.create().update(torch.exp(lp2), y, lp2)
    assert abs(pt["nll"] - ref.compute()["nll"]) < TOL and abs(pt["accuracy"] - ref.compute()["accuracy"]) < TOL


def test_confident_mistake_nll_is_the_exact_log_softmax_value():
    """Logits (60, 0), true class 1: NLL = 60 + log(1 + e^-60) exactly; the probability floor
    (1e-12) would report 27.6."""
    z = torch.tensor([[60.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    y = torch.tensor([1, 1])
    lp = torch.log_softmax(z, -1)
    exact = (60.0 + math.log1p(math.exp(-60.0)) + math.log1p(math.exp(-2.0))) / 2
    got = MetricSuite.create().update(torch.exp(lp), y, lp).compute()["nll"]
    assert got == pytest.approx(exact, rel=1e-14)
    floored = MetricSuite.create().update(torch.exp(lp), y).compute()["nll"]
    assert floored < 15 < exact  # what the floor hid
    # MC: log-mean-exp over draws, one at a time or all at once, equals the direct value
    draws = torch.tensor([[[60.0, 0.0]], [[58.0, 0.0]], [[61.0, 1.0]]], dtype=torch.float64)
    direct = -math.log(sum(math.exp(-d[0, 0].item() + d[0, 1].item()) / (1 + math.exp(-d[0, 0].item() + d[0, 1].item()))
                           for d in draws) / 3)
    st = DrawStats()
    for d in draws:
        st.add(d)
    for lpm, ent in (st.result(), draw_stats(draws)):
        assert -float(lpm[0, 1]) == pytest.approx(direct, rel=1e-13)
        p = torch.softmax(draws, -1)
        assert float(ent[0]) == pytest.approx(float(-(p * torch.log(p)).sum(-1).mean()), rel=1e-12)


def test_shift_mean_intervals_average_the_cells_and_pair_the_methods():
    from laplace_core.metrics.bootstrap import bootstrap_means

    rng = np.random.default_rng(5)
    cells = []
    for n in (120, 150):  # two corrupted test sets (cells) of their own sizes
        y = torch.tensor(rng.integers(0, 3, n))
        lp = torch.log_softmax(torch.tensor(rng.normal(size=(n, 3))), -1)
        good = lp.clone()
        good[torch.arange(n), y] += 5.0
        cells.append({"map": _per(lp, y), "diag": _per(lp.clone(), y), "inf": _per(torch.log_softmax(good, -1), y)})
    res = bootstrap_means(cells, 200, seed=0)
    acc = [float(c["map"].inp["correct"].mean()) for c in cells]
    assert res["map"]["point"]["shift_accuracy"] == pytest.approx(sum(acc) / 2, abs=TOL)
    lo, hi = res["map"]["ci"]["shift_accuracy"]
    assert lo < sum(acc) / 2 < hi
    assert not any(p["significant"] for p in res["diag"]["paired"]["map"].values())
    assert res["inf"]["paired"]["map"]["shift_nll"]["significant"] and res["inf"]["paired"]["map"]["shift_nll"]["hi"] < 0


def test_intervals_do_not_depend_on_the_image_order():
    """Actors concatenate images in a sharding-dependent order; the bootstrap sorts them into one
    canonical order first, so 1 or 2 actors give the same intervals."""
    rng = np.random.default_rng(2)
    n = 150
    y = torch.tensor(rng.integers(0, 3, n))
    lp = torch.log_softmax(torch.tensor(rng.normal(size=(n, 3))), -1)
    lp2 = torch.log_softmax(lp * 2.0, -1)
    lo = torch.log_softmax(torch.tensor(rng.normal(size=(40, 3))), -1)
    perm, perm_o = torch.tensor(rng.permutation(n)), torch.tensor(rng.permutation(40))
    a = bootstrap({"map": _per(lp, y, lo), "x": _per(lp2, y, lo * 2)}, 100, seed=1)
    b = bootstrap({"map": _per(lp[perm], y[perm], lo[perm_o]), "x": _per(lp2[perm], y[perm], (lo * 2)[perm_o])},
                  100, seed=1)
    assert a == b
