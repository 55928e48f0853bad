"""The job end to end on S3-compatible storage: `ray job submit` against a real
`ray start --head` on 127.0.0.1, with the data, the OOD set, the weights and the output all
in a bucket on moto's S3 server (127.0.0.1) and the endpoint given only as `--endpoint-url`
(no AWS_ENDPOINT_URL* anywhere in the environment); then a second (local) submission of the
same job that resumes and skips every stage, and a forced stage.

The head and the job run with a recognisable AWS secret key; every log of the head and the
job and every object in the bucket are searched for it at the end.

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
import uuid
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


#: The AWS secret key of the head and the job: must never appear in a log or an artifact.
#: Made at run time, so that the uploaded copy of this file does not contain it.
SECRET = "sk" + uuid.uuid4().hex + uuid.uuid4().hex[:8]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1",
               AWS_SECRET_ACCESS_KEY=SECRET)
    env.pop("RAY_ADDRESS", None)
    assert not any(k.startswith("AWS_ENDPOINT_URL") for k in env), "the endpoint must come from the flag alone"
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
    yield address, tmp
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    log.close()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def s3_inputs(moto_s3, tmp_path_factory):
    """A bucket holding the demo's digits (a class-balanced cut, as the smoke preset reads
    them), the rendered letters (OOD) and the demo CNN's trained weights; returns
    ``(bucket URI, endpoint, job arguments)``."""
    import boto3
    import s3fs

    from pipelines.demo_data import train_small_cnn, write_digits_imagefolder, write_letters_ood

    local = tmp_path_factory.mktemp("s3in")
    digits = write_digits_imagefolder(local / "digits", size=32, seed=0)
    write_letters_ood(local / "letters", size=32, n_per_letter=10, seed=0)
    _, _ = train_small_cnn(digits["root"], epochs=8, seed=0, cache_path=local / "model", num_threads=1)
    bucket = f"job-{os.getpid()}-{int(time.time())}"
    boto3.client("s3", endpoint_url=moto_s3, region_name="us-east-1").create_bucket(Bucket=bucket)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": moto_s3})
    keep = {"train": 24, "val": 12, "test": 12}  # the smoke preset reads 20 / 100 / 100 of them
    for split, n in keep.items():
        for cls in sorted(p.name for p in (local / "digits" / split).iterdir()):
            for f in sorted((local / "digits" / split / cls).iterdir())[:n]:
                fs.put_file(str(f), f"{bucket}/data/digits/{split}/{cls}/{f.name}")
    fs.put(str(local / "letters"), f"{bucket}/data/letters", recursive=True)
    fs.put_file(str(local / "model" / "small_cnn.safetensors"), f"{bucket}/models/small_cnn.safetensors")
    b = f"s3://{bucket}"
    args = ["--preset", "smoke", "--data", f"{b}/data/digits", "--ood", f"{b}/data/letters", "--model", "demo_cnn",
            "--weights", f"{b}/models/small_cnn.safetensors", "--output", f"{b}/out", "--endpoint-url", moto_s3]
    return b, moto_s3, args


@pytest.fixture(scope="module")
def submitted(ray_head, s3_inputs):
    address, _ = ray_head
    bucket, endpoint, args = s3_inputs
    ray_bin = str(Path(sys.executable).parent / "ray")
    cmd = [ray_bin, "job", "submit", "--address", address, "--working-dir", str(ROOT),
           "--runtime-env-json", json.dumps({"excludes": [".venv", ".git", "runs", "*.pyc"]}),
           "--", "python", "jobs/imagenet_inf.py", *args]
    t0 = time.time()
    for _ in range(40):  # the head's job agent comes up a little after the dashboard
        res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=1500)
        if res.returncode == 0 or "No available agent" not in res.stderr + res.stdout:
            break
        time.sleep(3)
    print(f"ray job submit: {time.time() - t0:.0f} s, rc={res.returncode}")
    assert res.returncode == 0, (res.stdout[-4000:], res.stderr[-3000:])
    return f"{bucket}/out", endpoint, args, res.stdout + res.stderr


def _json(uri: str, endpoint: str):
    from pipelines import storage

    return storage.read_json(uri, endpoint)


def _text(uri: str, endpoint: str) -> str:
    from pipelines import storage

    return storage.read_bytes(uri, endpoint).decode("utf-8")


def test_submitted_job_writes_every_artifact(submitted):
    out, ep, _, log = submitted
    assert "report at" in log and f"{out}/report.html" in log
    for stage in STAGES:
        marker = _json(f"{out}/stages/{stage}.json", ep)
        assert marker["stage"] == stage and marker["fingerprint"]
    run = _json(f"{out}/run.json", ep)
    assert set(run["results"]) == {"map", *SMOKE_METHODS}
    for m in ("map", *SMOKE_METHODS):
        metrics = _json(f"{out}/eval/{m}/metrics.json", ep)
        assert metrics["status"] == "ok" and 0.0 <= metrics["accuracy"] <= 1.0
        assert "ece_equal_width_15" in metrics
    from laplace_core.io import load_posterior
    from pipelines import storage

    for m in SMOKE_METHODS:
        uri = f"{out}/posterior/{m}"
        post = load_posterior(uri, storage.fsspec_options(uri, ep))
        assert post.method == m and post.num_stored() == run["posterior_sizes"][m]["numbers"]
    import io

    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(storage.read_bytes(f"{out}/eval/search.parquet", ep)))
    assert set(table.column("method").to_pylist()) == set(SMOKE_METHODS)
    html = _text(f"{out}/report.html", ep)
    assert 'id="methods-table"' in html and html.count("data:image/png;base64,") >= 3
    assert "inf" in _text(f"{out}/report.md", ep)
    # the curvature pass really ran on 2 Ray Train workers, reading the bucket
    assert run["curvature"]["num_workers"] == 2 and run["curvature"]["count"] > 0
    # no GPU on this head: gpus_per_actor null resolves to 0, the actors ran on the CPU
    assert run["curvature"]["use_gpu"] is False
    assert run["search"]["device"] == run["evaluate"]["device"] == "cpu"
    # the endpoint travelled in the config (and only the endpoint: no credentials)
    config = _json(f"{out}/config.json", ep)
    assert config["storage"]["endpoint_url"] == ep and config["data"]["root"].startswith("s3://")


def test_second_submission_skips_every_stage(submitted):
    out, ep, args, _ = submitted
    first = _json(f"{out}/run.json", ep)
    res = subprocess.run([sys.executable, str(JOB), *args], env=_env(), capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    for stage in STAGES:
        assert f"stage {stage}: done earlier, skipped" in res.stdout, res.stdout
    assert not re.search(r"stage \w+: running", res.stdout), res.stdout
    assert "Started a local Ray instance" not in res.stdout + res.stderr  # nothing needed the cluster
    assert _json(f"{out}/run.json", ep) == first


def test_force_one_stage_redoes_only_it(submitted):
    out, ep, args, _ = submitted
    before = _json(f"{out}/stages/search.json", ep)
    res = subprocess.run([sys.executable, str(JOB), *args, "--force", "report", "--stages", "report"],
                         env=_env(), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "stage report: running" in res.stdout
    assert _json(f"{out}/stages/search.json", ep) == before


def test_no_secret_in_any_log_or_artifact(submitted, ray_head):
    """Runs last in this module: every file under the head's temp dir (Ray's and the job's
    logs) and every object in the bucket, searched for the secret key (and its base64)."""
    import base64

    import s3fs

    out, ep, _, log = submitted
    _, head_tmp = ray_head
    needles = [SECRET.encode(), base64.b64encode(SECRET.encode())[:24]]
    assert not any(n in log.encode() for n in needles)
    scanned = 0
    for path in head_tmp.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                data = path.read_bytes()
            except OSError:
                continue
            scanned += 1
            assert not any(n in data for n in needles), f"the secret key is in {path}"
    assert scanned > 10, f"only {scanned} files under {head_tmp}: where did Ray log?"
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": ep})
    keys = fs.find(out.split("://", 1)[1])
    assert len(keys) > 20
    for key in keys:
        data = fs.cat_file(key)
        assert not any(n in data for n in needles), f"the secret key is in s3://{key}"
