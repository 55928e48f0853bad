"""Shared fixtures for pipeline tests: one local Ray per session (the moto S3 fixtures
``moto_s3`` / ``s3_bucket`` and the fake AWS credentials live in ``tests/conftest.py``).

Fixtures (all session-scoped unless said otherwise):

- ``ray_session``: ``ray.init(num_cpus=2, include_dashboard=False, _temp_dir=<short /tmp dir>,
  object_store_memory=1 GiB)``, reused by every test that asks for it (if Ray is already
  initialised in this process, that instance is reused and left running). Yields the
  ``ray`` module. Ray Data progress bars are off. Ray Train here needs
  ``ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 0.5})`` so
  Ray Data keeps a CPU to read with.
- ``moto_s3``: a moto ``ThreadedMotoServer`` on 127.0.0.1 (free port); yields its endpoint
  URL ``http://127.0.0.1:PORT``. Pass it as ``StorageOptions(endpoint)`` (to ``RunStore.open``,
  ``DataConfig(storage_options=...)``), or to s3fs as ``client_kwargs={"endpoint_url": ...}``.
- ``s3_bucket`` (function-scoped): creates a fresh, uniquely named bucket on ``moto_s3``
  and yields ``(uri "s3://name", endpoint)``.

Environment set when this file is imported (before any Ray or AWS client exists, so Ray
workers inherit it): RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (bind 127.0.0.1),
RAY_AUTH_MODE=disabled, RAY_USAGE_STATS_ENABLED=0, RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.2
(default only), and fake AWS credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY =
"testing", AWS_DEFAULT_REGION=us-east-1, AWS_EC2_METADATA_DISABLED=true; AWS_PROFILE
removed) so no test can reach a real account. The repository root and this directory are
put on ``PYTHONPATH`` (so Ray workers can import ``pipelines`` and functions defined in test
modules, e.g. a Ray Train loop) and on ``sys.path`` (``import imagegen``).
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
_pp = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
os.environ["PYTHONPATH"] = os.pathsep.join([_REPO, _HERE] + [p for p in _pp if p not in (_REPO, _HERE)])
for _p in (_HERE, _REPO):
    if _p not in sys.path:
        sys.path.insert(0, _p)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if ray.is_initialized():
        yield ray
        return
    tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=tmp,
        object_store_memory=1 << 30,
        logging_level=logging.WARNING,
    )
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
