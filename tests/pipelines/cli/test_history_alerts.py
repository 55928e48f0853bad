"""The parts of a scheduled audit that need no cluster (fast): alert rules (parsing, checking,
``alerts.json`` and the exit code), the history (append, replace on re-submission, on a
local folder and on S3 through moto's server), the trend figure and change table, the reuse keys'
difference line, and the ``--alert`` / ``--reuse`` refusals of preflight (one line, exit 2).
The runs themselves are in tests/pipelines/cli/test_scheduled_audit.py."""
from __future__ import annotations

import datetime as dt
import json
from types import SimpleNamespace

import pytest

T0 = dt.datetime(2026, 11, 2, 3, 0, tzinfo=dt.timezone.utc)


def _head(acc: float, ece: float, n: int = 200) -> dict:
    return {"status": "ok", "accuracy": acc, "ece": ece, "nll": 0.5,
            "intervals": {"n": n, "n_ood": 0, "ci": {"accuracy": [acc - 0.02, acc + 0.02], "ece": [ece / 2, ece * 2]}}}


def _summary(output: str, acc: float, ece: float) -> dict:
    return {"output": output, "model": {"name": "resnet50"}, "reused": {},
            "results": {"map": _head(acc, ece), "inf": _head(acc, ece / 2)}}


def _splits(test_fp: str, n: int = 200):
    return SimpleNamespace(test=_Sized(test_fp, n), ood=None)


class _Sized:
    def __init__(self, fp: str, n: int):
        self.fingerprint, self._n = fp, n

    def __len__(self) -> int:
        return self._n


# --------------------------------------------------------------------------- alerts
def test_rules_parse_and_bad_rules_are_one_line_naming_the_metrics():
    from pipelines.cli.alerts import metric_names, parse_rules

    rules = parse_rules(["ece>0.05", " accuracy < 0.70", "inf.ood_auroc<=0.8"])
    assert [(r.method, r.metric, r.op, r.threshold) for r in rules] == [
        (None, "ece", ">", 0.05), (None, "accuracy", "<", 0.70), ("inf", "ood_auroc", "<=", 0.8)]
    for bad, needle in (("ecee>0.05", "unknown metric 'ecee'"), ("ece=0.05", "not a rule"),
                        ("ece>", "not a rule"), ("foo.ece>1", "unknown method 'foo'")):
        with pytest.raises(ValueError) as e:
            parse_rules([bad])
        assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError) as e:
        parse_rules(["ecee>0.05"])
    assert ", ".join(metric_names()) in str(e.value)


def test_rules_fire_per_method_and_write_alerts_json(tmp_path):
    from pipelines.cli.alerts import ALERT_EXIT_CODE, finish

    lines: list[str] = []
    summary = _summary(str(tmp_path), acc=0.65, ece=0.08)
    rules = ["ece>0.05", "accuracy<0.70", "map.nll>1", "ood_auroc<0.8"]
    code = finish(rules, summary, str(tmp_path), log=lines.append)
    assert code == ALERT_EXIT_CODE == 3
    doc = json.loads((tmp_path / "alerts.json").read_text())
    fired = {(f["rule"], f["method"]) for f in doc["fired"]}
    # ece: map 0.08 > 0.05 fires, inf 0.04 does not; accuracy fires for both; nll 0.5 does not
    assert fired == {("ece>0.05", "map"), ("accuracy<0.70", "map"), ("accuracy<0.70", "inf")}
    assert doc["checked"] == 5 and doc["unchecked"] == ["ood_auroc<0.8"]
    ece = next(f for f in doc["fired"] if f["rule"] == "ece>0.05")
    assert ece["value"] == 0.08 and ece["ci"] == [0.04, 0.16] and ece["n"] == 200
    assert "alert: ece>0.05 fired for map: ece = 0.08 [0.04, 0.16], n = 200" in lines
    assert finish(["ece>0.5"], summary, str(tmp_path), log=lines.append) == 0
    assert json.loads((tmp_path / "alerts.json").read_text())["fired"] == []
    assert finish([], summary, str(tmp_path / "none"), log=lines.append) == 0
    assert not (tmp_path / "none").exists()


def test_audit_listing_rules_name_the_model(tmp_path):
    from pipelines.cli.alerts import finish

    listing = {"models": {"a": {"results": {"map": _head(0.9, 0.01)}}, "b": {"results": {"map": _head(0.5, 0.01)}}}}
    assert finish(["accuracy<0.7"], listing, str(tmp_path), log=lambda s: None) == 3
    fired = json.loads((tmp_path / "alerts.json").read_text())["fired"]
    assert [(f["model"], f["method"]) for f in fired] == [("b", "map")]


# --------------------------------------------------------------------------- history
def _append_twice(root: str, store=None):
    from pipelines.report.history import append_run, read_history

    append_run(root, _summary("runs/w1", 0.90, 0.02), _splits("aaa"), store, when=T0, log=lambda s: None)
    append_run(root, _summary("runs/w2", 0.85, 0.03), _splits("bbb"), store, when=T0 + dt.timedelta(days=7),
               log=lambda s: None)
    return read_history(root, store).to_pylist()


def test_history_appends_rows_and_a_resubmission_replaces_its_own(tmp_path):
    from pipelines.report.history import append_run, read_history

    rows = _append_twice(str(tmp_path))
    assert [(r["run"], r["method"]) for r in rows] == [("runs/w1", "map"), ("runs/w1", "inf"),
                                                       ("runs/w2", "map"), ("runs/w2", "inf")]
    r = rows[2]
    assert (r["accuracy"], r["accuracy_lo"], r["accuracy_hi"], r["n"], r["test_images"]) == (0.85, 0.83, 0.87, 200, 200)
    assert r["ece_lo"] == 0.015 and r["ood_auroc"] is None and r["date"] == T0 + dt.timedelta(days=7)
    assert rows[0]["data_fingerprint"] != rows[2]["data_fingerprint"]
    # week 2 submitted again: its rows replaced, not duplicated
    append_run(str(tmp_path), _summary("runs/w2", 0.84, 0.03), _splits("bbb"), when=T0 + dt.timedelta(days=8),
               log=lambda s: None)
    rows = read_history(str(tmp_path)).to_pylist()
    assert len(rows) == 4 and [r["accuracy"] for r in rows if r["run"] == "runs/w2"] == [0.84, 0.84]
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]  # the atomic write left no temp file
    assert len(list((tmp_path / "history").iterdir())) == 2  # one object per run (and model)


def test_history_on_s3(s3_bucket):
    from pipelines.storage.uris import StorageOptions

    bucket, endpoint = s3_bucket
    rows = _append_twice(f"{bucket}/audits", StorageOptions(endpoint).resolved())
    assert len(rows) == 4 and {r["run"] for r in rows} == {"runs/w1", "runs/w2"}


def test_trend_figure_and_change_table_from_two_runs(tmp_path):
    from pipelines.report.history import trend_parts

    out = tmp_path / "w2"
    assert trend_parts(None, str(out), "resnet50") == ({}, [])
    _append_twice(str(tmp_path))
    assert trend_parts(str(tmp_path), str(out), "densenet121") == ({}, [])  # no runs of that model
    figures, sections = trend_parts(str(tmp_path), "runs/w2", "resnet50")
    png = open(figures["trend"], "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    table = sections[0].table
    row = next(r for r in table.rows if r[0] == "MAP" and r[1] == "Accuracy")
    assert row[2].startswith("85.0%") and row[3].startswith("-5.0 pts") and row[4].startswith("-5.0 pts")


def test_audit_page_finds_each_models_trend(tmp_path):
    from pipelines.report.history import audit_trends, trend_parts

    _append_twice(str(tmp_path / "root"))
    figures, _ = trend_parts(str(tmp_path / "root"), str(tmp_path / "audit" / "models" / "resnet50"), "resnet50")
    assert audit_trends(str(tmp_path / "audit"), ["resnet50", "resnet18"]) == {"resnet50": figures}


# --------------------------------------------------------------------------- reuse
def test_first_difference_names_the_setting():
    from pipelines.cli.reuse import first_difference

    a = {"model": {"name": "m", "weights": "sha256:1"}, "posterior": {"rank": 20, "n_data": None}, "train": "x"}
    assert first_difference(a, json.loads(json.dumps(a))) is None
    b = {**a, "posterior": {"rank": 5, "n_data": None}}
    assert first_difference(a, b) == "posterior.rank: 20 there, 5 here"
    assert first_difference(a, {**a, "train": "y"}).startswith("the curvature data (train split listing)")


def test_weights_identity_is_the_bytes_not_the_path(tmp_path):
    from pipelines.cli.reuse import weights_identity

    (tmp_path / "a.pt").write_bytes(b"weights")
    (tmp_path / "b.pt").write_bytes(b"weights")
    assert weights_identity(str(tmp_path / "a.pt")) == weights_identity(str(tmp_path / "b.pt"))
    (tmp_path / "b.pt").write_bytes(b"retrained")
    assert weights_identity(str(tmp_path / "a.pt")) != weights_identity(str(tmp_path / "b.pt"))
    assert weights_identity(None) is None and weights_identity("random") == "random"


@pytest.mark.parametrize("flags, needle", [
    (["--alert", "ecee>0.05"], "unknown metric 'ecee'; valid: accuracy, nll, ece"),
    (["--alert", "ece=0.05"], "not a rule"),
    (["--reuse", "runs/x", "--force", "curvature"], "drop --force curvature or --reuse"),
])
def test_bad_schedule_flags_are_one_line_exit_2(flags, needle, capsys, tmp_path):
    from pipelines.cli.main import main

    assert main(["run", "--preset", "smoke", "--output", str(tmp_path / "o"), "--dry-run", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def _fake_run(run_dir, keys: dict, written_at: str, origin=None) -> None:
    """A run folder as reuse reads it: reuse.json and the three stage markers (their content unused)."""
    for stage in ("curvature", "posterior", "search"):
        (run_dir / "stages").mkdir(parents=True, exist_ok=True)
        (run_dir / "stages" / f"{stage}.json").write_text("{}")
    origin = str(origin or run_dir)
    (run_dir / "reuse.json").write_text(json.dumps({"keys": keys, "written_at": written_at,
                                                    "origin": {s: origin for s in ("curvature", "posterior", "search")}}))


def test_auto_reuse_takes_the_newest_matching_run_under_the_root(tmp_path):
    from pipelines.cli.reuse import REUSED_STAGES, history_source
    from pipelines.cli.stages import fingerprint

    keyed = {s: {"stage": s, "model": {"weights": "sha256:1"}} for s in REUSED_STAGES}
    keys = {s: fingerprint(keyed[s]) for s in REUSED_STAGES}
    other = {**keys, "posterior": "0" * 16}
    _fake_run(tmp_path / "w1", keys, "2026-11-02T03:00:00+00:00")
    _fake_run(tmp_path / "w2", keys, "2026-11-09T03:00:00+00:00", origin=tmp_path / "w1")  # reused w1 itself
    _fake_run(tmp_path / "w3", other, "2026-11-16T03:00:00+00:00")  # other posterior settings: never taken
    out = str(tmp_path / "w4")
    assert history_source(str(tmp_path), out, "m", False, keyed, None) == str(tmp_path / "w1")
    _fake_run(tmp_path / "w5", keys, "2026-11-23T03:00:00+00:00")  # computed again later: the newest wins
    assert history_source(str(tmp_path), out, "m", False, keyed, None) == str(tmp_path / "w5")
    assert history_source(str(tmp_path), str(tmp_path / "w5"), "m", False, keyed, None) == str(tmp_path / "w1")
    (tmp_path / "w5" / "stages" / "search.json").unlink()  # an origin missing a stage is not taken
    assert history_source(str(tmp_path), out, "m", False, keyed, None) == str(tmp_path / "w1")
    # an audit of several models: each model's folder under models/<name>
    _fake_run(tmp_path / "a1" / "models" / "m", keys, "2026-11-30T03:00:00+00:00")
    assert history_source(str(tmp_path), out, "m", True, keyed, None) == str(tmp_path / "a1" / "models" / "m")
    assert history_source(str(tmp_path / "empty"), out, "m", False, keyed, None) is None
