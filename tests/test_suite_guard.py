"""The count guard (tests/suite_guard.py, issue 43 acceptance 2): what it counts, and a planted extra
job fails a run whose every test passes, while a run of a subset of the same file does not."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import suite_guard as sg

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


@pytest.mark.parametrize("argv, kind", [
    ([PY, str(REPO / "jobs" / "imagenet_inf.py"), "--preset", "smoke"], "jobs"),
    ([PY, "jobs/core_demo.py"], "jobs"),
    ([PY, "jobs/imagenet_inf.py", "--preset", "smoke", "--dry-run"], None),
    ([PY, "-m", "pipelines", "run", "--preset", "smoke"], "jobs"),
    ([PY, "-m", "pipelines.cli.main", "run", "--preset", "smoke"], "jobs"),
    ([PY, "-m", "pipelines", "run", "--preset", "smoke", "--dry-run"], None),
    ([PY, "-m", "pipelines", "sizes", "--model", "resnet18"], None),
    (["/x/.venv/bin/ray", "start", "--head", "--port=6379"], "ray_instances"),
    (["/x/.venv/bin/ray", "start", "--address=127.0.0.1:6379"], None),
    (["ray", "job", "submit", "--address", "http://127.0.0.1:8265", "--", "python", "jobs/imagenet_inf.py"], "jobs"),
    (["ray", "status"], None),
    (["make", "demo"], "jobs"),
    ([PY, "benchmarks/paper/table2.py", "--configs", "8"], "jobs"),
    (["make", "install"], None),
    ([PY, "-c", "import ray; ray.init(num_cpus=1)"], "ray_instances"),
    ([PY, "-c", "import ray, sys\nray.init(address=sys.argv[1], logging_level='ERROR')", "127.0.0.1:6379"], None),
    ([PY, "-c", "import ray.tune"], None),
    ([PY, "-m", "pytest", "-q", "x.py"], None),
    ("git clone a b", None),
])
def test_child_processes_are_classified(argv, kind):
    assert sg.classify(argv) == kind


def test_a_count_over_budget_is_one_line_per_file_and_kind():
    budget = {"tests/a.py": {"ray_instances": 1, "jobs": 2}}
    counts = {"tests/a.py": {"ray_instances": 1, "jobs": 3}, "tests/new.py": {"ray_instances": 1, "jobs": 0}}
    assert sg.over_budget(counts, budget) == ["tests/a.py: 3 jobs (budget 2)", "tests/new.py: 1 ray_instances (budget 0)"]
    assert sg.over_budget({"tests/a.py": {"ray_instances": 0, "jobs": 1}}, budget) == []


def test_ray_init_and_the_in_process_job_are_wrapped_once_imported():
    import ray

    import pipelines.cli.run as run_module

    assert getattr(ray.init, "_suite_counted", False) and getattr(run_module.run, "_suite_counted", False)


def test_the_suite_s_budget_file_reads_and_names_existing_files():
    budget = sg.load_budget(Path(sg.__file__).with_name("budget.toml"))
    for key in budget:
        assert (REPO / key).is_file(), key


PLANTED = textwrap.dedent('''
    import subprocess, sys
    import pytest
    JOB = {job!r}

    def test_first():  # the real job script, ended after half a second: a launch that ran, the cheapest
        with pytest.raises(subprocess.TimeoutExpired):
            subprocess.run([sys.executable, JOB, "--preset", "smoke", "--output", "out"], capture_output=True,
                           timeout=0.5)

    def test_rejected():  # bad input: exit 2 before any cluster work, listed but not budgeted
        res = subprocess.run([sys.executable, JOB, "--preset", "nope"], capture_output=True, text=True, timeout=120)
        assert res.returncode == 2, res.stderr

    def test_planted_extra_job():  # the in-process job, refused at once (no config): charged when called
        from pipelines.cli.run import run
        with pytest.raises(AttributeError):
            run(None)
''')


def _child(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, INFOFORM_SUITE_BUDGET=str(tmp_path / "budget.toml"),
               PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO)]))
    env.pop("INFOFORM_SUITE_LEDGER", None)
    return subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "suite_guard",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_planted.py"), *extra],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_planted_extra_job_fails_the_run_and_a_subset_within_budget_does_not(tmp_path):
    (tmp_path / "test_planted.py").write_text(PLANTED.format(job=str(REPO / "jobs" / "imagenet_inf.py")))
    (tmp_path / "budget.toml").write_text('[budget."test_planted.py"]\njobs = 1\n')
    full = _child(tmp_path)
    out = full.stdout + full.stderr
    assert full.returncode == 1 and "3 passed" in out, out[-3000:]
    assert "OVER BUDGET: test_planted.py: 2 jobs (budget 1)" in out, out[-3000:]
    assert "(and 1 job launches rejected with exit 2)" in out, out[-3000:]
    subset = _child(tmp_path, "-k", "test_first or test_rejected")
    out = subset.stdout + subset.stderr
    assert subset.returncode == 0 and "2 passed" in out and "OVER BUDGET" not in out, out[-3000:]
    assert "test_planted.py: ray_instances 0/0, jobs 1/1 (and 1 job" in out, out[-3000:]


def test_the_timeline_lists_the_longest_files_in_start_order_and_every_background_job():
    files = {"tests/a.py": [100.0, 110.0], "tests/b.py": [105.0, 400.0], "tests/c.py": [400.0, 401.0]}
    lines = sg.timeline(files, [("dirty_job", 120.0, 300.0)], wall0=100.0, top=2)
    assert [ln.split()[-1] for ln in lines] == ["tests/a.py", "tests/b.py", "dirty_job"]  # c.py: the shortest
    assert lines[1].split()[:3] == ["5-300", "295", "s"] and "[background]" in lines[2]
