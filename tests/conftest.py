"""Shared pytest setup: local-only Ray settings, fake AWS credentials, the repository root
on sys.path, and one moto S3 server per session.

- ``moto_s3``: a moto ``ThreadedMotoServer`` on 127.0.0.1 (free port); yields its endpoint
  URL ``http://127.0.0.1:PORT``. Pass it as ``StorageOptions(endpoint)`` (to ``RunStore.open``,
  ``DataConfig(storage_options=...)``), to the job as ``--endpoint-url``, or to s3fs as
  ``client_kwargs={"endpoint_url": ...}``.
- ``s3_bucket`` (function-scoped): creates a fresh, uniquely named bucket on ``moto_s3``
  and yields ``(uri "s3://name", endpoint)``.

Fake AWS credentials are set when this file is imported, before any client exists
(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY = "testing", AWS_DEFAULT_REGION=us-east-1,
AWS_EC2_METADATA_DISABLED=true; AWS_PROFILE, session tokens and any AWS_ENDPOINT_URL*
removed), so no test can reach a real account and an endpoint reaches the code only where a
test passes it.
"""
import faulthandler
import logging
import os
import sys
import uuid
from pathlib import Path

import pytest

# Ray on one machine: bind to 127.0.0.1 and no token auth.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

os.environ.update(
    AWS_ACCESS_KEY_ID="testing",
    AWS_SECRET_ACCESS_KEY="testing",
    AWS_DEFAULT_REGION="us-east-1",
    AWS_EC2_METADATA_DISABLED="true",
)
for _var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
    os.environ.pop(_var, None)

#: Seconds past a test's pytest-timeout after which the process is ended with every thread's
#: stack (``faulthandler``, a C thread): the backstop for a test stuck where pytest-timeout's
#: SIGALRM handler never runs (the main thread inside one blocking C call, such as a plain
#: ``ray.get`` on work that can never be scheduled). A hung suite then fails in minutes
#: instead of running into CI's limit.
TIMEOUT_BACKSTOP_S = float(os.environ.get("INFOFORM_TIMEOUT_BACKSTOP_S", "120"))

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
# the suite's helpers shared as one module each (``import background`` in a test module)
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def moto_s3():
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(moto_s3):
    import boto3

    name = f"t-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=moto_s3, region_name="us-east-1").create_bucket(Bucket=name)
    yield f"s3://{name}", moto_s3


_STDERR: dict[str, int] = {}


def pytest_configure(config):
    """Keep a descriptor of the real stderr (before pytest captures it for the tests): the
    backstop's stacks must reach the log even though the process ends without pytest's report."""
    _STDERR.setdefault("fd", os.dup(sys.stderr.fileno()))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Arm the :data:`TIMEOUT_BACKSTOP_S` backstop around each test (setup, call, teardown)."""
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker is not None and marker.args else float(item.config.getini("timeout") or 0)
    if limit > 0:
        faulthandler.dump_traceback_later(limit + TIMEOUT_BACKSTOP_S, exit=True, file=_STDERR.get("fd", 2))
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


FRESH_DEMO = "tests/jobs/test_demo_fresh.py::test_make_demo_from_a_fresh_clone"


def pytest_collection_finish(session):
    """Beside the suite (issue 43): the whole jobs of ``tests/background.py`` are prepared and queued
    now, and the modules that read them move to the end; the fresh-clone demo (install + `make
    demo`, minutes, nothing shared with the other tests) is queued after them, and its test runs
    last to wait for it and check it."""
    items = session.items
    if session.config.option.collectonly:
        return
    _queue_background_jobs(session)
    fresh = [it for it in items if it.nodeid.endswith(FRESH_DEMO)]
    if not fresh or len(items) == 1 or fresh[0].module.enabled() is not None:
        return
    items.remove(fresh[0])
    items.append(fresh[0])
    fresh[0].module.Background.start()


def _queue_background_jobs(session) -> None:
    """Queue the selected modules' background jobs (``tests/background.py``), in collection order,
    and move those modules' tests after the others (each module's own order kept)."""
    if not (Path(__file__).parent / "background.py").exists():  # a copy of this file elsewhere
        return
    import background

    modules, jobs = [], []
    for it in session.items:
        mine = background.jobs_for(set(getattr(it, "fixturenames", ())))
        if mine:
            jobs.extend(j for j in mine if j not in jobs)
            if it.module not in modules:
                modules.append(it.module)
    if not jobs:
        return
    late = [it for it in session.items if getattr(it, "module", None) in modules]
    session.items[:] = [it for it in session.items if getattr(it, "module", None) not in modules] + late
    background.start(jobs, getattr(session.config, "_tmp_path_factory", None))


# ---- The suite's clock and count guard (issue 43): tests/suite_guard.py, budget in tests/budget.toml ----
# (a copy of this file elsewhere, as tests/test_timeout.py plants one, runs without it)
if (Path(__file__).parent / "suite_guard.py").exists():
    if str(Path(__file__).parent) not in sys.path:
        sys.path.insert(0, str(Path(__file__).parent))
    pytest_plugins = ["suite_guard"]
