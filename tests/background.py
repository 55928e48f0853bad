"""Whole jobs run beside the suite (issue 43): a queue of one, started when the suite starts.

A whole-job fixture spends most of its wall time waiting (Ray's start-up, worker processes
importing torch, Ray Data's first read): on a 2-core machine the unit tests use about half the
CPU and a job about two thirds, so a job run *beside* them costs the suite far less than one run
*between* them. A test module declares its job as a generator function decorated with
:func:`job`::

    @background.job("dirty_run")
    def dirty_job(base: Path):
        inputs = write_inputs(base)        # the main thread: torch's global RNG, files
        yield                              # everything after the yield runs in the queue's thread
        res = subprocess.run([...], stdout=subprocess.PIPE, ...)
        assert res.returncode == 0, res.stdout[-6000:]
        return out, res.stdout

    @pytest.fixture(scope="module")
    def dirty_run():
        return background.result(dirty_job)

``tests/conftest.py`` calls :func:`start` when collection is done: the jobs behind the fixtures
the selected tests use (a test module's or a conftest's) are prepared (the part before the
``yield``, in the main thread, in the order the tests come) and queued; the modules whose tests
use them move to the end of the run, so that the rest of the suite runs while
the queue works. :func:`result` waits for a queued job (its exception is raised in the fixture)
or, when the job was not queued (a run of one test, ``--collect-only``), runs it in place.

What the part after the ``yield`` may do: start child processes with their output piped (never
inherited: a test capturing fd 1/2 must not read a job's lines), read and write files under
``base``. Not: print, touch torch's global state or the pytest session's Ray. What it reports is
kept and printed by :func:`result` in the test that needs it. The suite's count guard charges a
job's launches to the test module that defines it (its generator's frame is the outermost one of
a test file in the queue thread's stack).
"""
from __future__ import annotations

import concurrent.futures
import inspect
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Generator

__all__ = ["job", "jobs_for", "Queue", "suite", "start", "then", "result", "queued", "smoke_job", "JOB_ATTR", "spans"]

#: The attribute :func:`job` sets on a generator function.
JOB_ATTR = "infoform_background_job"

_log: dict[Callable, list[str]] = {}
_registry: dict[str, Callable] = {}  # fixture name -> its job
#: ``(job, start, end)`` (``time.time()``) of each job run to its end, for the suite's timeline
spans: list[tuple[str, float, float]] = []


def job(fixture: str) -> Callable[[Callable], Callable]:
    """Mark ``fn(base)`` (a generator function: prepare, ``yield``, run, return) as the background job
    behind the fixture named ``fixture``: it is queued when a selected test uses that fixture."""
    def mark(fn: Callable[[Path], Generator[None, None, Any]]) -> Callable[[Path], Generator[None, None, Any]]:
        if not inspect.isgeneratorfunction(fn):
            raise TypeError(f"{fn.__qualname__}: a background job is a generator function (prepare; yield; run)")
        setattr(fn, JOB_ATTR, fixture)
        _registry.setdefault(fixture, fn)
        return fn
    return mark


def jobs_for(fixtures: set[str]) -> list[Callable]:
    """The background jobs behind ``fixtures`` (those of the test modules and conftests imported so far)."""
    return [fn for name, fn in _registry.items() if name in fixtures]


def _base(fn: Callable, tmp_path_factory: Any = None) -> Path:
    name = fn.__name__.strip("_")[:30]
    if tmp_path_factory is not None:
        return tmp_path_factory.mktemp(f"bg-{name}")
    return Path(tempfile.mkdtemp(prefix=f"infoform-bg-{name}-"))


def _finish(gen: Generator[None, None, Any], log: list[str], name: str) -> Any:
    t0 = time.time()
    try:
        next(gen)
    except StopIteration as stop:
        log.append(f"{name}: {time.time() - t0:.0f} s in the background queue")
        spans.append((name, t0, time.time()))
        return stop.value
    raise RuntimeError(f"{name}: a background job yields once (prepare; yield; run)")


def _prepare(fn: Callable, base: Path) -> Generator[None, None, Any]:
    gen = fn(base)
    try:
        next(gen)  # the part before the yield, here
    except StopIteration:
        raise RuntimeError(f"{fn.__qualname__}: a background job yields once (prepare; yield; run)") from None
    return gen


class Queue:
    """A queue of one thread: jobs prepared where they are queued, run one at a time in queue order.
    The suite has one (:data:`suite`, behind the module's functions); a test of the queue itself
    makes its own, so that it does not wait behind the suite's jobs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._queued: dict[Callable, concurrent.futures.Future] = {}

    def _the_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="infoform-bg")
            return self._pool

    def queued(self, fn: Callable) -> bool:
        return fn in self._queued

    def start(self, fns: list[Callable], tmp_path_factory: Any = None) -> None:
        """Prepare each job of ``fns`` here, in order, and queue the rest of each (one at a time)."""
        for fn in fns:
            if fn in self._queued:
                continue
            log = _log.setdefault(fn, [])
            try:
                gen = _prepare(fn, _base(fn, tmp_path_factory))
            except BaseException as e:  # noqa: BLE001 - raised again in the fixture that needs it
                fut: concurrent.futures.Future = concurrent.futures.Future()
                fut.set_exception(e)
            else:
                fut = self._the_pool().submit(_finish, gen, log, fn.__qualname__)
            self._queued[fn] = fut

    def then(self, name: str, work: Callable[[], Any]) -> concurrent.futures.Future:
        """Queue ``work()`` (nothing to prepare, no fixture) after every job queued so far; its span
        is in the suite's timeline under ``name``. For work that shares nothing with the tests and
        should fill the CPU the queue leaves at its end (the fresh-clone demo) rather than compete
        with it."""
        def run() -> Any:
            t0 = time.time()
            try:
                return work()
            finally:
                spans.append((name, t0, time.time()))
        return self._the_pool().submit(run)

    def result(self, fn: Callable, tmp_path_factory: Any = None, timeout: float = 3000) -> Any:
        """The value ``fn`` returned: waited for when queued, else run here (prepare and run)."""
        if fn not in self._queued:
            log = _log.setdefault(fn, [])
            gen = _prepare(fn, _base(fn, tmp_path_factory))
            value = _finish(gen, log, fn.__qualname__)
        else:
            t0 = time.time()
            value = self._queued[fn].result(timeout=timeout)
            _log.setdefault(fn, []).append(f"{fn.__qualname__}: waited {time.time() - t0:.0f} s for it")
        for line in _log.pop(fn, []):
            print(line)
        return value


#: The suite's queue (``tests/conftest.py`` fills it when collection is done).
suite = Queue()
start, then, result, queued = suite.start, suite.then, suite.result, suite.queued


def smoke_job(output: Path, sets: list[str], timeout: float = 1200) -> Path:
    """``jobs/imagenet_inf.py --preset smoke --output OUTPUT --set ...`` as a user runs it (its own
    local Ray: no ``RAY_ADDRESS``), both streams piped; asserts exit 0 (the log's end in the
    message) and returns ``output``."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "jobs" / "imagenet_inf.py"), "--preset", "smoke", "--output", str(output)]
    for x in sets:
        cmd += ["--set", x]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    res = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                         cwd=root)
    assert res.returncode == 0, res.stdout[-6000:]
    return output
