"""Every shipped preset, ``custom`` included, runs temperature scaling as the first row after MAP
(issue #38: the baseline a Laplace row is read against)."""
from __future__ import annotations

import pytest

from pipelines.config.load import list_presets, load_config


@pytest.mark.parametrize("preset", list_presets())
def test_temperature_is_the_first_method(preset):
    sets = [] if preset in ("demo", "smoke") else ["data.root=/data/x", "model.name=resnet18"]
    try:
        cfg = load_config(preset, sets)
    except Exception as e:  # a preset that needs other settings: read the methods from the YAML itself
        import yaml

        from pipelines.config.load import PRESETS_DIR

        methods = yaml.safe_load((PRESETS_DIR / f"{preset}.yaml").read_text())["posterior"]["methods"]
        assert methods[0] == "temperature", (preset, methods, e)
        return
    assert cfg.posterior.methods[0] == "temperature", (preset, cfg.posterior.methods)
