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
import shlex
import shutil
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
SMOKE_ROWS = ("temperature", *SMOKE_METHODS)  # every preset evaluates temperature scaling too (issue 27)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks import soak  # noqa: E402  the soak's probe (issue 41)

#: The long-lived cluster of this module: its GCS address, temp dir, state before the first job
#: and after each (the suite's short soak, issue 41: benchmarks/soak.py runs 20).
CLUSTER: dict = {}
#: Ray Data's cluster-wide detached actors (named, ``get_if_exists``), made by the first job that
#: uses Ray Data (the location tracker by the first that maps with an actor pool) and reused by
#: later jobs: not an ended job's own, but never more than one of each.
RAY_DATA_SINGLETONS = {"_StatsActor", "_AutoscalingCoordinatorActor", "ActorLocationTracker",
                       "_UsageCollectionActor"}


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


def _start(cmd, env, log, *, namespace_hides=()):
    """A `ray start --block` process in its own process group (killed by PID); with
    ``namespace_hides``, in a new mount namespace with a private tmpfs over each of those
    folders, so that its processes cannot see what the driver has there."""
    if namespace_hides:
        mounts = " && ".join(f"mount -t tmpfs none {shlex.quote(str(d))}" for d in namespace_hides)
        cmd = ["unshare", "--mount", "--propagation", "private", "bash", "-c",
               f"{mounts} && exec {' '.join(shlex.quote(c) for c in cmd)}"]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)



@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A real cluster's shape on one machine: `ray start --head --num-cpus=0` (the driver runs
    there, nothing else) and a worker node with 2 CPUs in its own mount namespace, where the
    driver's local folders (pytest's temporary folders, the demo's staging cache) are private
    empty tmpfs: a local path handed to a worker is not there. Both on loopback with free
    ports, started and killed by PID (never `ray stop`)."""
    tmp = Path(tempfile.mkdtemp(prefix="rh", dir="/tmp"))  # short: Ray's socket paths have a length limit
    ports = [_free_port() for _ in range(9)]
    gcs, dash = ports[0], ports[1]
    ray_bin = str(Path(sys.executable).parent / "ray")
    env = {**_env(), **soak.NODE_ENV, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}  # several nodes on one machine
    hidden = [tmp_path_factory.getbasetemp(), Path.home() / ".cache" / "infoform"]
    for d in hidden:
        d.mkdir(parents=True, exist_ok=True)
    log = open(tmp / "nodes.log", "w")
    # every port free, the agents' too: their defaults (52365, ...) are taken when another
    # Ray instance runs on this machine (e.g. the local one of tests/pipelines in the same
    # pytest session), and then the head's job agent never comes up
    head = _start([ray_bin, "start", "--head", "--block", f"--port={gcs}", "--node-ip-address=127.0.0.1",
                   "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=0", f"--temp-dir={tmp}",
                   f"--dashboard-agent-listen-port={ports[2]}", f"--dashboard-agent-grpc-port={ports[3]}",
                   f"--runtime-env-agent-port={ports[4]}", "--disable-usage-stats", "--include-dashboard=true"],
                  env, log)
    address = f"http://127.0.0.1:{dash}"
    procs = [head]
    try:
        _wait_for(lambda: _dashboard_up(address), head, tmp, "the head")
        # its own temp dir, as on a cluster of machines: without it the node takes the head's, and
        # its runtime-env agent unpacks the job's working dir into the same runtime_resources
        # folder, removing the head's copy first while the driver imports from it
        # (ModuleNotFoundError in a lazy import, twice in CI)
        worker = _start([ray_bin, "start", f"--address=127.0.0.1:{gcs}", "--node-ip-address=127.0.0.1", "--block",
                         "--num-cpus=2", "--disable-usage-stats", f"--temp-dir={tmp / 'w'}", f"--dashboard-agent-listen-port={ports[5]}",
                         f"--dashboard-agent-grpc-port={ports[6]}", f"--runtime-env-agent-port={ports[7]}",
                         f"--metrics-export-port={ports[8]}"], env, log, namespace_hides=hidden)
        procs.append(worker)
        _wait_for(lambda: _alive_nodes(ray_bin, gcs, env) == 2, worker, tmp, "the worker node")
        CLUSTER.update(gcs=f"127.0.0.1:{gcs}", tmp=tmp, baseline=soak.probe(f"127.0.0.1:{gcs}", tmp), after=[])
        yield address, tmp
    finally:
        for p in reversed(procs):
            soak.stop_head(p)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _dashboard_up(address: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{address}/api/version", timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def _alive_nodes(ray_bin: str, gcs: int, env) -> int:
    res = subprocess.run([ray_bin, "status", "--address", f"127.0.0.1:{gcs}"], env=env, capture_output=True,
                         text=True, timeout=60)
    return res.stdout.count(" node_")


def _wait_for(ok, proc, tmp: Path, what: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not ok():
        if proc.poll() is not None or time.time() > deadline:
            pytest.fail(f"{what} did not come up: {(tmp / 'nodes.log').read_text()[-2000:]}")
        time.sleep(1)


@pytest.fixture(scope="module")
def s3_inputs(moto_s3, tmp_path_factory):
    """A bucket holding the demo's digits (a class-balanced cut, as the smoke preset reads
    them), the rendered letters (OOD) and the demo CNN's trained weights; returns
    ``(bucket URI, endpoint, job arguments)``."""
    import boto3
    import s3fs

    from pipelines.ingest.demo_data import train_small_cnn, write_digits_imagefolder, write_letters_ood

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
    entry = ["python", "jobs/imagenet_inf.py", "--preset", "smoke", "--output", f"{b}/out", "--endpoint-url", moto_s3,
             "--data", f"{b}/data/digits", "--ood", f"{b}/data/letters", "--model", "demo_cnn",
             "--weights", f"{b}/models/small_cnn.safetensors"]  # README's cluster command, inputs in the bucket
    return b, moto_s3, entry[2:]


def _submit(address: str, args: list[str]):
    """`ray job submit --working-dir .` of the job with ``args``; the CompletedProcess."""
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
    print(f"ray job submit {' '.join(args[:2])}: {time.time() - t0:.0f} s, rc={res.returncode}")
    if CLUSTER.get("gcs"):
        CLUSTER["after"].append((" ".join(args[:4]), _settled_state()))
    return res


def _settled_state(timeout: float = 30.0) -> dict:
    """The cluster's state after a job (``benchmarks/soak.py``'s probe), polled until it is back
    at the baseline or ``timeout`` passed (an ended job's workers take a moment to exit)."""
    deadline = time.time() + timeout
    while True:
        state = soak.probe(CLUSTER["gcs"], CLUSTER["tmp"])
        if not _leaks(state) or time.time() > deadline:
            return state
        time.sleep(2)


def _leaks(state: dict) -> list[str]:
    """What an ended job left held, against the baseline: CPUs, object-store bytes, actors
    (but Ray Data's two detached cluster-wide singletons), placement groups."""
    base = CLUSTER["baseline"]
    if "probe_failed" in state:
        return [f"the probe failed: {state['probe_stderr'][-300:]}"]
    out = []
    if state["cpu_available"] != base["cpu_available"]:
        out.append(f"CPUs available {state['cpu_available']} of {base['cpu_available']}")
    if state["object_store_available"] != base["object_store_available"]:
        out.append(f"object store {base['object_store_available'] - state['object_store_available']:.0f} bytes "
                   f"held ({state['plasma_objects']} objects)")
    alive = state["actors_alive"]
    actors = [a for a in alive if a not in RAY_DATA_SINGLETONS or alive.count(a) > 1]
    if actors:
        out.append(f"live actors {actors}")
    if state["pgs_live"]:
        out.append(f"live placement groups {state['pgs_live']}")
    return out


@pytest.fixture(scope="module")
def submitted(ray_head, s3_inputs):
    address, _ = ray_head
    bucket, endpoint, args = s3_inputs
    res = _submit(address, args)
    assert res.returncode == 0, f"rc {res.returncode}\nstdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-3000:]}"
    return f"{bucket}/out", endpoint, args, res.stdout + res.stderr


def _json(uri: str, endpoint: str):
    from pipelines.storage import uris as storage

    return storage.read_json(uri, endpoint)


def _text(uri: str, endpoint: str) -> str:
    from pipelines.storage import uris as storage

    return storage.read_bytes(uri, endpoint).decode("utf-8")


def test_submitted_job_writes_every_artifact(submitted):
    out, ep, _, log = submitted
    assert "report at" in log and f"{out}/report.html" in log
    # the driver's node declares no CPU: every pass, task and actor ran on the worker node
    assert "cluster: 2 node(s), 2 CPUs, 0 GPUs (0 CPUs beside the driver)" in log, log[-3000:]
    for stage in STAGES:
        marker = _json(f"{out}/stages/{stage}.json", ep)
        assert marker["stage"] == stage and marker["fingerprint"]
    run = _json(f"{out}/run.json", ep)
    assert set(run["results"]) == {"map", *SMOKE_ROWS}
    for m in ("map", *SMOKE_ROWS):
        metrics = _json(f"{out}/eval/{m}/metrics.json", ep)
        assert metrics["status"] == "ok" and 0.0 <= metrics["accuracy"] <= 1.0
        assert "ece_equal_width_15" in metrics
    from laplace_core.posteriors.structures.base import load_posterior
    from pipelines.storage import uris as storage

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
    # the report is rendered in the driver from the stored results: no Ray instance is started for it
    assert "cluster: connecting" not in res.stdout and "Started a local Ray instance" not in res.stdout + res.stderr


def test_one_allreduce_per_pass_of_exactly_the_payload(submitted):
    """The smoke run at the default ``curvature.checkpoint_every_s`` (600 s, longer than the
    pass): every rank makes exactly one reduce per pass, one all-reduce call of exactly the
    payload (A and G as upper triangles + the diagonal; the EFB sums), and rank 0 writes one
    pass-1 checkpoint of that payload; asserted from run.json."""
    from laplace_core.curvature.statistics import CurvatureStatistics
    from pipelines.storage import uris as storage
    from pipelines.distributed.kinds import efb_payload_numbers, pass1_payload_numbers

    out, ep, _, _ = submitted
    run = _json(f"{out}/run.json", ep)
    assert run["config"]["curvature"]["checkpoint_every_s"] == 600.0
    shapes = [tuple(i.shape) for i in CurvatureStatistics.load(f"{out}/stats/reduced", storage.fsspec_options(out, ep)).infos.values()]
    passes = run["curvature"]["passes"]
    for name, payload in (("pass1", 8 * pass1_payload_numbers(shapes)), ("pass2", 8 * efb_payload_numbers(shapes))):
        ranks = passes[name]["ranks"]
        assert len(ranks) == 2, name
        for r in ranks:
            assert r["reduces"] == 1 and r["allreduce_calls"] == 1 and r["allreduce_bytes"] == payload, (name, r)
            assert min(r[k] for k in ("compute_s", "data_wait_s", "reduce_s", "write_s")) >= 0, (name, r)
    assert passes["pass1"]["ranks"][0]["bytes_written"] == 8 * pass1_payload_numbers(shapes)
    assert passes["pass2"]["ranks"][0]["bytes_written"] == 0


def test_demo_preset_with_an_s3_output_runs_on_the_worker_node(ray_head, moto_s3):
    """The embedded demo on a cluster: its digits, letters and trained CNN are written to the
    (S3) output and read from there by the worker node, which cannot see the driver's disk.
    Cut to a few configurations and samples, weight sampling alone, one trial at a time, one Ray
    Train worker and one evaluation actor (it is the data placement that is tested here; the demo's
    default search is the fresh-clone demo's, two workers are the submitted smoke job's)."""
    import boto3

    from pipelines.storage import uris as storage

    address, _ = ray_head
    bucket = f"demo-{os.getpid()}-{int(time.time())}"
    boto3.client("s3", endpoint_url=moto_s3, region_name="us-east-1").create_bucket(Bucket=bucket)
    out = f"s3://{bucket}/demo"
    res = _submit(address, ["--preset", "demo", "--output", out, "--endpoint-url", moto_s3, "--methods", "diag,inf",
                            "--set", "data.limit=400", "--set", "data.val_limit=100", "--set", "data.test_limit=100",
                            "--set", "data.ood_limit=60", "--set", "search.num_configs=2", "--set",
                            "search.pred_types=[nn]", "--set", "search.mc_samples=2", "--set", "search.concurrent_trials=1",
                            "--set", "evaluate.mc_samples=3", "--set", "curvature.num_workers=1",
                            "--set", "evaluate.num_actors=1"])
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert "cluster: 2 node(s)" in log and f"demo data written to {out}/demo-data" in log, log[-3000:]
    for split in ("train", "val", "test"):
        assert storage.exists(f"{out}/demo-data/digits/{split}/dataset.json", moto_s3)
    assert storage.exists(f"{out}/demo-data/letters/dataset.json", moto_s3)
    config = _json(f"{out}/config.json", moto_s3)
    run = _json(f"{out}/run.json", moto_s3)
    assert run["model"]["weights"] == f"{out}/demo-model/small_cnn.safetensors", run["model"]
    assert storage.exists(run["model"]["weights"], moto_s3) and config["data"]["demo"] is True
    assert set(run["results"]) == {"map", "diag", "inf"}
    assert 'id="methods-table"' in _text(f"{out}/report.html", moto_s3)


def test_a_local_output_on_two_nodes_is_refused_before_any_pass(ray_head, tmp_path):
    """Not declared shared, a local output would be split across the nodes' disks: exit 2
    with one line, once the job knows the cluster's shape and before any pass."""
    address, _ = ray_head
    out = tmp_path / "local-out"
    res = _submit(address, ["--preset", "smoke", "--output", str(out)])
    log = res.stdout + res.stderr
    assert res.returncode != 0, log[-3000:]
    # `ray job submit` prints the job's log as it runs and again in its closing status message
    errors = sorted({ln.strip() for ln in log.splitlines() if "imagenet_inf.py: error:" in ln})
    assert len(errors) == 1, log[-3000:]
    assert f"--output {out} is a local path, but the cluster has 2 nodes" in errors[0]
    assert "storage.shared_fs=true" in errors[0] and "exit code 2" in log, log[-3000:]
    assert "stage curvature: running" not in log and "Traceback" not in log, log[-3000:]


def test_a_shared_local_output_runs_on_two_nodes(ray_head):
    """With ``storage.shared_fs: true`` and a folder both nodes see, the job runs (demo data
    and model in the output folder, read there by the worker node; one Ray Train worker and one
    evaluation actor: where the output lives is what is tested)."""
    address, _ = ray_head
    base = Path(tempfile.mkdtemp(prefix="infoform-shared-", dir="/tmp"))  # outside the hidden folders
    try:
        out = base / "out"
        res = _submit(address, ["--preset", "smoke", "--output", str(out), "--set", "storage.shared_fs=true",
                                "--methods", "diag,inf", "--set", "search.num_configs=2",
                                "--set", "curvature.num_workers=1", "--set", "evaluate.num_actors=1"])
        log = res.stdout + res.stderr
        assert res.returncode == 0, log[-4000:]
        assert "cluster: 2 node(s)" in log
        run = json.loads((out / "run.json").read_text())
        assert set(run["results"]) == {"map", "diag", "inf"} and (out / "report.html").is_file()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_long_lived_cluster_holds_nothing_after_each_job(ray_head, submitted):
    """The suite's short soak (issue 41; ``benchmarks/soak.py`` runs 20 jobs): after every job
    this module submitted to the one head, successful or refused, the CPUs and object store are
    back at the baseline and no actor or placement group of an ended job is alive."""
    if len(CLUSTER.get("after", [])) < 3:
        pytest.skip(f"{len(CLUSTER.get('after', []))} job(s) ran in this module's selection; the soak needs 3")
    assert CLUSTER["baseline"].get("cpu_total") == 2.0, CLUSTER["baseline"]
    held = {job: _leaks(state) for job, state in CLUSTER["after"]}
    assert not any(held.values()), held


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
