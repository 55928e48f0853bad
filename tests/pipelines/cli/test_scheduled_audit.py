"""Scheduled audits that reuse and compare (issue 28, acceptance 3 and 5 for ``--reuse``), on the
shared Ray instance, with the smoke preset's sizes on the embedded demo's digits and CNN given as
one's own data and weights (``--data``, ``--weights``), the way a weekly job runs.

Two runs under one audit root (``--history ROOT``), the same weights, two data drops: week 1 on the
demo's clean test split, week 2 on a drop of the same images under Gaussian noise at severity 5
(ImageNet-C's ``c = 0.38``, :mod:`pipelines.ingest.corruptions`). Both carry ``--alert
accuracy<0.9``. Checked:

* week 2 computes no curvature pass: its ``run.json`` names week 1 as the origin of the curvature,
  posterior and search stages, its output holds no statistics and no marker of those stages, its
  posteriors and chosen ``(N, τ)`` are week 1's, and only its evaluation ran (on the new drop);
* the history ``ROOT/history/`` holds one row per method of both runs, with their data fingerprints,
  intervals and ``n``;
* week 2's report has the trend figure and the change table (week 1's, with one run, has neither);
* the alert does not fire on week 1 (exit 0, ``alerts.json`` with nothing fired) and fires on week 2
  (exit 3, ``alerts.json`` naming the rule, the value and its interval);
* a wrong ``--reuse`` is one line and exit 2 before any work: a missing URI, another model's run,
  and the same model with another posterior setting (named in the line).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import background  # tests/background.py: whole jobs beside the suite
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
JOB = ROOT / "jobs" / "imagenet_inf.py"

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RULE = "accuracy<0.9"  # the demo CNN: 96-98% on the clean test digits, 78-81% under the noise (seeded)
REUSED = ("curvature", "posterior", "search")
DEMO_NORM = ["--set", "data.mean=[0.5, 0.5, 0.5]", "--set", "data.std=[0.5, 0.5, 0.5]"]
#: fewer methods, samples, workers and actors than the preset, as tests/pipelines/serve/test_score.py: the runs'
#: cost is the point here (the two-worker pass and two-actor evaluation are tests/jobs/test_job.py's)
SMALL = ["--set", "posterior.methods=[temperature, diag, inf]", "--set", "evaluate.mc_samples=4",
         "--set", "curvature.num_workers=1", "--set", "evaluate.num_actors=1"]


def _write_inputs(base: Path) -> dict[str, Path]:
    from PIL import Image

    from pipelines.ingest.corruptions import corrupt, corruption_rng
    from pipelines.ingest.demo_data import train_small_cnn, write_digits_imagefolder, write_letters_ood

    digits = Path(write_digits_imagefolder(base / "digits", size=32, seed=0)["root"])
    write_letters_ood(base / "letters", size=32, n_per_letter=10, seed=0)
    train_small_cnn(digits, epochs=4, seed=0, cache_path=base / "model", num_threads=1)
    drop = digits / "drops" / "w2"  # week 2's data: the test images under heavy Gaussian noise
    for src in sorted((digits / "test").rglob("*.jpg")):
        rel = src.relative_to(digits / "test")
        img = np.asarray(Image.open(src).convert("RGB"))
        out = corrupt(img, "gaussian_noise", 5, corruption_rng(0, "gaussian_noise", str(rel)))
        (drop / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(out).save(drop / rel, quality=95)
    return {"data": digits, "ood": base / "letters", "weights": base / "model" / "small_cnn.safetensors"}


def _main(*args: str) -> tuple[int, str, str]:
    from pipelines.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["run", *args])
    return code, out.getvalue(), err.getvalue()


def _week(inputs: dict[str, Path], root: Path, name: str, split: str, *extra: str) -> tuple[int, str, str]:
    return _main("--preset", "smoke", "--data", str(inputs["data"]), "--ood", str(inputs["ood"]),
                 "--model", "demo_cnn", "--weights", str(inputs["weights"]), "--output", str(root / name),
                 "--history", str(root), "--alert", RULE, "--set", f"data.test_split={split}", *DEMO_NORM, *SMALL,
                 *extra)


def _week_job(inputs: dict[str, Path], root: Path, name: str, split: str) -> tuple[int, str, str]:
    """:func:`_week` as a user's scheduled job runs it: a child process (its own local Ray)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(JOB), "--preset", "smoke", "--data", str(inputs["data"]), "--ood", str(inputs["ood"]),
           "--model", "demo_cnn", "--weights", str(inputs["weights"]), "--output", str(root / name),
           "--history", str(root), "--alert", RULE, "--set", f"data.test_split={split}", *DEMO_NORM, *SMALL]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    return res.returncode, res.stdout, res.stderr


@background.job("weeks")
def _weeks_job(base: Path):
    """Weeks 1 and 2, run beside the suite (``tests/background.py``)."""
    inputs = _write_inputs(base)
    root = base / "audits"
    yield
    first = _week_job(inputs, root, "w1", "test")
    second = _week_job(inputs, root, "w2", "drops/w2")
    return {"inputs": inputs, "root": root, "w1": root / "w1", "w2": root / "w2", "first": first, "second": second}


@pytest.fixture(scope="module")
def weeks(ray_session, tmp_path_factory):  # the session's Ray: the refusals run in this process
    return background.result(_weeks_job, tmp_path_factory)


def _run_json(path: Path) -> dict:
    return json.loads((path / "run.json").read_text())


def test_second_run_takes_the_fitted_stages_and_only_evaluates(weeks):
    code, out, err = weeks["first"]
    assert code == 0, (out[-3000:], err[-3000:])
    assert _run_json(weeks["w1"])["reused"] == {}
    code, out, err = weeks["second"]
    assert code == 3, (out[-3000:], err[-3000:])
    w1, w2 = str(weeks["w1"]), str(weeks["w2"])
    run2 = _run_json(weeks["w2"])
    assert run2["reused"] == {s: w1 for s in REUSED}
    for s in REUSED:  # no pass, no posterior, no search here: nothing written for them
        assert f"stage {s}: reused from {w1}" in out
        assert not (weeks["w2"] / "stages" / f"{s}.json").exists()
    assert not (weeks["w2"] / "stats").exists() and not (weeks["w2"] / "posterior").exists()
    assert run2["timings"]["curvature"] == 0.0 and "stage curvature: running" not in out
    assert (weeks["w2"] / "stages" / "evaluate.json").exists() and "stage evaluate: running" in out
    run1 = _run_json(weeks["w1"])
    assert run2["chosen"] == run1["chosen"] and run2["chosen"]
    assert run2["data"]["test"]["split"] == "drops/w2"
    assert json.loads((weeks["w2"] / "reuse.json").read_text())["origin"] == {s: w1 for s in REUSED}
    # a reused run is a finished run for `infoform score` / load_run: its posteriors are week 1's
    from pipelines.serve.run_loader import read_run
    from pipelines.storage.store import RunStore

    info1, info2 = read_run(RunStore.open(w1)), read_run(RunStore.open(w2))
    assert info2.posterior_uris == info1.posterior_uris and all(u.startswith(w1) for u in info2.posterior_uris.values())
    assert info2.hyper == info1.hyper and info2.temperature == info1.temperature
    # the evaluation ran on the new drop: other numbers than week 1's on the same weights
    assert run2["results"]["map"]["accuracy"] < run1["results"]["map"]["accuracy"] - 0.1


def test_history_holds_both_runs_rows(weeks):
    from pipelines.report.history import read_history

    rows = read_history(str(weeks["root"])).to_pylist()
    assert len(list((weeks["root"] / "history").glob("*.parquet"))) == 2  # one object per run
    methods = set(_run_json(weeks["w1"])["results"])
    w1, w2 = str(weeks["w1"]), str(weeks["w2"])
    by_run = {r: [x for x in rows if x["run"] == r] for r in (w1, w2)}
    assert {r["method"] for r in by_run[w1]} == methods == {r["method"] for r in by_run[w2]}
    assert len(rows) == 2 * len(methods)
    assert by_run[w1][0]["date"] <= by_run[w2][0]["date"]
    assert {r["data_fingerprint"] for r in by_run[w1]} != {r["data_fingerprint"] for r in by_run[w2]}
    assert {r["reused_from"] for r in by_run[w2]} == {w1} and {r["reused_from"] for r in by_run[w1]} == {None}
    for run, rs in by_run.items():
        results = _run_json(Path(run))["results"]
        for r in rs:
            head = results[r["method"]]
            assert r["n"] == 100 and r["accuracy"] == pytest.approx(head["accuracy"], abs=1e-12)
            assert r["accuracy_lo"] <= r["accuracy"] <= r["accuracy_hi"]
            assert [r["ece_lo"], r["ece_hi"]] == pytest.approx(head["intervals"]["ci"]["ece"], abs=1e-12)


def test_report_shows_the_trend_from_the_second_run_on(weeks):
    html2 = (weeks["w2"] / "report.html").read_text(encoding="utf-8")
    png = (weeks["w2"] / "figures" / "trend.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert 'id="trend-table"' in html2 and "Since the previous run" in html2
    assert "figures/trend.png" in (weeks["w2"] / "report.md").read_text(encoding="utf-8")
    assert not (weeks["w1"] / "figures" / "trend.png").exists()
    assert 'id="trend-table"' not in (weeks["w1"] / "report.html").read_text(encoding="utf-8")


def test_alert_fires_on_the_second_drop_only(weeks):
    first = json.loads((weeks["w1"] / "alerts.json").read_text())
    assert first["rules"] == [RULE] and first["fired"] == [] and first["checked"] > 0
    second = json.loads((weeks["w2"] / "alerts.json").read_text())
    fired = second["fired"]
    assert fired and {f["rule"] for f in fired} == {RULE}
    results = _run_json(weeks["w2"])["results"]
    for f in fired:
        assert f["value"] == results[f["method"]]["accuracy"] < 0.9 and f["n"] == 100
        assert f["ci"] == pytest.approx(results[f["method"]]["intervals"]["ci"]["accuracy"])
    assert {f["method"] for f in fired} == set(results)  # every method lost accuracy on the noisy drop
    assert f"alert: {RULE} fired for map: accuracy = " in weeks["second"][1]


def _one_line_refusal(code: int, err: str, out_dir: Path, *needles: str) -> None:
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "Traceback" not in err and all(n in lines[0] for n in needles), lines[0]
    assert not (out_dir / "stages").exists()


def test_reuse_of_a_missing_run_is_refused_in_one_line(weeks, tmp_path):
    inputs, missing = weeks["inputs"], tmp_path / "no-such-run"
    code, _, err = _main("--preset", "smoke", "--data", str(inputs["data"]), "--model", "demo_cnn",
                         "--weights", str(inputs["weights"]), "--output", str(tmp_path / "out"),
                         "--reuse", str(missing), *DEMO_NORM)
    _one_line_refusal(code, err, tmp_path / "out", f"--reuse {missing}", "not found")
    assert not (tmp_path / "out" / "config.json").exists()  # refused in preflight, before the run began


def test_reuse_of_another_models_run_is_refused_in_one_line(weeks, tmp_path):
    import torch

    from pipelines.ingest.models import tiny_cnn

    inputs = weeks["inputs"]
    torch.save(tiny_cnn(10).state_dict(), tmp_path / "tiny.pt")
    code, _, err = _main("--preset", "smoke", "--data", str(inputs["data"]), "--model", "tiny_cnn",
                         "--weights", str(tmp_path / "tiny.pt"), "--output", str(tmp_path / "out"),
                         "--reuse", str(weeks["w1"]), *DEMO_NORM)
    _one_line_refusal(code, err, tmp_path / "out", "a run of model 'demo_cnn'", "'tiny_cnn'")
    assert not (tmp_path / "out" / "config.json").exists()  # refused in preflight, before the run began


def test_reuse_with_other_posterior_settings_is_refused_before_cluster_work(weeks, tmp_path):
    inputs = weeks["inputs"]
    code, out, err = _main("--preset", "smoke", "--data", str(inputs["data"]), "--ood", str(inputs["ood"]),
                           "--model", "demo_cnn", "--weights", str(inputs["weights"]), "--output",
                           str(tmp_path / "out"), "--reuse", str(weeks["w1"]), "--set", "posterior.rank=5", *DEMO_NORM,
                           *SMALL)
    _one_line_refusal(code, err, tmp_path / "out", f"--reuse {weeks['w1']}", "rank: 20 there, 5 here")
    assert "stage " not in out


def test_reuse_of_a_run_made_with_other_weights_is_refused_in_one_line(weeks, tmp_path):
    """The same model name, other weights' bytes: refused in preflight (the path alone never decides)."""
    import torch

    from pipelines.ingest.demo_data import small_cnn

    inputs = weeks["inputs"]
    torch.save(small_cnn(10, seed=1).state_dict(), tmp_path / "retrained.pt")
    code, _, err = _main("--preset", "smoke", "--data", str(inputs["data"]), "--model", "demo_cnn",
                         "--weights", str(tmp_path / "retrained.pt"), "--output", str(tmp_path / "out"),
                         "--reuse", str(weeks["w1"]), *DEMO_NORM)
    _one_line_refusal(code, err, tmp_path / "out", f"--reuse {weeks['w1']}: made with other weights")
    assert not (tmp_path / "out" / "config.json").exists()
