"""A model of one's own (``--model package.module:callable``) and the input normalisation
``data.mean`` / ``data.std`` from YAML and ``--set``."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipelines.config.schema import ConfigError

from pipelines.config.load import load_config
from pipelines.ingest.models import load_model

ROOT = Path(__file__).resolve().parents[3]
JOB = ROOT / "jobs" / "imagenet_inf.py"

MODULE = textwrap.dedent("""
    import torch
    from torch import nn

    def net(num_classes=3):
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(12, num_classes))

    def broken():
        raise RuntimeError("no GPU here\\nsecond line")

    def not_a_module():
        return 42

    class Zoo:
        @staticmethod
        def small():
            return nn.Linear(4, 2)
""")


@pytest.fixture
def usermod(tmp_path, monkeypatch):
    (tmp_path / "my_models_pkg").mkdir()
    (tmp_path / "my_models_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_models_pkg" / "nets.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for k in [k for k in sys.modules if k.startswith("my_models_pkg")]:
        del sys.modules[k]


def test_factory_builds_the_model_in_eval_mode_and_loads_weights(usermod, tmp_path):
    m = load_model("my_models_pkg.nets:net")
    assert isinstance(m, torch.nn.Module) and not m.training and m[1].out_features == 3
    assert load_model("my_models_pkg.nets:net", num_classes=5)[1].out_features == 5
    assert isinstance(load_model("my_models_pkg.nets:Zoo.small"), torch.nn.Linear)
    sd = {k: torch.full_like(v, 0.25) for k, v in m.state_dict().items()}
    torch.save(sd, tmp_path / "w.pt")
    got = load_model("my_models_pkg.nets:net", str(tmp_path / "w.pt"))
    assert torch.equal(got[1].weight, sd["1.weight"])


@pytest.mark.parametrize("name,needle", [
    ("no_such_pkg_xyz.mod:f", "cannot import module 'no_such_pkg_xyz.mod'"),
    ("my_models_pkg.nets:nope", "has no attribute 'nope'"),
    ("my_models_pkg.nets:broken", "raised RuntimeError: no GPU here"),
    ("my_models_pkg.nets:not_a_module", "returned int, not a torch.nn.Module"),
    ("my_models_pkg.nets:", "must look like package.module:callable"),
])
def test_factory_errors_are_one_line(usermod, name, needle):
    with pytest.raises(ValueError) as e:
        load_model(name)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_factory_state_dict_that_does_not_fit(usermod, tmp_path):
    torch.save({"1.weight": torch.zeros(3, 7), "1.bias": torch.zeros(3)}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"shape mismatch for '1.weight': weights have \(3, 7\), model expects \(3, 12\)"):
        load_model("my_models_pkg.nets:net", str(tmp_path / "bad.pt"))


def _one_line_exit_2(res, needle):
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], res.stderr
    assert "Traceback" not in res.stderr


def test_job_exits_2_for_a_factory_that_does_not_import(tmp_path):
    (tmp_path / "train").mkdir()
    env = dict(os.environ, RAY_ADDRESS="")
    res = subprocess.run([sys.executable, str(JOB), "--preset", "smoke", "--set", "data.demo=false",
                          "--data", str(tmp_path), "--model", "no_such_pkg_xyz.mod:net", "--output", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    _one_line_exit_2(res, "cannot import module 'no_such_pkg_xyz.mod'")


def test_data_mean_std_from_set_and_yaml(tmp_path):
    cfg = load_config("smoke", ["data.mean=[0.5, 0.25, 0.0]", "data.std=[0.5,0.5,1]"])
    assert cfg.data.mean == (0.5, 0.25, 0.0) and cfg.data.std == (0.5, 0.5, 1.0)
    y = tmp_path / "p.yaml"
    y.write_text("data:\n  demo: true\n  mean: [0.1, 0.2, 0.3]\n  std: [1, 1, 1]\n")
    assert load_config(str(y)).data.mean == (0.1, 0.2, 0.3)
    with pytest.raises(ConfigError, match="data.std must be > 0"):
        load_config("smoke", ["data.std=[1, 0, 1]"])
    with pytest.raises(ConfigError, match="data.mean"):
        load_config("smoke", ["data.mean=[1, 2]"])


def test_set_data_mean_changes_what_the_model_sees(tmp_path):
    """The job's data config (pipelines.cli.run) carries data.mean / data.std into the decode
    transform: the same JPEG decodes to ``(x/255 − mean) / std`` with the values set."""
    from pipelines.ingest.batches import iter_local_batches
    from pipelines.ingest.scan import scan
    from pipelines.ingest.plan import DataPlan as _DataPlan, data_config as _data_config

    for c in ("a", "b"):
        (tmp_path / "train" / c).mkdir(parents=True)
        Image.fromarray(np.full((8, 8, 3), 200 if c == "a" else 40, np.uint8)).save(tmp_path / "train" / c / "x.png")
    plan = _DataPlan(root=str(tmp_path), ood=None, mean=None, std=None, demo=None)
    seen = {}
    for tag, sets in (("default", []), ("set", ["data.mean=[0.5, 0.5, 0.5]", "data.std=[0.25, 0.25, 0.25]"])):
        cfg = load_config("smoke", ["data.demo=false", f"data.root={tmp_path}", "data.image_size=8",
                                    "data.resize_size=8", *sets])
        dc = _data_config(cfg, plan, "train")
        batch = next(iter_local_batches(scan(dc), dc))
        seen[tag] = batch["image"]
    pix = np.array([200, 40], np.float32) / 255
    want_default = (pix[:, None] - np.array([0.485, 0.456, 0.406], np.float32)) / np.array([0.229, 0.224, 0.225], np.float32)
    assert np.allclose(seen["default"][:, :, 0, 0], want_default, atol=1e-5)
    assert np.allclose(seen["set"][:, :, 0, 0], ((pix - 0.5) / 0.25)[:, None].repeat(3, 1), atol=1e-5)


def test_a_module_beside_the_user_is_found_in_the_working_directory(tmp_path, monkeypatch):
    """``--model mynet_cwd:Net`` run from the folder holding ``mynet_cwd.py`` (the docs' promise; a
    user's first try said "cannot import module 'mynet'"); a name found nowhere still says so."""
    (tmp_path / "mynet_cwd.py").write_text("from torch import nn\n\ndef Net(num_classes=2):\n"
                                           "    return nn.Linear(3, num_classes)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        assert load_model("mynet_cwd:Net", num_classes=5).out_features == 5
        with pytest.raises(ValueError, match="cannot import module 'nowhere_cwd'"):
            load_model("nowhere_cwd:Net")
    finally:
        sys.modules.pop("mynet_cwd", None)
