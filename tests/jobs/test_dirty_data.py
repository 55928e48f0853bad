"""A user's dirty ImageFolder through the whole job: the counts are right, and the same, in
``run.json``, the report (Markdown and HTML) and the job's log.

The train folder holds, besides real JPEGs, a ``notes.txt`` (not an image suffix: ignored,
never indexed), a corrupt JPEG, a truncated JPEG, a zero-byte ``.JPEG`` and a text file named
``.JPEG`` (four images that fail to decode: skipped in each pass, counted per pass), and four
odd-but-valid images (grayscale, CMYK, RGBA PNG named .JPEG, palette PNG); the flat val folder
holds a ``README.md`` (ignored). Before: run.json said ``skipped_images: {}``, the report
"Skipped images: 0", ``notes.txt`` was an image, ``README.md`` one of the search images, and the
log said nothing. Smoke-sized: 16x16 images, ``tiny_cnn``, one Train worker, ``diag`` and
``efb`` (two passes), two search configurations.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import background  # tests/background.py: whole jobs beside the suite
import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "jobs" / "imagenet_inf.py"

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


imagegen = _load("infoform_test_imagegen_dirty", ROOT / "tests" / "pipelines" / "imagegen.py")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    return env


@background.job("dirty_run")
def _dirty_job(base: Path):
    """The dirty folder's job, run beside the suite (``tests/background.py``)."""
    import torch

    from pipelines.ingest.models import tiny_cnn

    tree = imagegen.make_imagenet_tree(base / "data", per_class=4, n_val=12, size=(24, 20), bad=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.save(tiny_cnn(len(imagegen.ALL_CLASSES)).state_dict(), base / "tiny.pt")
    out = base / "out"
    sets = ["curvature.num_workers=1", "curvature.cpus_per_worker=0.5", "curvature.use_gpu=false",
            "curvature.batch_size=8", "data.image_size=16", "data.resize_size=16", "data.partition_size=100",
            "search.num_configs=2", "search.mc_samples=2", "search.log10_n=[2.0, 3.0]",
            "search.log10_tau=[0.0, 2.0]", "evaluate.mc_samples=2", "evaluate.num_actors=1",
            "evaluate.batch_size=16", "evaluate.gpus_per_actor=null"]
    cmd = [sys.executable, str(JOB), "--preset", "imagenet-resnet50", "--model", "tiny_cnn", "--weights",
           str(base / "tiny.pt"), "--data", str(base / "data"), "--methods", "diag,efb", "--output", str(out)]
    for s in sets:
        cmd += ["--set", s]
    yield
    res = subprocess.run(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
                         cwd=ROOT)
    (base / "job.log").write_text(res.stdout)
    assert res.returncode == 0, res.stdout[-6000:]
    return tree, out, res.stdout


@pytest.fixture(scope="module")
def dirty_run(tmp_path_factory):
    return background.result(_dirty_job, tmp_path_factory)


def test_counts_are_the_same_in_run_json_the_report_and_the_log(dirty_run):
    tree, out, log = dirty_run
    invalid = sorted(tree.train_invalid)
    assert len(invalid) == 4
    run = json.loads((out / "run.json").read_text())
    # indexed by suffix: notes.txt and README.md are not images
    assert run["data"]["train"]["num_files"] == len(tree.train_good) + len(tree.train_bad)
    assert run["ignored_files"] == {"train": {"count": 1, "examples": ["n01443537/notes.txt"]},
                                    "val": {"count": 1, "examples": ["README.md"]}}
    assert run["data"]["train"]["ignored_files"] == 1
    # undecodable: per split, per pass; the held-out splits are clean
    sk = run["skipped_images"]
    assert sk["train"]["count"] == 4 and sk["train"]["passes"] == {"pass1": 4, "pass2": 4}, sk
    assert [e["path"] for e in sk["train"]["examples"]] == invalid[:3]
    reasons = {e["path"]: e["reason"] for e in sk["train"]["examples"]}
    assert all(reasons.values()), reasons
    assert sk["search"]["count"] == 0 and sk["test"]["count"] == 0
    assert sum(d["count"] for d in sk.values()) == 4

    md = (out / "report.md").read_text()
    assert "- **Skipped images (undecodable or unreadable)**: 4" in md, md
    assert "train: 4 (pass1 4, pass2 4)" in md
    assert "- **Ignored files (not an image suffix; data.extensions adds suffixes)**: 2" in md
    assert "train: 1 (n01443537/notes.txt)" in md and "val: 1 (README.md)" in md
    for p in invalid[:3]:
        assert p in md
    html = (out / "report.html").read_text()
    assert "Skipped images (undecodable or unreadable):</b> 4" in html
    assert "not an image suffix; data.extensions adds suffixes):</b> 2" in html

    lines = log.splitlines()
    ignored = [ln for ln in lines if "file(s) ignored, not an image suffix" in ln]
    assert len(ignored) == 2 and "data: train: 1 file(s)" in ignored[0] and "n01443537/notes.txt" in ignored[0]
    assert "data: val: 1 file(s)" in ignored[1] and "README.md" in ignored[1]
    skipped = [ln for ln in lines if "could not be decoded" in ln]
    assert len(skipped) == 1 and "data: train: 4 image(s) could not be decoded and were skipped (pass1 4; pass2 4)" \
        in skipped[0], skipped
    assert invalid[0] in skipped[0]
    assert any("verdict: 4 image(s) skipped as undecodable, 2 non-image file(s) ignored" in ln for ln in lines)


def test_the_log_is_plain_text_with_progress_and_ends_with_the_verdict(dirty_run):
    _, out, log = dirty_run
    # no colour codes in a log file; Ray Train's PreemptionWatcher (core_worker.cc's error line) is off
    assert "\x1b[" not in log and "core_worker.cc" not in log and "PreemptionWatcher" not in log
    lines = [ln for ln in log.splitlines() if ln.strip()]
    for title in ("pass 1 (KFAC factors and diagonal)", "pass 2 (EFB eigenvalues)"):
        done = [ln for ln in lines if title in ln and re.search(r"\d+/\d+ images done in [\d.]+ s, [\d.]+ images/s", ln)]
        assert done, (title, lines)
    assert sum("declares no GPU" in ln for ln in lines) == 1
    assert lines[-1] == f"infoform: report at {out / 'report.html'}"
    verdict = [ln for ln in lines[-7:-1] if ln.startswith("infoform: verdict: ")]
    assert 3 <= len(verdict) <= 6 and lines[-1 - len(verdict):-1] == verdict, lines[-8:]
