"""The README's demo command from a fresh clone, in a new venv: `make demo` creates `.venv`,
installs the project with one pip command, runs the job on the embedded demo and writes the
report. This is what a new user does first; it is slow (an install plus the demo), so it is
opt-in locally (`INFOFORM_FRESH_DEMO=1`) and on in CI (`.ci/run` sets the variable).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.mark.skipif(os.environ.get("INFOFORM_FRESH_DEMO") != "1",
                    reason="set INFOFORM_FRESH_DEMO=1 to clone, install into a new venv and run `make demo`")
@pytest.mark.timeout(1800)
def test_make_demo_from_a_fresh_clone(tmp_path):
    if shutil.which("git") is None or shutil.which("make") is None:
        pytest.skip("git and make are needed")
    clone = tmp_path / "infoform"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "RAY_ADDRESS"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if "/.venv/" not in p)
    t0 = time.time()
    res = subprocess.run(["make", "demo"], cwd=clone, env=env, capture_output=True, text=True, timeout=1700)
    took = time.time() - t0
    print(f"make demo from a fresh clone: {took:.0f} s (install + demo)")
    assert res.returncode == 0, (res.stdout[-4000:], res.stderr[-4000:])
    assert (clone / ".venv" / "bin" / "python").exists()
    assert "running the embedded demo" in res.stdout
    out = clone / "runs" / "demo"
    assert f"report at {out / 'report.html'}" in res.stdout, res.stdout[-2000:]
    run = json.loads((out / "run.json").read_text())
    assert set(run["results"]) >= {"map", "diag", "kfac", "efb", "inf"}
    for m, r in run["results"].items():
        assert r["status"] == "ok", (m, r)
    html = (out / "report.html").read_text()
    assert 'id="methods-table"' in html and html.count("data:image/png;base64,") >= 3
