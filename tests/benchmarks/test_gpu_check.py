"""benchmarks/gpu_check.py (issue 42) in its ``--tiny`` CPU mode, so that the one-GPU check cannot rot
before a GPU is at hand: every phase but the CUDA tests runs on a tiny CNN (seconds), the JSON has
the structure docs/benchmarks.md tells a GPU session to record, and the precision check (e) holds
on CPU within the bound docs/design.md states (and fails when the bound is made impossible)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check, gpu_check_parts as parts  # noqa: E402

PASS_KEYS = {"batch", "measured_batches", "wall_s", "img_per_s", "batch_s_median", "peak_mem_mib"}


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "tiny.json"
    assert gpu_check.main(["--tiny", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_tiny_run_writes_every_phase(doc):
    assert doc["schema"] == gpu_check.SCHEMA and doc["device"] == "cpu"
    assert set(doc["phases"]) == set(gpu_check.PHASES)
    for key in ("python", "torch", "torchvision", "kronfluence", "ray", "cuda_available"):
        assert key in doc["env"], key
    status = {k: v["status"] for k, v in doc["phases"].items()}
    kron = "ok" if doc["env"]["kronfluence"] else "skipped"
    assert status == {"check": "ok", "passes": "ok", "kronfluence": kron, "mc_forward": "ok",
                      "cuda_tests": "skipped"}, {k: doc["phases"][k].get("reason") for k in status}
    assert doc["summary"]["phases"] == status and doc["summary"]["check_ok"] is True


def test_tiny_passes_and_forward_have_figures(doc):
    configs = doc["phases"]["passes"]["configs"]
    assert set(configs) == set(gpu_check.TINY["configs"].split(","))
    for cfg, rec in configs.items():
        for name in ("pass1", "efb"):
            assert set(rec[name]) == PASS_KEYS, (cfg, name)
            assert rec[name]["measured_batches"] == gpu_check.TINY["batches"] - gpu_check.TINY["warmup"] - 1
            assert rec[name]["img_per_s"] > 0 and rec[name]["peak_mem_mib"] is None  # CPU: no CUDA memory
        assert doc["summary"][f"pass1_{cfg}_img_s"] == rec["pass1"]["img_per_s"]
    assert configs["bf16"]["precision"] == "bf16" and configs["bf16"]["channels_last"] is False  # CPU
    mc = doc["phases"]["mc_forward"]
    assert mc["K"] == gpu_check.TINY["mc"] and mc["method"] == "inf"
    for prec in ("plain_fp32", "fp32", "bf16"):
        assert mc[prec]["img_per_s"] > 0, prec
    if doc["env"]["kronfluence"]:
        kron = doc["phases"]["kronfluence"]
        assert kron["version"] == "1.0.1"
        assert set(kron["covariance"]) == PASS_KEYS and kron["lambda"]["img_per_s"] > 0


def test_tiny_precision_check_holds_on_cpu(doc):
    check = doc["phases"]["check"]
    assert check["rtol"] == parts.BF16_CHECK_RTOL and check["reference"] == "fp32_strict"
    bf16 = check["errors"]["bf16"]
    assert set(bf16["worst"]) == {"A", "G", "diag", "efb"}
    assert 0 < max(bf16["worst"].values()) <= parts.BF16_CHECK_RTOL, bf16["worst"]
    # on a CPU the TF32 flags change nothing: those configs equal the reference exactly
    assert max(check["errors"]["fp32_tf32"]["worst"].values()) == 0.0


def test_precision_check_fails_past_its_bound():
    torch.manual_seed(0)
    from pipelines.ingest.models import tiny_cnn

    model = tiny_cnn(10).eval()
    x, y = parts.make_data(10, 16, 16, torch.device("cpu"), seed=1)
    rec, _, _ = parts.precision_check(model, [(x[:8], y[:8]), (x[8:], y[8:])], ["bf16"], rtol=1e-6)
    assert rec["ok"] is False and max(rec["errors"]["bf16"]["worst"].values()) > 1e-6


def test_cuda_only_tests_are_found():
    ids = gpu_check.cuda_tests()
    assert "tests/core/test_device.py" in ids
    assert any(i.startswith("tests/pipelines/evaluation/test_evaluate.py::") for i in ids)
    assert any(i.startswith("tests/pipelines/passes/test_curvature.py::") for i in ids)
    for node in ids:
        path, _, name = node.partition("::")
        assert (ROOT / path).is_file() and (not name or f"def {name}(" in (ROOT / path).read_text())
    assert not gpu_check.needs_ray("tests/core/test_device.py")
    assert gpu_check.needs_ray(next(i for i in ids if i.startswith("tests/pipelines/")))


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as e:
        gpu_check.parse(["--tiny", "--configs", "fp8"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        gpu_check.parse(["--batches", "2", "--warmup", "2"])
    assert e.value.code == 2


def test_the_pass_1_profile_runs_on_cpu(tmp_path):
    """benchmarks/gpu_profile.py (the GPU session's follow-up) on a tiny CNN: the table names the
    statistics' kernels, so that the script a GPU session runs cannot rot."""
    from benchmarks import gpu_profile

    out = tmp_path / "profile.txt"
    assert gpu_profile.main(["--device", "cpu", "--model", "tiny_cnn", "--classes", "10", "--size", "16",
                             "--batch", "4", "--batches", "1", "--configs", "fp32_default", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("==== fp32_default") and "aten::addmm" in text and "aten::convolution" in text
