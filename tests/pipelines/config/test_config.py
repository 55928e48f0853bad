"""The one config tree: every runtime setting reachable from YAML / --set, derived
mechanically; unknown keys name the closest valid one (data.mean / data.std reaching the
pixels: tests/pipelines/ingest/test_model_factory.py)."""
import dataclasses

import pytest

from pipelines.config.load import derive, load_config
from pipelines.config.schema import ConfigError, CurvatureSpec, DataSpec
from pipelines.config.settings import fingerprint_fields
from pipelines.ingest.index import DataConfig
from pipelines.passes.curvature import CurvatureConfig


def _names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


# runtime fields that are not settings of their own section, and where they come from
CURVATURE_FROM_ELSEWHERE = {"methods": "posterior.methods", "norm_layers": "posterior.norm_layers",
                            "layers": "posterior.layers",
                            "fault_injection": "tests only"}
DATA_FROM_ELSEWHERE = {"split", "classes", "classes_file", "unlabeled", "format", "storage_options",
                       "num_partitions"}  # the run's plan per split; the storage section; data.partition_size


def test_every_curvature_and_data_setting_is_a_config_key():
    assert _names(CurvatureConfig) - _names(CurvatureSpec) == set(CURVATURE_FROM_ELSEWHERE)
    assert _names(DataConfig) - _names(DataSpec) == DATA_FROM_ELSEWHERE


def test_derive_copies_shared_fields_and_keeps_defaults_for_null():
    cfg = load_config("smoke", ["curvature.efb_max_examples=7", "curvature.model_dtype=float64",
                                "curvature.bucket_mb=2", "data.decode_batch_size=16"])
    c = derive(CurvatureConfig, cfg.curvature, methods=("diag",))
    assert (c.efb_max_examples, c.model_dtype, c.bucket_mb) == (7, "float64", 2.0)
    d = derive(DataConfig, cfg.data, root="/x", split="train")
    assert d.decode_batch_size == 16 and d.mean == DataConfig(root="/x").mean  # data.mean: null -> the default


@pytest.mark.parametrize("override, suggestion", [
    ("curvature.num_worker=3", "curvature.num_workers"),
    ("curvatur.num_workers=3", "curvature"),
    ("evaluate.ece_bin=10", "evaluate.ece_bins"),
    ("data.meen=[0.5,0.5,0.5]", "data.mean"),
])
def test_unknown_key_is_one_line_naming_the_closest_valid_key(override, suggestion):
    with pytest.raises(ConfigError) as e:
        load_config("smoke", [override])
    msg = str(e.value)
    assert "\n" not in msg and f"did you mean {suggestion}?" in msg, msg


def test_unknown_key_far_from_any_gives_the_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown key curvature\.zzzzzz \(valid keys here: num_workers"):
        load_config("smoke", ["curvature.zzzzzz=1"])


@pytest.mark.parametrize("override", ["curvature.model_dtype=float16", "curvature.bucket_mb=0",
                                      "curvature.efb_max_examples=0", "data.decode_batch_size=0"])
def test_new_runtime_keys_are_validated_in_one_line(override):
    with pytest.raises(ConfigError) as e:
        load_config("smoke", [override])
    assert "\n" not in str(e.value) and override.split("=")[0] in str(e.value)


def _curvature_config(cfg):
    """As the run builds it (pipelines.cli.model_run.ModelRun.curvature)."""
    return derive(CurvatureConfig, cfg.posterior, cfg.curvature, methods=("diag",))


def test_posterior_layers_reaches_the_curvature_config_and_its_fingerprint():
    default = load_config("smoke")
    fp = fingerprint_fields(_curvature_config(default))
    assert default.posterior.layers == "all" and (fp["layers"], fp["norm_layers"]) == ("all", "map")
    last = load_config("smoke", ["posterior.layers=last"])
    assert _curvature_config(last).layers == "last"
    assert fingerprint_fields(_curvature_config(last))["layers"] == "last"
    some = load_config("smoke", ["posterior.layers=[fc2, 'conv*']", "posterior.norm_layers=diag"])
    assert some.posterior.layers == ("fc2", "conv*")
    fp_some = fingerprint_fields(_curvature_config(some))
    assert (fp_some["norm_layers"], fp_some["layers"]) == ("diag", ["fc2", "conv*"])
    with pytest.raises(ConfigError, match="posterior.layers must be 'all', 'last' or a non-empty list"):
        load_config("smoke", ["posterior.layers=[]"])
    with pytest.raises(ValueError, match="layers must be"):
        CurvatureConfig(layers=[])
