"""Every user error of the job: exit code 2 and one line saying what is wrong and what is
valid, before any cluster work (no Ray is started by these)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "jobs" / "imagenet_inf.py"


def _run(*args: str, cwd=ROOT):
    env = dict(os.environ, RAY_ADDRESS="")
    return subprocess.run([sys.executable, str(JOB), *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=cwd)


def _one_line_error(res, *needles: str):
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert "error:" in lines[0]
    for n in needles:
        assert n in lines[0], lines[0]
    assert "Traceback" not in res.stderr and "Started a local Ray" not in res.stdout + res.stderr


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    import torch
    import torchvision

    p = tmp_path_factory.mktemp("w") / "r18.pt"
    torch.save(torchvision.models.resnet18(num_classes=4).state_dict(), p)
    return p


def test_bad_flag():
    _one_line_error(_run("--no-such-flag"), "--no-such-flag")


def test_unknown_preset_lists_valid_ones():
    _one_line_error(_run("--preset", "nope"), "unknown preset", "smoke", "demo")


def test_preset_that_does_not_parse(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("model:\n  name: [resnet50\n")
    _one_line_error(_run("--preset", str(bad)), "does not parse", "line")


def test_unknown_key_in_override():
    _one_line_error(_run("--preset", "smoke", "--set", "curvature.nope=1"), "unknown key curvature.nope",
                    "num_workers")


def test_negative_actor_resources():
    _one_line_error(_run("--preset", "smoke", "--set", "evaluate.gpus_per_actor=-1"), "evaluate.gpus_per_actor",
                    ">= 0")
    _one_line_error(_run("--preset", "smoke", "--set", "evaluate.cpus_per_actor=-0.5"), "evaluate.cpus_per_actor")


def test_actor_resources_as_given_or_a_share_of_the_gpus():
    """Explicit ``evaluate.gpus_per_actor`` is used as is (no Ray needed); null asks the
    cluster (0 on CPU clusters: the jobs' tests; on the 1-GPU smoke run, 2 actors got 0.5 each)."""
    from pipelines.config.schema import EvalSpec
    from pipelines.cli.model_run import actor_resources as _actor_resources

    assert _actor_resources(EvalSpec(gpus_per_actor=0.25, cpus_per_actor=2)) == {"cpus_per_actor": 2.0,
                                                                                "gpus_per_actor": 0.25}


def test_unknown_model_lists_valid_ones():
    _one_line_error(_run("--preset", "smoke", "--model", "resnet5O"), "unknown model", "resnet50", "densenet121")


def test_unknown_model_suggests_the_close_names():
    """A torchvision family name without its size (a new user's guess) names the models it meant."""
    _one_line_error(_run("--preset", "smoke", "--model", "mobilenet_v3"), "unknown model 'mobilenet_v3'",
                    "did you mean", "mobilenet_v3_small", "mobilenet_v3_large")


def test_unknown_method_lists_valid_ones():
    _one_line_error(_run("--preset", "smoke", "--methods", "diag,laplace"), "unknown method", "inf", "kfac")


def test_missing_data_path(weights):
    _one_line_error(_run("--preset", "imagenet-resnet50", "--data", "/nonexistent/imagenet", "--weights",
                         str(weights)), "data root not found", "/nonexistent/imagenet")


def test_data_pointing_at_a_split_suggests_its_parent(tmp_path, weights):
    for split in ("train", "val"):
        (tmp_path / "mine" / split / "n01").mkdir(parents=True)
    _one_line_error(_run("--preset", "imagenet-resnet50", "--data", str(tmp_path / "mine" / "train"), "--weights",
                         str(weights)), "train split (data.train_split) not found",
                    f"not a split: did you mean --data {tmp_path / 'mine'}?")


def test_missing_weights_file(tmp_path):
    _one_line_error(_run("--preset", "imagenet-resnet50", "--data", str(tmp_path), "--weights",
                         str(tmp_path / "missing.pt")), "weights file not found")


def test_missing_ood_folder(tmp_path, weights):
    for split in ("train", "val"):  # preflight checks every split the run scans
        (tmp_path / split / "n01").mkdir(parents=True)
    _one_line_error(_run("--preset", "imagenet-resnet50", "--data", str(tmp_path), "--weights", str(weights),
                         "--ood", str(tmp_path / "nope")), "OOD folder not found")


def test_dry_run_prints_the_config():
    res = _run("--preset", "smoke", "--set", "evaluate.mc_samples=3", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "mc_samples: 3" in res.stdout and "preset: smoke" in res.stdout


def test_infoform_run_is_the_same_entry_point():
    res = subprocess.run([sys.executable, "-m", "pipelines", "run", "--preset", "nope"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    _one_line_error(res, "infoform run: error", "unknown preset")


def test_unknown_norm_layers_mode():
    _one_line_error(_run("--preset", "smoke", "--set", "posterior.norm_layers=full"), "posterior.norm_layers",
                    "map, diag")


def test_posterior_layers_matching_nothing_is_one_line_naming_valid_layers():
    _one_line_error(_run("--preset", "smoke", "--set", "posterior.layers=[fc2, nope*]", "--dry-run"),
                    "posterior.layers", "'nope*' matches no curvature layer", "valid names:")
    _one_line_error(_run("--preset", "smoke", "--set", "posterior.layers=[]", "--dry-run"), "posterior.layers")


# --------------------------------------------------------------------------- S3 preflight
@pytest.fixture(scope="module")
def s3_layout(moto_s3, weights):
    """A bucket with one training image in each of 4 classes and resnet18 weights with a 4-way head on
    moto's server (127.0.0.1): preflight reads the weights and matches them to the model and the data."""
    import boto3

    bucket = f"pre-{os.getpid()}"
    s3 = boto3.client("s3", endpoint_url=moto_s3, region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    for c in ("n01", "n02", "n03", "n04"):  # as many classes as the weights' head has outputs
        for split in ("train", "val"):  # preflight checks every split the run scans
            s3.put_object(Bucket=bucket, Key=f"data/{split}/{c}/a.jpg", Body=b"\xff\xd8\xff")
    s3.put_object(Bucket=bucket, Key="r18.pt", Body=weights.read_bytes())
    return f"s3://{bucket}", moto_s3


def _s3_args(data: str, weights: str, endpoint: str, output: str) -> list[str]:
    return ["--preset", "imagenet-resnet50", "--model", "resnet18", "--data", data, "--weights", weights,
            "--output", output, "--endpoint-url", endpoint]


def _closed_port_endpoint() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed


def _s3_cases(bucket: str, endpoint: str) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    wrong = _closed_port_endpoint()
    return {
        "wrong endpoint": (_s3_args(f"{bucket}/data", f"{bucket}/r18.pt", wrong, f"{bucket}/out"),
                           ("cannot reach the S3 store", wrong, "--endpoint-url")),
        "missing bucket": (_s3_args("s3://no-such-bucket-9f3a/data", f"{bucket}/r18.pt", endpoint, f"{bucket}/out"),
                           ("bucket 'no-such-bucket-9f3a' does not exist", endpoint)),
        "missing output bucket": (_s3_args(f"{bucket}/data", f"{bucket}/r18.pt", endpoint, "s3://no-out-bucket-1c2d/o"),
                                  ("bucket 'no-out-bucket-1c2d' does not exist", "output")),
        "missing weights object": (_s3_args(f"{bucket}/data", f"{bucket}/missing.pt", endpoint, f"{bucket}/out"),
                                   ("weights file not found", f"{bucket}/missing.pt")),
        "missing OOD prefix": (_s3_args(f"{bucket}/data", f"{bucket}/r18.pt", endpoint, f"{bucket}/out")
                               + ["--ood", f"{bucket}/ood"], ("OOD folder not found", f"{bucket}/ood")),
    }


@pytest.mark.s3
def test_s3_problems_are_one_line_before_ray(s3_layout):
    """Wrong endpoint, missing bucket, missing weights object: exit 2, one line naming the
    URI / endpoint, no Ray started. The endpoint comes
    from the flag alone (no AWS_ENDPOINT_URL* in the environment)."""
    bucket, endpoint = s3_layout
    assert not any(k.startswith("AWS_ENDPOINT_URL") for k in os.environ)
    cases = _s3_cases(bucket, endpoint)
    for name in ("wrong endpoint", "missing bucket", "missing weights object"):  # the rest: in-process below
        _one_line_error(_run(*cases[name][0]), *cases[name][1])


@pytest.mark.s3
def test_s3_preflight_answers_within_seconds(s3_layout):
    """The same checks in-process (no interpreter start-up): each answers in under 10 s; a
    wrong endpoint fails after one short attempt, not after s3fs's and botocore's back-off.
    The good layout passes and leaves no probe object behind."""
    import time

    from pipelines.cli.main import config_from_args, get_args_parser
    from pipelines.cli.preflight import PreflightError, preflight
    from pipelines.storage import uris as storage

    bucket, endpoint = s3_layout
    for name, (args, needles) in _s3_cases(bucket, endpoint).items():
        cfg = config_from_args(get_args_parser().parse_args(args))
        t0 = time.perf_counter()
        with pytest.raises(PreflightError) as err:
            preflight(cfg)
        took = time.perf_counter() - t0
        assert took < 10.0, f"{name}: preflight took {took:.1f} s"
        assert all(n in str(err.value) for n in needles), (name, str(err.value))
    good = config_from_args(get_args_parser().parse_args(_s3_args(f"{bucket}/data", f"{bucket}/r18.pt", endpoint,
                                                                  f"{bucket}/out")))
    assert preflight(good)["endpoint"] == endpoint
    assert storage.listdir(f"{bucket}/out", endpoint) == []


def test_a_second_job_on_a_running_jobs_output_is_refused_before_ray(tmp_path):
    """Issue 41: a fresh lease of another job (its process alive on this host, heartbeat now) on
    ``--output``: one line naming the owner, exit 2, no Ray started, nothing written there."""
    import json
    import socket
    import time

    out = tmp_path / "out"
    out.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        owner = f"{socket.gethostname()}:{sleeper.pid}:first"
        (out / "lease.json").write_text(json.dumps({"owner": owner, "host": socket.gethostname(), "pid": sleeper.pid,
                                                    "heartbeat_at": time.time()}))
        _one_line_error(_run("--preset", "smoke", "--output", str(out)), "held by another job", owner,
                        str(out / "lease.json"))
    finally:
        sleeper.kill()
        sleeper.wait()
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["lease.json"]  # no config.json


# --------------------------------------------------------------------------- the model and the image size
NETS = '''
import torch
from torch import nn


class Net(nn.Module):  # sized for 28x28 images, as a user's digit classifier is
    def __init__(self, num_classes=4):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8 * 14 * 14, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.max_pool2d(torch.relu(self.conv(x)), 2), 1))


def seg(num_classes=4):  # per-pixel scores, not a classifier
    return nn.Conv2d(3, num_classes, 1)
'''


@pytest.fixture(scope="module")
def nets_pkg(tmp_path_factory):
    root = tmp_path_factory.mktemp("pkg")
    (root / "user_nets_28.py").write_text(NETS)
    for split in ("train", "val"):
        for c in ("a", "b", "c", "d"):
            (root / "data" / split / c).mkdir(parents=True)
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    sys.modules.pop("user_nets_28", None)


def test_a_model_sized_for_other_images_is_one_line_naming_data_image_size(nets_pkg):
    """A user's run of a 28 px model at the custom preset's 224 px: one line and exit 2 from preflight
    (it was a Ray Train traceback, retried twice); at the model's size the dry run passes."""
    env = dict(os.environ, RAY_ADDRESS="", PYTHONPATH=str(nets_pkg))
    base = [sys.executable, str(JOB), "--data", str(nets_pkg / "data"), "--model", "user_nets_28:Net",
            "--weights", "random", "--output", str(nets_pkg / "out")]
    res = subprocess.run(base, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    _one_line_error(res, "model user_nets_28:Net does not take 224x224 images (data.image_size=224)",
                    "mat1 and mat2 shapes cannot be multiplied", "--set data.image_size=N")
    res = subprocess.run([*base, "--set", "data.image_size=28", "--set", "data.resize_size=28", "--dry-run"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr


def test_a_model_whose_output_is_not_batch_by_classes_is_refused(nets_pkg):
    from pipelines.cli.preflight import check_forward
    from pipelines.config.load import load_config
    from pipelines.errors import PreflightError

    check_forward(load_config("smoke", ["model.name=user_nets_28:Net", "data.image_size=28"]))
    with pytest.raises(PreflightError, match=r"returns a tensor of shape \(2, 4, 8, 8\) for 2 images of 8x8"):
        check_forward(load_config("smoke", ["model.name=user_nets_28:seg", "data.image_size=8",
                                                   "data.resize_size=8"]))
