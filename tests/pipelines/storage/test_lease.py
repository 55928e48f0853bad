"""One owner per run folder (issue 41, acceptance 2): the lease of :mod:`pipelines.storage.lease`
on a local folder and on moto's S3 server, no cluster. A fresh lease refuses a second owner in one
line; a stale one (old heartbeat, or its process on this host gone) is taken over with a line
saying so; 8 jobs taking one lease at the same moment leave exactly one owner (also when they race
for a stale one); the heartbeat moves while the job runs; a job whose lease was taken over sees it.
The refusal through the job's entry point is in tests/jobs/test_job_errors.py, the takeover of a
killed run's lease that then resumes from its markers in tests/pipelines/cli/test_shift_run.py."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

RACERS = 8


@pytest.fixture(params=["local", "s3"])
def output(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "out"), None
    bucket, endpoint = request.getfixturevalue("s3_bucket")
    from pipelines.storage.uris import StorageOptions

    return f"{bucket}/out", StorageOptions(endpoint).resolved()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _plant(out: str, store, **fields) -> None:
    import socket

    from pipelines.storage import uris as storage
    from pipelines.storage.lease import lease_uri

    doc = {"owner": "other:1:x", "host": socket.gethostname(), "pid": 1, "heartbeat_at": time.time()} | fields
    storage.write_bytes_atomic(lease_uri(out), json.dumps(doc).encode(), store)


def test_a_fresh_lease_refuses_a_second_owner_until_released(output):
    from pipelines.storage.lease import LeaseHeld, acquire, read_lease

    out, store = output
    lines: list[str] = []
    first = acquire(out, store, log=lines.append)
    assert read_lease(out, store)["owner"] == first.owner
    with pytest.raises(LeaseHeld) as e:
        acquire(out, store, log=lines.append)
    msg = str(e.value)
    assert "\n" not in msg and first.owner in msg and "held by another job" in msg and "lease.json" in msg
    first.release()
    assert read_lease(out, store) is None and lines == []
    with acquire(out, store, log=lines.append) as again:  # free again once released
        assert read_lease(out, store)["owner"] == again.owner
    assert read_lease(out, store) is None


@pytest.mark.parametrize("stale", ["old heartbeat", "owner killed"])
def test_a_stale_lease_is_taken_over_with_a_line(output, stale):
    from pipelines.storage.lease import acquire, read_lease

    out, store = output
    if stale == "old heartbeat":  # another host's job, silent for longer than stale_after_s
        _plant(out, store, host="elsewhere", pid=12345, heartbeat_at=time.time() - 121)
        why = "last heartbeat was 121 s ago"
    else:  # a job on this host killed a moment ago: its heartbeat is fresh, its process gone
        pid = _dead_pid()
        _plant(out, store, pid=pid)
        why = f"its process {pid} on this host is gone"
    lines: list[str] = []
    with acquire(out, store, log=lines.append) as lease:
        assert read_lease(out, store)["owner"] == lease.owner
    assert len(lines) == 1 and "taking over" in lines[0] and "other:1:x" in lines[0] and why in lines[0], lines


def test_a_lease_of_this_hosts_live_process_stays_fresh_despite_a_recent_heartbeat(output):
    import os

    from pipelines.storage.lease import LeaseHeld, acquire

    out, store = output
    _plant(out, store, pid=os.getpid(), heartbeat_at=time.time() - 60)
    with pytest.raises(LeaseHeld, match="last heartbeat 60 s ago"):
        acquire(out, store, log=lambda s: None)


@pytest.mark.parametrize("planted", ["none", "stale"])
def test_racers_for_one_lease_leave_exactly_one_owner(output, planted):
    from pipelines.storage.lease import LeaseHeld, acquire, read_lease

    out, store = output
    if planted == "stale":
        _plant(out, store, pid=_dead_pid())
    barrier = threading.Barrier(RACERS)
    won, refused, errors = [], [], []

    def race() -> None:
        barrier.wait(timeout=30)
        try:
            won.append(acquire(out, store, log=lambda s: None))
        except LeaseHeld:
            refused.append(1)
        except Exception as e:  # any other failure fails the test below
            errors.append(e)
    threads = [threading.Thread(target=race) for _ in range(RACERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and len(won) == 1 and len(refused) == RACERS - 1
    assert read_lease(out, store)["owner"] == won[0].owner
    won[0].release()


def test_the_heartbeat_moves_and_a_taken_over_lease_is_noticed(output):
    from pipelines.storage.lease import acquire, read_lease

    out, store = output
    lines: list[str] = []
    lease = acquire(out, store, log=lines.append).start(every_s=0.05)
    first = read_lease(out, store)["heartbeat_at"]
    deadline = time.time() + 10
    while read_lease(out, store)["heartbeat_at"] == first and time.time() < deadline:
        time.sleep(0.05)
    assert read_lease(out, store)["heartbeat_at"] > first
    lease.release()
    lease = acquire(out, store, log=lines.append)
    _plant(out, store, owner="thief:2:y")  # another job took it (e.g. it judged this one stale)
    assert lease.refresh() is False and lease.lost
    assert lines and "taken over by another job" in lines[-1]
    lease.release()  # leaves the other job's lease alone
    assert read_lease(out, store)["owner"] == "thief:2:y"
