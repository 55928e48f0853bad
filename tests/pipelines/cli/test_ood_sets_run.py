"""Issue 39 end to end on the session's smoke run (``smoke_shift_run``: the demo's letters, 60 of
them, and 40 uniform-noise JPEGs named ``noise`` in the group ``far``; no job of its own): both sets'
AUROC / FPR@95 / AUPR-In / AUPR-Out per score with intervals in metrics.json, report.md and
report.html; the metrics equal scikit-learn's on the run's own per-image scores to 1e-12; run.json,
the verdict, the history rows and the alert rules name the set or group."""
from __future__ import annotations

import datetime as dt
import json

import numpy as np
import pytest
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TOL = 1e-12  # float64 against scikit-learn on the same float64 scores
METHODS = ("map", "temperature", "diag", "inf")
SCORES = {"entropy": ("entropy", 1.0), "max_prob": ("conf", -1.0), "mutual_information": ("mi", 1.0)}


def _json(path):
    return json.loads(path.read_text())


def _sklearn(s_in: np.ndarray, s_out: np.ndarray) -> dict[str, float]:
    y_in = np.r_[np.ones(len(s_in)), np.zeros(len(s_out))]
    s = np.r_[s_in, s_out]  # higher = more OOD
    fpr, tpr, _ = roc_curve(y_in, -s, drop_intermediate=False)
    return {"auroc": roc_auc_score(1 - y_in, s), "fpr95": fpr[np.argmax(tpr >= 0.95)],
            "aupr_in": average_precision_score(y_in, -s), "aupr_out": average_precision_score(1 - y_in, s)}


def test_both_sets_and_the_group_equal_sklearn_on_the_runs_own_scores(smoke_shift_run):
    for m in METHODS:
        r = _json(smoke_shift_run / "eval" / m / "metrics.json")
        per = r["ood_scores"]["per_set"]
        assert {n: s["n_out"] for n, s in per["sets"].items()} == {"letters": 60, "noise": 40}
        assert per["sets"]["noise"]["group"] == "far" and per["groups"]["far"]["sets"] == ["noise"]
        assert "ID positive" in per["convention"]["fpr95"] and "OOD positive" in per["convention"]["aupr_out"]
        acc = _json(smoke_shift_run / "eval" / m / "accumulators.json")["per_image"]
        s_set = np.asarray(acc["out"]["set"])
        for score, (f, sign) in SCORES.items():
            if f not in acc["out"]:
                assert score == "mutual_information" and m in ("map", "temperature")
                continue
            for k, name in enumerate(("letters", "noise")):
                ref = _sklearn(sign * np.asarray(acc["inp"][f]), sign * np.asarray(acc["out"][f])[s_set == k])
                for key, v in ref.items():
                    assert abs(per["sets"][name][score][key] - v) < TOL, (m, name, score, key)
            assert per["groups"]["far"][score] == per["sets"]["noise"][score]
        iv = r["intervals"]
        for key in ("ood_auroc@letters", "ood_fpr95@noise", "ood_aupr_in@far", "ood_maxp_aupr_out@letters"):
            lo, hi = iv["ci"][key]
            assert lo <= iv["point"][key] <= hi, (m, key)
        if m != "map":
            assert {"diff", "lo", "hi", "significant"} <= set(iv["paired"]["map"]["ood_auroc@letters"])


def test_report_run_json_history_and_alerts_name_the_sets(smoke_shift_run):
    from pipelines.cli.alerts import check_rules, parse_rules
    from pipelines.config.load import load_config
    from pipelines.ingest.plan import config_plan, scan_splits
    from pipelines.report.history import _table_bytes, run_rows

    md = (smoke_shift_run / "report.md").read_text(encoding="utf-8")
    html = (smoke_shift_run / "report.html").read_text(encoding="utf-8")
    for text in (md, html):
        assert "OOD sets and groups" in text and "AUPR-In" in text and "AUPR-Out" in text and "FPR@95" in text
        assert "noise (far)" in text and "far-OOD mean (noise)" in text and "ID positive" in text
        assert "OOD AUROC (letters)" in text and "(letters 60, noise 40)" in text
    assert 'id="ood-sets-table"' in html
    run = _json(smoke_shift_run / "run.json")
    inf = run["results"]["inf"]
    assert 0.0 <= inf["ood_auroc@letters"] <= 1.0 and 0.0 <= inf["ood_fpr95@far"] <= 1.0
    rules = parse_rules(["inf.ood_auroc@letters<1.01", "ood_fpr95@far>=0"])
    fired = list(check_rules(rules, run["results"]))
    assert {(e["method"], e["metric"]) for e in fired} >= {("inf", "ood_auroc@letters"), ("map", "ood_fpr95@far")}
    assert all(e["fired"] and e["ci"] is not None for e in fired)
    assert {e["n"] for e in fired if e["metric"] == "ood_auroc@letters"} == {60}  # the set's own images
    assert {e["n"] for e in fired if e["metric"] == "ood_fpr95@far"} == {40}
    cfg = load_config("smoke", [f"output={smoke_shift_run}"] + _ood_overrides(run))
    rows = run_rows(run, scan_splits(cfg, config_plan(cfg, str(smoke_shift_run))), dt.datetime.now(dt.timezone.utc))
    row = next(r for r in rows if r["method"] == "inf")
    assert row["ood_auroc@letters"] == inf["ood_auroc@letters"] and row["ood_images"] == 100
    assert row["ood_auroc@far_lo"] <= row["ood_auroc@far"] <= row["ood_auroc@far_hi"]
    import io

    import pyarrow.parquet as pq

    names = pq.read_table(io.BytesIO(_table_bytes(rows))).column_names
    assert {"ood_auroc@letters", "ood_fpr95@noise_hi", "ood_aupr_in@far_lo"} <= set(names)


def _ood_overrides(run) -> list[str]:
    """The run's own OOD settings (its config in run.json)."""
    data = run["config"]["data"]
    return [f"data.ood_limit={data['ood_limit']}", f"data.ood={json.dumps(data['ood'])}"]
