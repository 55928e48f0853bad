"""``tests/background.py``: a job's preparation runs where it is queued, the rest in the queue's
thread, one job at a time; a failure is raised in the fixture that asks; an unqueued job runs in place."""
from __future__ import annotations

import threading
import time

import background
import pytest


def _probe(name: str, fail: bool = False):
    seen: dict = {}

    @background.job(f"_probe_{name}")
    def probe(base):
        seen["prepare"] = threading.current_thread().name
        seen["base"] = base
        yield
        seen["run"] = threading.current_thread().name
        seen.setdefault("order", []).append(time.monotonic())
        if fail:
            raise ValueError("the job failed")
        return base / "out"

    return probe, seen


def test_queued_jobs_prepare_here_run_in_the_queue_and_return_their_value(tmp_path_factory):
    a, seen_a = _probe("a")
    b, seen_b = _probe("b")
    queue = background.Queue()  # not the suite's: its jobs would run first
    queue.start([a, b], tmp_path_factory)
    assert seen_a["prepare"] == seen_b["prepare"] == threading.current_thread().name
    assert queue.queued(a) and queue.queued(b) and not background.queued(a)
    assert queue.result(b) == seen_b["base"] / "out"
    assert queue.result(a) == seen_a["base"] / "out"
    assert seen_a["run"] == seen_b["run"] != threading.current_thread().name  # one queue thread
    assert seen_a["order"][0] <= seen_b["order"][0]  # in the order queued


def test_a_failure_is_raised_where_the_result_is_asked_for(tmp_path_factory):
    bad, _ = _probe("bad", fail=True)
    queue = background.Queue()
    queue.start([bad], tmp_path_factory)
    with pytest.raises(ValueError, match="the job failed"):
        queue.result(bad)


def test_an_unqueued_job_runs_in_place_and_a_plain_function_is_refused(tmp_path_factory):
    here, seen = _probe("here")
    assert background.result(here, tmp_path_factory) == seen["base"] / "out"
    assert seen["run"] == threading.current_thread().name
    with pytest.raises(TypeError, match="generator function"):
        background.job("_probe_plain")(lambda base: base)
    assert background.jobs_for({"_probe_here", "no_such_fixture"}) == [here]
