"""``laplace_core`` never imports Ray (docs/design.md §2), and the CLI's ``sizes`` path stays light."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import importlib, json, pkgutil, sys
import laplace_core
names = ["laplace_core"]
for info in pkgutil.walk_packages(laplace_core.__path__, "laplace_core."):
    importlib.import_module(info.name)
    names.append(info.name)
for attr in laplace_core.__all__:
    getattr(laplace_core, attr)
{extra}
print(json.dumps({{"imported": names, "ray": sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))}}))
"""


def probe(extra=""):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    res = subprocess.run([sys.executable, "-c", PROBE.format(extra=extra)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_laplace_core_and_all_submodules_do_not_import_ray():
    out = probe()
    assert "laplace_core.curvature.statistics" in out["imported"] and "laplace_core.posteriors.sizes" in out["imported"]
    assert out["ray"] == []


def test_probe_detects_ray():
    """The check above can fail: importing ray shows up in the same probe."""
    out = probe("import ray")
    assert "ray" in out["ray"]


def test_cli_module_does_not_import_ray():
    out = probe("import pipelines, pipelines.cli.main; pipelines.cli.main.build_parser()")
    assert out["ray"] == []
