"""An output that holds a stage made with other settings: one line naming the stage and the way
out (``--force``), as a PreflightError (exit 2 in the job), not a traceback; found as a new user
re-running the demo's output with another search algorithm."""
from __future__ import annotations

import pytest

from pipelines.cli.stages import Stages
from pipelines.config.load import load_config
from pipelines.errors import PreflightError
from pipelines.storage.store import RunStore


def test_a_stage_made_with_other_settings_is_one_line_with_the_way_out(tmp_path):
    cfg = load_config("smoke", [f"output={tmp_path}"])
    store = RunStore.open(tmp_path)
    stages = Stages(cfg, store, ensure_ray=lambda: None)
    assert stages.run("search", {"algorithm": "random"}, lambda: {"chosen": 1})["chosen"] == 1
    assert stages.run("search", {"algorithm": "random"}, lambda: pytest.fail("redone"))["chosen"] == 1
    with pytest.raises(PreflightError) as e:
        stages.run("search", {"algorithm": "tpe"}, lambda: pytest.fail("run over another's result"))
    msg = str(e.value)
    assert "\n" not in msg and f"{tmp_path} already holds a search result made with other settings" in msg
    assert "--force search" in msg
