"""Soak of a long-lived local cluster (issue 41): N smoke-sized jobs in a row on one
``ray start --head --block`` on 127.0.0.1, and after each job the cluster's state against the
baseline taken before the first: available CPUs, memory, object-store bytes in use, live actors,
placement groups not removed, and Ray worker processes of this cluster.

    .venv/bin/python benchmarks/soak.py --jobs 20 [--out /tmp/soak]

The jobs cycle through the smoke preset, the shift-run configuration (temperature, diag, INF, a
shift sweep, ASHA; the suite's ``smoke_shift_run``) and a scoring job (``jobs/score.py`` on the
first run's test split). The head is started and killed by PID (never ``ray stop``). Prints one
JSON line per job and writes them to ``<out>/soak.jsonl``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIFT = ["--set", "posterior.methods=[temperature, diag, inf]",
         "--set", "evaluate.shift={corruptions: [gaussian_noise, contrast], severities: [1, 5]}",
         "--set", "evaluate.mc_samples=4", "--set", "search.scheduler=asha", "--set", "search.chunk_size=25",
         "--set", "evaluate.batch_size=25"]

PROBE = r"""
import json, re, sys, ray
from ray.util.state import list_actors, list_placement_groups
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
avail, total = ray.available_resources(), ray.cluster_resources()
from ray._private.internal_api import memory_summary
m = re.search(r"Plasma memory usage (\d+) MiB, (\d+) objects", memory_summary(address=sys.argv[1], stats_only=True))
print(json.dumps({"cpu_available": avail.get("CPU", 0.0), "cpu_total": total.get("CPU", 0.0),
  "memory_available": avail.get("memory", 0.0), "object_store_available": avail.get("object_store_memory", 0.0),
  "plasma_mib": int(m.group(1)) if m else None, "plasma_objects": int(m.group(2)) if m else None,
  "actors_alive": [a.class_name for a in list_actors(address=sys.argv[1], filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)],
  "pgs_live": [p.placement_group_id for p in list_placement_groups(address=sys.argv[1], raise_on_missing_output=False) if p.state != "REMOVED"]}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: The environment of a ``ray start --block`` node that :func:`stop_head` ends. On SIGTERM the node
#: first asks the GCS to drain it and waits for its raylet to go idle, up to
#: ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`` (30 s): a node that still hosts a detached actor (Ray
#: Data's cluster-wide singletons, left by any job that read a dataset) never goes idle, so each
#: such node took the full 30 s to end (test_job.py's teardown: 60 s for its two nodes). The drain
#: is for Serve's proxies; these nodes serve nothing, and 0 ends them at once.
NODE_ENV = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


def _env() -> dict[str, str]:
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    env.update(NODE_ENV)
    env.pop("RAY_ADDRESS", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def start_head(tmp: Path):
    """``ray start --head --block`` with free ports; (process, gcs address, dashboard URL)."""
    p = [_free_port() for _ in range(5)]
    ray_bin = str(Path(sys.executable).parent / "ray")
    log = open(tmp / "head.log", "w")
    proc = subprocess.Popen([ray_bin, "start", "--head", "--block", f"--port={p[0]}", "--node-ip-address=127.0.0.1",
                             "--dashboard-host=127.0.0.1", f"--dashboard-port={p[1]}", "--num-cpus=2",
                             f"--temp-dir={tmp}", f"--dashboard-agent-listen-port={p[2]}",
                             f"--dashboard-agent-grpc-port={p[3]}", f"--runtime-env-agent-port={p[4]}",
                             "--disable-usage-stats", "--include-dashboard=true"],
                            env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    gcs, dash = f"127.0.0.1:{p[0]}", f"http://127.0.0.1:{p[1]}"
    deadline = time.time() + 180
    while time.time() < deadline:
        if subprocess.run([ray_bin, "job", "list", "--address", dash], env=_env(), capture_output=True).returncode == 0:
            return proc, gcs, dash
        time.sleep(2)
    stop_head(proc)
    raise RuntimeError(f"the head did not come up: {tmp / 'head.log'}")


def stop_head(proc) -> None:
    """End a ``ray start --block`` node started in its own process group (with :data:`NODE_ENV`):
    SIGTERM to that process alone (it stops its daemons: 1-2 s), then SIGKILL to what is left of
    the group. A SIGTERM to the whole group kills the GCS first, and the head then waits 30 s
    for it to drain (``Timed out while waiting for GCS to become available``)."""
    for kill, sig, wait in ((os.kill, signal.SIGTERM, 30), (os.killpg, signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
            kill(proc.pid, sig)
            proc.wait(timeout=wait)


def workers(tmp: Path) -> int:
    """Ray worker processes of this cluster (``default_worker.py`` with its session under ``tmp``)."""
    n = 0
    for pid in os.listdir("/proc"):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except (OSError, ValueError):
            continue
        n += "default_worker.py" in cmd and str(tmp) in cmd
    return n


def probe(gcs: str, tmp: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, gcs], env=_env(), capture_output=True, text=True, timeout=120)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:  # recorded, not fatal: the soak goes on
        return {"probe_failed": out.returncode, "probe_stderr": out.stderr[-1500:], "workers": workers(tmp)}
    state = json.loads(lines[-1])
    state["workers"] = workers(tmp)
    return state


def job_args(i: int, out: Path) -> tuple[str, list[str]]:
    first = out / "job000"
    kind = ("smoke", "shift", "score")[i % 3] if i else "smoke"
    if kind == "score":
        return kind, ["jobs/score.py", "--run", str(first), "--data", "run:test", "--output", str(out / f"score{i:03d}")]
    extra = SHIFT if kind == "shift" else []
    return kind, ["jobs/imagenet_inf.py", "--preset", "smoke", "--output", str(out / f"job{i:03d}"), *extra]


def submit(dash: str, args: list[str]) -> tuple[int, float, str]:
    ray_bin = str(Path(sys.executable).parent / "ray")
    cmd = [ray_bin, "job", "submit", "--address", dash, "--working-dir", str(ROOT), "--runtime-env-json",
           json.dumps({"excludes": [".venv", ".git", "runs", "*.pyc"]}), "--", "python", *args]
    t0 = time.time()
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=3600)
    errors = [ln for ln in (res.stdout + res.stderr).splitlines() if "error" in ln.lower()]
    return res.returncode, time.time() - t0, (errors[-1] if errors else "")[-500:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=20)
    ap.add_argument("--out", default=None, help="where the jobs write (default: a new folder under /tmp)")
    ap.add_argument("--max-minutes", type=float, default=None, help="submit no new job after this long")
    ap.add_argument("--settle-s", type=float, default=10.0, help="seconds after a job before the probe")
    a = ap.parse_args(argv)
    out = Path(a.out or tempfile.mkdtemp(prefix="soak-out-", dir="/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="sk", dir="/tmp"))
    t_start = time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill by PID still stops the head
    head, gcs, dash = start_head(tmp)
    try:
        base = probe(gcs, tmp)
        print(json.dumps({"baseline": base}), flush=True)
        with open(out / "soak.jsonl", "w") as log:
            log.write(json.dumps({"baseline": base}) + "\n")
            for i in range(a.jobs):
                if a.max_minutes is not None and time.time() - t_start > 60 * a.max_minutes:
                    print(json.dumps({"stopped": f"--max-minutes {a.max_minutes} reached after {i} job(s)"}))
                    break
                kind, args = job_args(i, out)
                rc, took, error = submit(dash, args)
                time.sleep(a.settle_s)
                row = {"job": i, "kind": kind, "rc": rc, "seconds": round(took, 1), **probe(gcs, tmp)}
                if rc:
                    row["error"] = error
                print(json.dumps(row), flush=True)
                log.write(json.dumps(row) + "\n")
                log.flush()
    finally:
        stop_head(head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
