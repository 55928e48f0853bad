"""``infoform score`` / ``jobs/score.py`` refuse bad input in one line with exit code 2, before
any cluster work (no Ray here); the Ray part runs in tests/pipelines/serve/test_score.py."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_job_script_refuses_a_missing_run_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "jobs" / "score.py"), "--run", str(tmp_path / "nope"),
                        "--data", str(tmp_path), "--output", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "not the output of a finished run (no run.json)" in lines[0], r.stderr
    assert lines[0].startswith("infoform score: error:") and not (tmp_path / "out").exists()


def test_missing_flags_are_one_line(capsys):
    import pytest

    from pipelines.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["score", "--run", "x"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--data" in err[0] and "--output" in err[0]
