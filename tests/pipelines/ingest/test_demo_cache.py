"""The embedded demo's CNN is trained once per machine (``$INFOFORM_CACHE``) and copied into each
run's own folder: a second output reuses the weights, byte for byte, without training; an
unwritable machine cache falls back to training into the run's folder."""
from __future__ import annotations

import json
import os

import pytest

from pipelines.config.load import load_config
from pipelines.ingest import plan as P


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "machine-cache"
    monkeypatch.setenv(P.CACHE_ENV, str(root))
    return root


def _model(out):
    cfg = load_config("smoke", [f"output={out}"])
    plan = P.config_plan(cfg, str(out))
    return P.demo_model(cfg, plan, str(out))


def test_a_second_output_reuses_the_machine_s_trained_cnn(tmp_path, cache):
    spec1, info1 = _model(tmp_path / "run1")
    spec2, info2 = _model(tmp_path / "run2")
    assert not info1["cached"] and info2["cached"]
    assert spec1.weights == str(tmp_path / "run1" / "model" / "small_cnn.safetensors")
    assert spec2.weights == str(tmp_path / "run2" / "model" / "small_cnn.safetensors")
    machine = (cache / "demo" / "model" / "small_cnn.safetensors").read_bytes()
    assert open(spec1.weights, "rb").read() == machine == open(spec2.weights, "rb").read()
    assert info2["cache_path"] == str(tmp_path / "run2" / "model")
    meta = json.loads((tmp_path / "run2" / "model" / "small_cnn.json").read_text())
    assert meta["config"] == info1["config"] and info2["val_accuracy"] == info1["val_accuracy"]


def test_an_unwritable_machine_cache_trains_into_the_run(tmp_path, cache):
    cache.write_text("a file where the cache folder would be")  # unwritable, also for root
    spec, info = _model(tmp_path / "run")
    assert not info["cached"] and os.path.isfile(spec.weights)
    assert info["cache_path"] == str(tmp_path / "run" / "model") and cache.is_file()
