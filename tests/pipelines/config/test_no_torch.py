"""Checking a run configuration, listing images and decoding them import no torch (issue 43).

Every Ray Data decode task and split coordinator deserialises ``read_decode_batch`` and with it
:mod:`pipelines.ingest.decode`; every job launch builds and checks a configuration. When the
configuration imported the torch modules that own the names it checks, each of those processes
paid torch's import (about 1.5 CPU-s here) for nothing; the names now live in the torch-free
:mod:`laplace_core.names` and :mod:`laplace_core.posteriors.methods`.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CODE = """
import sys
import laplace_core.names, laplace_core.posteriors.methods
import pipelines.config.load, pipelines.ingest.decode, pipelines.ingest.index
from pipelines.config.load import load_config
cfg = load_config("smoke")
assert cfg.posterior.methods, cfg
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_the_configuration_and_the_decoder_import_no_torch():
    res = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "[]", res.stdout[-2000:]


def test_the_registry_and_the_builders_agree():
    from laplace_core.posteriors.build import METHODS
    from laplace_core.posteriors.layer_builders import BUILDERS
    from laplace_core.posteriors.methods import REGISTRY, layer_methods

    assert sorted(METHODS) == sorted(layer_methods())
    assert {m.builder for m in REGISTRY.values() if m.per_layer} == set(BUILDERS)
