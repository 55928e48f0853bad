"""Every user error of the job: exit code 2 and one line saying what is wrong and what is
valid, before any cluster work (no Ray is started by these)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "jobs" / "imagenet_inf.py"


def _run(*args: str, cwd=ROOT):
    env = dict(os.environ, RAY_ADDRESS="")
    return subprocess.run([sys.executable, str(JOB), *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=cwd)


def _one_line_error(res, *needles: str):
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert "error:" in lines[0]
    for n in needles:
        assert n in lines[0], lines[0]
    assert "Traceback" not in res.stderr and "Started a local Ray" not in res.stdout + res.stderr


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    import torch
    import torchvision

    p = tmp_path_factory.mktemp("w") / "r18.pt"
    torch.save(torchvision.models.resnet18(num_classes=4).state_dict(), p)
    return p


def test_bad_flag():
    _one_line_error(_run("--no-such-flag"), "--no-such-flag")


def test_unknown_preset_lists_valid_ones():
    _one_line_error(_run("--preset", "nope"), "unknown preset", "smoke", "demo")


def test_preset_that_does_not_parse(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("model:\n  name: [resnet50\n")
    _one_line_error(_run("--preset", str(bad)), "does not parse", "line")


def test_unknown_key_in_override():
    _one_line_error(_run("--preset", "smoke", "--set", "curvature.nope=1"), "unknown key curvature.nope",
                    "num_workers")


def test_negative_actor_resources():
    _one_line_error(_run("--preset", "smoke", "--set", "evaluate.gpus_per_actor=-1"), "evaluate.gpus_per_actor",
                    ">= 0")
    _one_line_error(_run("--preset", "smoke", "--set", "evaluate.cpus_per_actor=-0.5"), "evaluate.cpus_per_actor")


def test_actor_resources_as_given_or_a_share_of_the_gpus():
    """Explicit ``evaluate.gpus_per_actor`` is used as is (no Ray needed); null asks the
    cluster (0 on CPU clusters: the jobs' tests; on the 1-GPU smoke run, 2 actors got 0.5 each)."""
    from pipelines.config import EvalSpec
    from pipelines.run import _actor_resources

    assert _actor_resources(EvalSpec(gpus_per_actor=0.25, cpus_per_actor=2)) == {"cpus_per_actor": 2.0,
                                                                                "gpus_per_actor": 0.25}


def test_unknown_model_lists_valid_ones():
    _one_line_error(_run("--preset", "smoke", "--model", "resnet5O"), "unknown model", "resnet50", "densenet121")


def test_unknown_method_lists_valid_ones():
    _one_line_error(_run("--preset", "smoke", "--methods", "diag,laplace"), "unknown method", "inf", "kfac")


def test_missing_data_path(weights):
    _one_line_error(_run("--preset", "imagenet-resnet50", "--data", "/nonexistent/imagenet", "--weights",
                         str(weights)), "data root not found", "/nonexistent/imagenet")


def test_missing_weights_file(tmp_path):
    _one_line_error(_run("--preset", "imagenet-resnet50", "--data", str(tmp_path), "--weights",
                         str(tmp_path / "missing.pt")), "weights file not found")


def test_missing_ood_folder(tmp_path, weights):
    (tmp_path / "train" / "n01").mkdir(parents=True)
    _one_line_error(_run("--preset", "imagenet-resnet50", "--data", str(tmp_path), "--weights", str(weights),
                         "--ood", str(tmp_path / "nope")), "OOD folder not found")


def test_dry_run_prints_the_config():
    res = _run("--preset", "smoke", "--set", "evaluate.mc_samples=3", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "mc_samples: 3" in res.stdout and "preset: smoke" in res.stdout


def test_infoform_run_is_the_same_entry_point():
    res = subprocess.run([sys.executable, "-m", "pipelines", "run", "--preset", "nope"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    _one_line_error(res, "infoform run: error", "unknown preset")


def test_unknown_norm_layers_mode():
    _one_line_error(_run("--preset", "smoke", "--set", "posterior.norm_layers=full"), "posterior.norm_layers",
                    "map, diag")
