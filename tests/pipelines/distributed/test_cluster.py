"""The cluster rules without a cluster: GPU shares that every actor can be placed with, local
paths on several nodes, the stable base of relative outputs, the runtime env of ``--address``."""
from __future__ import annotations

import os

import pytest

from pipelines.distributed.cluster import ClusterShape, check_gpu_request, check_paths, gpu_share, resolve_output
from pipelines.config.load import load_config
from pipelines.errors import PreflightError

#: Ray keeps fractional resources in units of 1e-4.
RAY_UNIT = 10_000


def _placeable(share: float, actors: int, gpus: int) -> bool:
    """Can ``actors`` actors asking for ``share`` GPUs each all run at once on ``gpus`` GPUs?
    Whole requests take whole GPUs; a fraction must fit inside one GPU (Ray's rule), counted in
    Ray's fixed-point units (rounded to nearest: the pessimistic reading for 1/k)."""
    if share == 0:
        return True
    if share >= 1:
        return share == int(share) and actors * int(share) <= gpus
    unit = round(share * RAY_UNIT)
    return (RAY_UNIT // unit) * gpus >= actors


@pytest.mark.parametrize("gpus", range(1, 9))
def test_every_gpu_share_can_be_placed_for_1_to_16_actors(gpus):
    for actors in range(1, 17):
        share = gpu_share(actors, float(gpus))
        assert share > 0
        assert _placeable(share, actors, gpus), (gpus, actors, share)
        assert check_gpu_request(share) is None, (gpus, actors, share)
        # and no more GPUs are left idle than needed: fewer actors per GPU would not fit
        if share < 1:
            k = round(1 / share)
            assert (k - 1) * gpus < actors, (gpus, actors, share)


def test_the_old_snapshot_share_could_not_be_placed():
    """The rule it replaces, ``min(1, GPUs / actors)``: 3 GPUs and 4 actors gave 0.75 each,
    and only three of the four fit (each GPU holds one 0.75 share)."""
    old = min(1.0, 3 / 4)
    assert not _placeable(old, 4, 3)
    assert gpu_share(4, 3.0) == 0.5 and _placeable(0.5, 4, 3)


def test_no_gpu_means_cpu_actors():
    assert gpu_share(4, 0.0) == 0.0 and gpu_share(1, 0.5) == 0.0


@pytest.mark.parametrize("bad", [0.75, 0.4, 1.5, 2.5, 0.3, 1 / 6])
def test_explicit_requests_that_do_not_tile_are_refused(bad):
    assert check_gpu_request(bad) is not None
    with pytest.raises(ValueError, match="evaluate.gpus_per_actor"):
        load_config("smoke", [f"evaluate.gpus_per_actor={bad}"])


@pytest.mark.parametrize("good", [0, 1, 2, 0.5, 0.25, 1 / 3, 0.3333, 0.125, 0.1666])
def test_explicit_requests_that_tile_are_kept(good):
    assert check_gpu_request(good) is None


def _cfg(*overrides: str):
    return load_config("smoke", list(overrides))


def test_local_paths_are_refused_on_several_nodes_unless_shared():
    two = ClusterShape(nodes=2, cpus=2, gpus=0, driver_node_cpus=0)
    one = ClusterShape(nodes=1, cpus=2, gpus=0, driver_node_cpus=2)
    local = _cfg("output=/tmp/out")
    check_paths(local, one)  # one node: every process sees the same disk
    with pytest.raises(PreflightError, match=r"--output /tmp/out is a local path, but the cluster has 2 nodes"):
        check_paths(local, two)
    check_paths(_cfg("output=/tmp/out", "storage.shared_fs=true"), two)
    check_paths(_cfg("output=s3://b/out"), two)  # the demo's data then goes to the output
    with pytest.raises(PreflightError, match="--data /data/imagenet"):
        check_paths(_cfg("output=s3://b/out", "data.demo=false", "data.root=/data/imagenet"), two)
    with pytest.raises(PreflightError, match="--weights /models/r18.pt"):
        check_paths(_cfg("output=s3://b/out", "data.demo=false", "data.root=s3://b/d", "model.name=resnet18",
                         "model.weights=/models/r18.pt"), two)
    # a torchvision weights name is no path
    check_paths(_cfg("output=s3://b/out", "data.demo=false", "data.root=s3://b/d", "model.name=resnet18",
                     "model.weights=ResNet18_Weights.IMAGENET1K_V1"), two)


def test_relative_outputs_resolve_outside_rays_working_dir_copy(monkeypatch, tmp_path):
    assert resolve_output("s3://b/runs/x") == "s3://b/runs/x"
    assert resolve_output("/abs/runs/x") == "/abs/runs/x"
    assert resolve_output("runs/demo", cwd="/home/me/infoform") == "/home/me/infoform/runs/demo"
    copy = "/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_ab12"
    monkeypatch.setenv("INFOFORM_HOME", str(tmp_path))
    assert resolve_output("runs/smoke", cwd=copy) == str(tmp_path / "runs" / "smoke")
    monkeypatch.delenv("INFOFORM_HOME")
    assert resolve_output("runs/smoke", cwd=copy) == os.path.expanduser("~/infoform/runs/smoke")


def test_address_without_job_submit_ships_the_working_dir(monkeypatch):
    from pipelines.cli.main import runtime_env_for

    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    env = runtime_env_for("127.0.0.1:6379")
    assert env is not None and os.path.isfile(os.path.join(env["working_dir"], "jobs", "imagenet_inf.py"))
    assert ".venv" in env["excludes"] and ".git" in env["excludes"]
    assert runtime_env_for(None) is None  # a private local instance runs this checkout anyway
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")  # inside `ray job submit`: the job's own env
    assert runtime_env_for("auto") is None


def test_uncached_torchvision_weights_are_refused_in_preflight(monkeypatch, tmp_path):
    import torch

    from pipelines.cli.preflight import preflight

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))  # an empty cache
    cfg = load_config("smoke", ["output=" + str(tmp_path / "out"), "model.name=resnet18",
                                "model.weights=ResNet18_Weights.IMAGENET1K_V1"])
    with pytest.raises(PreflightError, match="not in this machine's cache.*--weights s3://"):
        preflight(cfg)
    preflight(load_config("smoke", ["output=" + str(tmp_path / "out"), "model.name=resnet18",
                                    "model.weights=ResNet18_Weights.IMAGENET1K_V1", "storage.allow_download=true"]))
