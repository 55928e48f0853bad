"""The smoke job's curvature stage on the demo's digits, given two ways: as an ImageFolder
(listed, the listing persisted under <output>/index/) and as ``--data index.parquet`` (a
Parquet file of absolute paths, class names and splits). The curvature sums agree to 1e-12;
a re-submitted job on the folder reuses the persisted index (one line says so) and lists
nothing."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import background  # tests/background.py: whole jobs beside the suite
import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Largest |difference| allowed between the curvature sums of the two runs (float64 sums of
#: the same images in the same partitions; only the reduction's summation order can differ).
SUM_TOL = 1e-12

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _run(*args: str) -> subprocess.CompletedProcess:
    """The smoke job's curvature stage with ``args``, on one Ray Train worker (what is compared is the
    listing and the sums, not the all-reduce: two workers are tests/jobs/test_job.py's)."""
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled",
               PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    res = subprocess.run([sys.executable, "-m", "pipelines.cli.main", "run", "--preset", "smoke",
                          "--stages", "curvature", "--set", "curvature.num_workers=1", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def _index_file(digits: Path, out: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipelines.ingest.index import DataConfig
    from pipelines.ingest.scan import scan

    rows = []
    for split in ("train", "val", "test"):
        ix = scan(DataConfig(root=str(digits), split=split))
        rows += [(f"{ix.root}/{p}", ix.classes[y], split) for p, y in zip(ix.paths, ix.labels)]
    pq.write_table(pa.table({"path": [r[0] for r in rows], "class": [r[1] for r in rows],
                             "split": [r[2] for r in rows]}), out)
    return out


def torch_rng():
    import torch

    return torch.random.fork_rng(devices=[])


def _weights(path: Path) -> str:
    import torch
    from safetensors.torch import save_file

    from pipelines.ingest.models import load_model

    torch.manual_seed(0)
    model = load_model("demo_cnn", num_classes=10)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path))
    return str(path)


@background.job("index_runs")
def _index_jobs(base: Path):
    """The three runs, beside the suite (``tests/background.py``)."""
    from pipelines.ingest.demo_data import write_digits_imagefolder

    digits = base / "digits"
    write_digits_imagefolder(digits, size=32, seed=0)
    idx = _index_file(digits, base / "index.parquet")
    a, b = base / "out-folder", base / "out-index"
    with torch_rng():
        weights = _weights(base / "demo_cnn.safetensors")  # both runs must use the same model
    yield
    first = _run("--data", str(digits), "--weights", weights, "--output", str(a))
    again = _run("--data", str(digits), "--weights", weights, "--output", str(a))
    _run("--data", str(idx), "--weights", weights, "--output", str(b))
    return a, b, first, again


@pytest.fixture(scope="module")
def index_runs(tmp_path_factory):
    return background.result(_index_jobs, tmp_path_factory)


def test_index_parquet_runs_the_smoke_job_with_the_same_sums(index_runs):
    from safetensors.torch import load_file

    a, b, first, again = index_runs
    assert "index train: listed" in first.stdout and (a / "index" / "train.parquet").exists()
    assert "index train: reused" in again.stdout and "index train: listed" not in again.stdout
    assert "stage curvature: done earlier" in again.stdout

    ta = load_file(str(a / "stats" / "reduced" / "tensors.safetensors"))
    tb = load_file(str(b / "stats" / "reduced" / "tensors.safetensors"))
    assert sorted(ta) == sorted(tb) and len(ta) > 0
    for k in ta:
        assert ta[k].shape == tb[k].shape
        assert float((ta[k].double() - tb[k].double()).abs().max()) <= SUM_TOL, k
