"""The suite's own clock and its count guard (issue 43): a pytest plugin, loaded by ``tests/conftest.py``.

At the end of a run it prints the suite's wall time, its slowest tests (setup + call + teardown) and
what makes it slow, counted: the **Ray instances** it starts and the **whole jobs** it runs. The
counts are compared with the budget in ``tests/budget.toml``; a count over its budget fails the run
(exit 1) with one line per excess, even when every test passed. Counts, not timings: the check is
as deterministic as the tests themselves.

What is counted, in the pytest process:

- ``ray_instances``: an in-process ``ray.init`` that starts a local instance (Ray not yet
  initialised, and ``address="local"`` or no address and no ``RAY_ADDRESS``); a ``ray start --head``; a ``python -c`` child whose
  code calls ``ray.init(`` without ``address=`` (one that joins a running cluster starts none).
- ``jobs``: a run of a job entry point in a child process (``jobs/imagenet_inf.py``,
  ``jobs/core_demo.py``, ``benchmarks/paper/table2.py`` (the job in its own process), ``python -m pipelines run`` / ``pipelines.cli.main run``, ``infoform run``,
  ``make demo``; not with ``--dry-run`` or ``--help``) that did not exit 2 (the job's exit for bad
  input, before any cluster work: such a launch is listed as rejected, not budgeted); a ``ray job
  submit`` that exited 0 (its retries while the head's job agent comes up are not runs); an
  in-process :func:`pipelines.cli.run.run` (charged when called).

A child process is seen through the ``subprocess.Popen`` audit event; ``ray.init`` and
``pipelines.cli.run.run`` are wrapped when first imported. Not seen: what a child process starts by
itself (a child pytest, a benchmark script) beyond its own launch.

Each count is charged to the test file (or conftest) that asked for it: the outermost frame of the
call stack under the run's root directory, else the file of the running test. So a session-scoped
fixture in a conftest is charged to that conftest whichever test first needs it, and a run of a
subset of the suite (one file, ``-k``) counts at most the budget of each file it touches: the
budget is per file, and a run never fails for what it did not run.

Environment: ``INFOFORM_SUITE_BUDGET`` (another budget file: the planted-job test),
``INFOFORM_SUITE_LEDGER`` (write the counts per file there as JSON).
"""
from __future__ import annotations

import functools
import importlib.abc
import json
import os
import re
import shlex
import sys
import threading
import time
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

KINDS = ("ray_instances", "jobs")
JOB_SCRIPTS = ("jobs/imagenet_inf.py", "jobs/core_demo.py", "benchmarks/paper/table2.py")
_NOT_A_RUN = ("--dry-run", "--help", "-h")

_lock = threading.Lock()
_state: dict = {"root": None, "item": None, "counts": defaultdict(lambda: dict.fromkeys((*KINDS, "rejected"), 0)),
                "events": [], "launches": []}


#: ``ray.init(address=...)`` in a ``python -c`` child: it joins an existing cluster (e.g. the soak's probe).
_CONNECTS = re.compile(r"ray\.init\(\s*address\s*=")


def classify(argv) -> str | None:
    """The kind of a child process started with ``argv`` (``"ray_instances"``, ``"jobs"``) or None."""
    if isinstance(argv, (str, bytes)):
        argv = shlex.split(os.fsdecode(argv))
    a = [os.fsdecode(x) for x in argv]
    if not a:
        return None
    exe = os.path.basename(a[0])
    if exe == "ray":
        if "start" in a[1:2] and "--head" in a:
            return "ray_instances"
        return "jobs" if a[1:3] == ["job", "submit"] else None
    if exe == "make":
        return "jobs" if "demo" in a[1:] else None
    if exe.startswith("python") and "-c" in a[1:2]:  # a driver that connects to a running cluster starts none
        return "ray_instances" if len(a) > 2 and "ray.init(" in a[2] and not _CONNECTS.search(a[2]) else None
    if any(x in _NOT_A_RUN for x in a[1:]):
        return None
    if exe.startswith("python") and len(a) > 1 and a[1].replace(os.sep, "/").endswith(JOB_SCRIPTS):
        return "jobs"
    if exe.startswith("python") and a[1:2] == ["-m"] and a[2:3] in (["pipelines"], ["pipelines.cli.main"]):
        return "jobs" if a[3:4] == ["run"] else None
    if exe == "infoform":
        return "jobs" if a[1:2] == ["run"] else None
    return None


def _charged_to() -> str:
    """The file a count is charged to: the outermost frame of a test module or conftest under the root, else the
    running test's file, else ``"?"``."""
    root = _state["root"]
    found = None
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        base = os.path.basename(name)
        if root and name.startswith(root) and (base.startswith("test_") or base == "conftest.py"):
            found = name
        f = f.f_back
    if found is not None:
        return os.path.relpath(found, root).replace(os.sep, "/")
    item = _state["item"]
    return item.nodeid.split("::")[0] if item is not None else "?"


def _nodeid() -> str:
    item = _state["item"]
    return item.nodeid if item is not None else ""


def _charge(key: str, kind: str, nodeid: str, what: str) -> None:
    with _lock:
        _state["counts"][key][kind] += 1
        _state["events"].append((key, kind, nodeid, what))


def count(kind: str, what: str) -> None:
    """Charge one ``kind`` (see :data:`KINDS`) to the calling test file."""
    _charge(_charged_to(), kind, _nodeid(), what)


def _popen_of_this_launch():
    """The ``subprocess.Popen`` being started (the audit event is raised in its ``_execute_child``)."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_name != "_execute_child":
        f = f.f_back
    return f.f_locals.get("self") if f is not None else None


def _audit(event: str, args) -> None:
    if event != "subprocess.Popen" or _state["root"] is None:
        return
    try:
        argv = args[1]
        kind = classify(argv)
        if kind is None:
            return
        what = " ".join(os.fsdecode(x) for x in ([argv] if isinstance(argv, (str, bytes)) else argv))[:160]
        if kind == "jobs":  # decided when the run ends (see counted_launches)
            with _lock:
                _state["launches"].append((_charged_to(), _nodeid(), what, _popen_of_this_launch()))
        else:
            count(kind, what)
    except Exception:  # an audit hook must never break a launch
        return


def counted_launches() -> None:
    """Charge the job launches that ran: a job script that did not exit 2 (the job's exit for bad
    input, before any cluster work: a rejection is listed, not budgeted), a ``make demo``, a
    ``ray job submit`` that exited 0 (its retries while the head's job agent comes up, and a
    submission the job refused, are not runs). A launch still running counts."""
    with _lock:
        launches, _state["launches"] = _state["launches"], []
    for key, nodeid, what, proc in launches:
        rc = getattr(proc, "returncode", None)
        submit = what.split(" ", 1)[0].endswith("ray") and " job submit " in what
        ran = rc == 0 if submit else rc != 2
        _charge(key, "jobs" if ran else "rejected", nodeid, what)


def _wrap_ray(ray) -> None:
    init = ray.init
    if getattr(init, "_suite_counted", False):
        return

    @functools.wraps(init)
    def counted_init(*args, **kwargs):
        address = kwargs.get("address", args[0] if args else None)
        starts = address == "local" or (address is None and not os.environ.get("RAY_ADDRESS"))
        if not ray.is_initialized() and starts:
            count("ray_instances", "ray.init()")
        return init(*args, **kwargs)

    counted_init._suite_counted = True
    ray.init = counted_init


def _wrap_run(module) -> None:
    run = module.run
    if getattr(run, "_suite_counted", False):
        return

    @functools.wraps(run)
    def counted_run(*args, **kwargs):
        count("jobs", "pipelines.cli.run.run()")
        return run(*args, **kwargs)

    counted_run._suite_counted = True
    module.run = counted_run


_WRAPS = {"ray": _wrap_ray, "pipelines.cli.run": _wrap_run}


class _Loader(importlib.abc.Loader):
    """The real loader, and a wrap of the module once it has run."""

    def __init__(self, inner, after):
        self._inner, self._after = inner, after

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._after(module)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _WRAPS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, _WRAPS[name])
                return spec
        return None


def _install() -> None:
    if getattr(sys, "_infoform_suite_guard", False):
        return
    sys._infoform_suite_guard = True
    sys.addaudithook(_audit)
    sys.meta_path.insert(0, _Finder())
    for name, wrap in _WRAPS.items():
        if name in sys.modules:
            wrap(sys.modules[name])


def load_budget(path: Path) -> dict[str, dict[str, int]]:
    """``{file: {kind: n}}`` from a budget file (``[budget."tests/x.py"]`` tables of ``kind = n``)."""
    with open(path, "rb") as fh:
        data = tomllib.load(fh).get("budget", {})
    return {k: {kind: int(v.get(kind, 0)) for kind in KINDS} for k, v in data.items()}


def over_budget(counts: dict[str, dict[str, int]], budget: dict[str, dict[str, int]]) -> list[str]:
    """One line per file and kind whose count exceeds its budget (a file not in the budget has 0)."""
    lines = []
    for key in sorted(counts):
        for kind in KINDS:
            n, cap = counts[key][kind], budget.get(key, {}).get(kind, 0)
            if n > cap:
                lines.append(f"{key}: {n} {kind} (budget {cap})")
    return lines


def pytest_configure(config):
    _state["root"] = str(config.rootpath) + os.sep
    _state["t0"] = time.monotonic()
    _state["wall0"] = time.time()
    _state["durations"] = defaultdict(float)
    _state["files"] = {}  # test file -> [first setup, last report] (time.time())
    _install()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _state["item"] = item
    _state["files"].setdefault(item.nodeid.split("::")[0], [time.time(), time.time()])


def pytest_runtest_logreport(report):
    _state["durations"][report.nodeid] += report.duration
    span = _state["files"].get(report.nodeid.split("::")[0])
    if span is not None:
        span[1] = time.time()


def timeline(files: dict[str, list[float]], jobs: list[tuple[str, float, float]], wall0: float,
             top: int = 12) -> list[str]:
    """Where the wall time went: the ``top`` test files by the span from their first test's start to
    their last report, and every background job's span, as ``start-end`` seconds from the suite's start."""
    rows = sorted(files.items(), key=lambda kv: kv[1][0] - kv[1][1])[:top]
    out = [f"  {a - wall0:6.0f}-{b - wall0:<6.0f} {b - a:6.0f} s  {f}" for f, (a, b) in sorted(rows, key=lambda kv: kv[1][0])]
    out += [f"  {a - wall0:6.0f}-{b - wall0:<6.0f} {b - a:6.0f} s  [background] {name}" for name, a, b in jobs]
    return out


def _budget_path(config) -> Path:
    return Path(os.environ.get("INFOFORM_SUITE_BUDGET") or Path(__file__).with_name("budget.toml"))


def pytest_sessionfinish(session, exitstatus):
    counted_launches()
    counts = {k: dict(v) for k, v in _state["counts"].items()}
    path = _budget_path(session.config)
    try:
        budget = load_budget(path)
    except (OSError, tomllib.TOMLDecodeError) as e:
        _state["verdict"] = [f"the budget file {path} cannot be read: {e}"]
    else:
        _state["verdict"] = over_budget(counts, budget)
        _state["budget"] = budget
    if os.environ.get("INFOFORM_SUITE_LEDGER"):
        Path(os.environ["INFOFORM_SUITE_LEDGER"]).write_text(json.dumps(
            {"counts": counts, "events": _state["events"]}, indent=1))
    if _state["verdict"] and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(trylast=True)  # after --durations: the last lines of the log
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    wall = time.monotonic() - _state.get("t0", time.monotonic())
    tr.section("suite clock and count guard (tests/suite_guard.py)")
    tr.write_line(f"suite wall time: {wall:.0f} s ({len(_state['durations'])} tests)")
    slow = sorted(_state["durations"].items(), key=lambda kv: -kv[1])[:10]
    for nodeid, d in slow:
        tr.write_line(f"  {d:7.1f} s  {nodeid}")
    bg = sys.modules.get("background")
    tr.write_line("timeline (seconds from the start; the longest test files and the background jobs):")
    for line in timeline(_state.get("files", {}), list(getattr(bg, "spans", [])), _state.get("wall0", 0.0)):
        tr.write_line(line)
    counts = _state["counts"]
    budget = _state.get("budget", {})
    for kind in KINDS:
        n = sum(c[kind] for c in counts.values())
        cap = sum(b[kind] for b in budget.values())
        tr.write_line(f"{kind}: {n} started (budget of the whole suite: {cap})")
    for key in sorted(counts):
        got = ", ".join(f"{kind} {counts[key][kind]}/{budget.get(key, {}).get(kind, 0)}" for kind in KINDS)
        rejected = counts[key]["rejected"]
        tr.write_line(f"  {key}: {got}" + (f" (and {rejected} job launches rejected with exit 2)" if rejected else ""))
    for line in _state.get("verdict", []):
        tr.write_line(f"OVER BUDGET: {line} -- consolidate, or raise tests/budget.toml in its own commit",
                      red=True, bold=True)
