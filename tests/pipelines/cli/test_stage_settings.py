"""An output that holds a stage made with other settings: one line naming the stage and the way
out (``--force``), as a PreflightError (exit 2 in the job), not a traceback; found as a new user
re-running the demo's output with another search algorithm."""
from __future__ import annotations

from pathlib import Path

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


def test_a_stage_whose_workers_ray_killed_for_memory_ends_in_one_line(tmp_path):
    """Ray's memory monitor's kill reached the user as Ray Tune's RuntimeError around Ray's
    OutOfMemoryError: ~200 lines of object-store statistics and tracebacks (seen: a resnet18's
    MC-GLM search on a 24 GB node). The stage now ends in one StageError line; its text is
    Ray's own message from that run (data/ray_oom_kill.txt)."""
    from ray.exceptions import OutOfMemoryError

    from pipelines.errors import StageError

    text = (Path(__file__).parent / "data" / "ray_oom_kill.txt").read_text()
    cfg = load_config("smoke", [f"output={tmp_path}"])
    stages = Stages(cfg, RunStore.open(tmp_path), ensure_ray=lambda: None)

    def killed():
        try:
            raise OutOfMemoryError(text)
        except OutOfMemoryError as e:
            raise RuntimeError(f"Caught unexpected exception: {e}") from e

    with pytest.raises(StageError) as e:
        stages.run("search", {}, killed)
    msg = str(e.value)
    assert "\n" not in msg and e.value.__cause__ is None and e.value.__suppress_context__
    assert msg.startswith("stage search: Ray's memory monitor killed 3 worker(s) on node 127.0.0.1 "
                          "(22.92 GB used of 23.54 GB); the largest process: ray::ResourceTrainable.train "
                          "(pid 6725) at 10.96 GB; "), msg
    assert "evaluate.num_actors" in msg
    assert not RunStore.open(tmp_path).exists(RunStore.open(tmp_path).stage_marker_uri("search"))
    with pytest.raises(ValueError, match="not memory"):  # any other error is raised as it was
        stages.run("search", {}, lambda: (_ for _ in ()).throw(ValueError("not memory")))
