"""The job end to end: `ray job submit` against a real `ray start --head` on 127.0.0.1,
then a second (local) submission of the same job that resumes and skips every stage.

One smoke run in all (the expensive part): the cluster is started and stopped by PID
(never `ray stop`, which kills every Ray process on the machine by name).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "jobs" / "imagenet_inf.py"
STAGES = ("curvature", "posterior", "search", "evaluate", "report")
SMOKE_METHODS = ("diag", "kfac", "efb", "inf")

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    # the entrypoint's `python` is resolved on the PATH of the `ray start` process
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def ray_head():
    """`ray start --head --block` on loopback with free ports; killed by PID afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="rh", dir="/tmp"))  # short: Ray's socket paths have a length limit
    gcs, dash, agent_http, agent_grpc, runtime_env = (_free_port() for _ in range(5))
    ray_bin = str(Path(sys.executable).parent / "ray")
    log = open(tmp / "head.log", "w")
    # every port free, the agents' too: their defaults (52365, ...) are taken when another
    # Ray instance runs on this machine (e.g. the local one of tests/pipelines in the same
    # pytest session), and then the head's job agent never comes up
    proc = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", f"--port={gcs}", "--node-ip-address=127.0.0.1",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=2", f"--temp-dir={tmp}",
         f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--runtime-env-agent-port={runtime_env}", "--disable-usage-stats", "--include-dashboard=true"],
        env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    address = f"http://127.0.0.1:{dash}"
    deadline = time.time() + 180
    import urllib.request

    while True:
        try:
            with urllib.request.urlopen(f"{address}/api/version", timeout=2) as r:
                if r.status == 200:
                    break
        except Exception:
            pass
        if proc.poll() is not None or time.time() > deadline:
            log.flush()
            pytest.fail(f"ray head did not come up: {(tmp / 'head.log').read_text()[-2000:]}")
        time.sleep(1)
    yield address
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    log.close()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def submitted(ray_head, tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke") / "out"
    ray_bin = str(Path(sys.executable).parent / "ray")
    cmd = [ray_bin, "job", "submit", "--address", ray_head, "--working-dir", str(ROOT),
           "--runtime-env-json", json.dumps({"excludes": [".venv", ".git", "runs", "*.pyc"]}),
           "--", "python", "jobs/imagenet_inf.py", "--preset", "smoke", "--output", str(out)]
    t0 = time.time()
    for _ in range(40):  # the head's job agent comes up a little after the dashboard
        res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=1500)
        if res.returncode == 0 or "No available agent" not in res.stderr + res.stdout:
            break
        time.sleep(3)
    print(f"ray job submit: {time.time() - t0:.0f} s, rc={res.returncode}")
    assert res.returncode == 0, (res.stdout[-4000:], res.stderr[-3000:])
    return out, res.stdout


def test_submitted_job_writes_every_artifact(submitted):
    out, log = submitted
    assert "report at" in log
    for stage in STAGES:
        marker = json.loads((out / "stages" / f"{stage}.json").read_text())
        assert marker["stage"] == stage and marker["fingerprint"]
    run = json.loads((out / "run.json").read_text())
    assert set(run["results"]) == {"map", *SMOKE_METHODS}
    for m in ("map", *SMOKE_METHODS):
        metrics = json.loads((out / "eval" / m / "metrics.json").read_text())
        assert metrics["status"] == "ok" and 0.0 <= metrics["accuracy"] <= 1.0
        assert "ece_equal_width_15" in metrics
    from laplace_core.io import load_posterior

    for m in SMOKE_METHODS:
        post = load_posterior(str(out / "posterior" / m))
        assert post.method == m and post.num_stored() == run["posterior_sizes"][m]["numbers"]
    import pyarrow.parquet as pq

    table = pq.read_table(out / "eval" / "search.parquet")
    assert set(table.column("method").to_pylist()) == set(SMOKE_METHODS)
    html = (out / "report.html").read_text()
    assert 'id="methods-table"' in html and html.count("data:image/png;base64,") >= 3
    assert "inf" in (out / "report.md").read_text()
    # the curvature pass really ran on 2 Ray Train workers
    assert run["curvature"]["num_workers"] == 2 and run["curvature"]["count"] > 0
    # no GPU on this head: gpus_per_actor null resolves to 0, the actors ran on the CPU
    assert run["curvature"]["use_gpu"] is False
    assert run["search"]["device"] == run["evaluate"]["device"] == "cpu"


def test_second_submission_skips_every_stage(submitted):
    out, _ = submitted
    first = json.loads((out / "run.json").read_text())
    res = subprocess.run([sys.executable, str(JOB), "--preset", "smoke", "--output", str(out)],
                         env=_env(), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    for stage in STAGES:
        assert f"stage {stage}: done earlier, skipped" in res.stdout, res.stdout
    assert not re.search(r"stage \w+: running", res.stdout), res.stdout
    assert "Started a local Ray instance" not in res.stdout + res.stderr  # nothing needed the cluster
    second = json.loads((out / "run.json").read_text())
    assert second == first


def test_force_one_stage_redoes_only_it(submitted):
    out, _ = submitted
    before = json.loads((out / "stages" / "search.json").read_text())
    res = subprocess.run([sys.executable, str(JOB), "--preset", "smoke", "--output", str(out), "--force", "report",
                          "--stages", "report"], env=_env(), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "stage report: running" in res.stdout
    assert json.loads((out / "stages" / "search.json").read_text()) == before


def test_one_allreduce_per_pass_of_exactly_the_payload(submitted):
    """The smoke run at the default ``curvature.checkpoint_every_s`` (600 s, longer than the
    pass): every rank makes exactly one reduce per pass, one all-reduce call of exactly the
    payload (A and G as upper triangles + the diagonal; the EFB sums), and rank 0 writes one
    pass-1 checkpoint of that payload; asserted from run.json."""
    from laplace_core.statistics import CurvatureStatistics
    from pipelines.distributed.kinds import efb_payload_numbers, pass1_payload_numbers

    out, _ = submitted
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["curvature"]["checkpoint_every_s"] == 600.0
    shapes = [tuple(i.shape) for i in CurvatureStatistics.load(str(out / "stats" / "reduced")).infos.values()]
    passes = run["curvature"]["passes"]
    for name, payload in (("pass1", 8 * pass1_payload_numbers(shapes)), ("pass2", 8 * efb_payload_numbers(shapes))):
        ranks = passes[name]["ranks"]
        assert len(ranks) == 2, name
        for r in ranks:
            assert r["reduces"] == 1 and r["allreduce_calls"] == 1 and r["allreduce_bytes"] == payload, (name, r)
            assert min(r[k] for k in ("compute_s", "data_wait_s", "reduce_s", "write_s")) >= 0, (name, r)
    assert passes["pass1"]["ranks"][0]["bytes_written"] == 8 * pass1_payload_numbers(shapes)
    assert passes["pass2"]["ranks"][0]["bytes_written"] == 0
