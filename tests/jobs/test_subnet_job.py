"""Issue 6, acceptance point 5: the job runs ``--methods subnet --pred-type glm`` on the smoke
preset and reports it; then the same output re-evaluated with ``--pred-type nn`` (search,
evaluate and report forced; the curvature stage, with its subnet pass, is skipped).

Each command starts its own local Ray (``RAY_ADDRESS`` emptied), as a user's would. Sized to what
is asserted (issue 43): two search configurations and few MC samples on one evaluation actor (the
preset's 4 configurations, 4 / 8 samples and 2 actors change no assertion here); the curvature
stage keeps the preset's sizes (S = 500, 200 images, 2 workers are asserted).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import background  # tests/background.py: whole jobs beside the suite
import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "jobs" / "imagenet_inf.py"

pytestmark = [pytest.mark.ray, pytest.mark.slow]
#: the same in both runs (the curvature stage's fingerprint must not change between them)
SMALL = ("--set", "search.num_configs=2", "--set", "search.mc_samples=2", "--set", "evaluate.mc_samples=2",
         "--set", "evaluate.num_actors=1")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAY_ADDRESS="", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled",
               PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(JOB), "--preset", "smoke", "--methods", "subnet", *SMALL, *args],
                          capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)


@background.job("glm_run")
def _glm_job(base: Path):
    """``--pred-type glm``, run beside the suite (``tests/background.py``)."""
    out = base / "out"
    yield
    res = _run("--pred-type", "glm", "--output", str(out))
    assert res.returncode == 0, f"rc {res.returncode}\nstdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-3000:]}"
    return out, res.stdout


@pytest.fixture(scope="module")
def glm_run(tmp_path_factory):
    return background.result(_glm_job, tmp_path_factory)


def test_subnet_glm_job_reports_subnet(glm_run):
    out, log = glm_run
    assert "report at" in log and "[subnet] S = 500 of" in log
    run = json.loads((out / "run.json").read_text())
    assert set(run["results"]) == {"map", "subnet"}
    head = run["results"]["subnet"]
    assert head["status"] == "ok" and 0.0 <= head["accuracy"] <= 1.0 and head["nll"] > 0
    assert 0.0 <= head["ood_auroc"] <= 1.0 and head["n_data"] > 0 and head["prior_precision"] > 0
    metrics = json.loads((out / "eval" / "subnet" / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["pred_type"] == "glm" and "ece_equal_width_15" in metrics
    # the subnet pass: S from the smoke preset, exact GGN (10 classes), every training image once
    sub = run["curvature"]["subnet"]
    assert sub["subnet_size"] == 500 and sub["fisher"] == "ggn" and sub["computed"]
    assert sub["count"] == run["curvature"]["count"] == 200 and sum(sub["per_layer"].values()) == 500
    assert run["curvature"]["num_workers"] == 2
    from laplace_core.posteriors.structures.base import load_posterior

    post = load_posterior(str(out / "posterior" / "subnet"))
    S = 500
    assert post.method == "subnet" and post.num_stored() == run["posterior_sizes"]["subnet"]["numbers"]
    assert post.num_stored() == S * (S + 1) // 2 + S
    assert (out / "stats" / "subnet" / "manifest.json").exists()
    assert "subnet" in run["chosen"]  # the (N, tau) search ran for it
    md = (out / "report.md").read_text()
    assert "| Subnet |" in md and "S = 500 of" in md
    html = (out / "report.html").read_text()
    assert 'id="methods-table"' in html and "Subnet" in html


def test_nn_predictive_reuses_the_subnet_pass(glm_run):
    out, _ = glm_run
    res = _run("--pred-type", "nn", "--output", str(out), "--stages", "search,evaluate,report",
               "--force", "search,evaluate,report")
    assert res.returncode == 0, f"rc {res.returncode}\nstdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-3000:]}"
    assert "stage curvature: running" not in res.stdout and "[subnet] S =" not in res.stdout
    metrics = json.loads((out / "eval" / "subnet" / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["pred_type"] == "nn" and 0.0 <= metrics["accuracy"] <= 1.0
    run = json.loads((out / "run.json").read_text())
    assert run["results"]["subnet"]["status"] == "ok"
