"""Shared fixtures for pipeline tests: one local Ray per session (the moto S3 fixtures
``moto_s3`` / ``s3_bucket`` and the fake AWS credentials live in ``tests/conftest.py``).

Fixtures (all session-scoped unless said otherwise):

- ``ray_session``: ``ray.init(num_cpus=2, include_dashboard=False, _temp_dir=<short /tmp dir>,
  object_store_memory=1 GiB, log_to_driver=False)``, reused by every test that asks for it (if Ray is already
  initialised in this process, that instance is reused and left running). Yields the
  ``ray`` module. Ray Data progress bars are off. Ray Train here needs
  ``ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 0.5})`` so
  Ray Data keeps a CPU to read with.
- ``moto_s3``: a moto ``ThreadedMotoServer`` on 127.0.0.1 (free port); yields its endpoint
  URL ``http://127.0.0.1:PORT``. Pass it as ``StorageOptions(endpoint)`` (to ``RunStore.open``,
  ``DataConfig(storage_options=...)``), or to s3fs as ``client_kwargs={"endpoint_url": ...}``.
- ``s3_bucket`` (function-scoped): creates a fresh, uniquely named bucket on ``moto_s3``
  and yields ``(uri "s3://name", endpoint)``.
- ``tiny_cnn_posteriors``: a factory ``(n_examples, methods, ...) -> dict``: ``tiny_cnn(3)``
  (seed 0) on random 8x8 images, its weights file and posteriors saved from an MC Fisher;
  cached per arguments (see :func:`_tiny_cnn_posteriors`).
- ``demo_cnn_posteriors``: a factory ``(size, methods, ...) -> dict``: the demo data
  (scikit-learn digits as an ImageFolder), ``demo_cnn`` trained on it and posteriors saved
  from an MC Fisher; cached per arguments (see :func:`_demo_cnn_posteriors`).

Environment set when this file is imported (before any Ray or AWS client exists, so Ray
workers inherit it): RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (bind 127.0.0.1),
RAY_AUTH_MODE=disabled, RAY_USAGE_STATS_ENABLED=0, RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.2
(default only), and fake AWS credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY =
"testing", AWS_DEFAULT_REGION=us-east-1, AWS_EC2_METADATA_DISABLED=true; AWS_PROFILE
removed) so no test can reach a real account. The repository root, this directory and its
sub-folders (one per ``pipelines/`` package, as ``tests/pipelines/<package>/test_*.py``) are
put on ``PYTHONPATH`` (so Ray workers can import ``pipelines`` and functions defined in test
modules, e.g. a Ray Train loop: pytest imports a test module by its file name, from its folder);
the root and this directory also on ``sys.path`` (``import imagegen``).
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile

import background  # tests/background.py: whole jobs beside the suite
import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
#: the test folders, this one first; a test module's functions are imported by Ray workers by its file name
_TEST_DIRS = [_HERE] + sorted(e.path for e in os.scandir(_HERE) if e.is_dir() and e.name.isidentifier()
                              and not e.name.startswith("_"))
_pp = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
os.environ["PYTHONPATH"] = os.pathsep.join([_REPO, *_TEST_DIRS] + [p for p in _pp if p not in (_REPO, *_TEST_DIRS)])
for _p in (_HERE, _REPO):
    if _p not in sys.path:
        sys.path.insert(0, _p)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if ray.is_initialized():
        yield ray
        return
    tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=tmp,
        object_store_memory=1 << 30,
        logging_level=logging.WARNING,
        # the cluster's own log lines (e.g. '(pid=gcs_server) ... Failed to kill actor') are not
        # streamed into this process: they would land in whichever test's captured stderr is open
        # (CI: a dry run's one-line error read 4 lines); a test reads its job's output, not Ray's
        log_to_driver=False,
    )
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


@background.job("smoke_shift_run")
def _smoke_shift_job(base):
    """The job behind ``smoke_shift_run``, in a child process beside the suite (``tests/background.py``)."""
    from pathlib import Path

    base = Path(base)
    out = base / "smoke_shift" / "out"
    sets = [
        "posterior.methods=[temperature, diag, inf]",
        "evaluate.shift={corruptions: [gaussian_noise, contrast], severities: [1, 5]}",
        "evaluate.mc_samples=4", "search.scheduler=asha", "search.chunk_size=25", "evaluate.batch_size=25",
        "curvature.num_workers=1", "evaluate.num_actors=1",  # two of each: tests/jobs/test_job.py's runs
        *_second_ood_set(base / "smoke_noise" / "noise"),
    ]
    yield
    return background.smoke_job(out, sets)


@pytest.fixture(scope="session")
def smoke_shift_run(ray_session, tmp_path_factory):
    """One smoke job (temperature, diag and INF; a shift sweep of two corruptions at severities 1
    and 5; ASHA; one Train worker, one evaluation actor) that the scoring tests and the shift tests
    both read: run once per session, beside
    the suite. Its output is read only: a test writes under its own folders. (``ray_session`` is
    started for the tests that read it in this process.)"""
    return background.result(_smoke_shift_job, tmp_path_factory)


def _second_ood_set(folder) -> list[str]:
    """Issue 39: a second OOD set beside the demo's letters (60 of them): 40 uniform-noise JPEGs
    (32x32, seeded) named ``noise`` in the group ``far``; 100 OOD images in all, as before."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(39)
    for i in range(40):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"noise{i:02d}.jpg")
    return ["data.ood_limit=60", f"data.ood=[{{name: noise, uri: {folder}, group: far, limit: 40}}]"]


def _saved_posteriors(root, stats, methods, basis=None, inf_rank=None) -> tuple[dict, dict]:
    """``(posteriors, uris)``: each method built from ``stats`` and saved under ``root/posterior/<method>``."""
    import laplace_core as lc

    posts, uris = {}, {}
    for m in methods:
        posts[m] = lc.build_posterior(stats, m, rank=inf_rank if m == "inf" else None, basis=basis)
        uris[m] = str(root / "posterior" / m)
        posts[m].save(uris[m])
    return posts, uris


def _mc_statistics(model, batches, seed: int, efb_seed: int | None):
    """``(stats, basis)``: MC-Fisher statistics (generator seeded ``seed``); with an ``efb_seed``,
    the eigenbasis and the statistics of a second pass (seeded ``efb_seed``) with the EFB sums
    in it, else ``basis`` is None."""
    import laplace_core as lc

    stats = lc.collect_statistics(model, batches, fisher="mc", generator=torch.Generator().manual_seed(seed))
    if efb_seed is None:
        return stats, None
    basis = lc.eigenbasis(stats)
    return lc.collect_statistics(model, batches, fisher="mc", generator=torch.Generator().manual_seed(efb_seed),
                                 basis=basis), basis


def _tiny_cnn_posteriors(root, n_examples: int, methods, dead_channel: bool, with_basis: bool, inf_rank: int):
    from safetensors.torch import save_file

    from pipelines.ingest.models import tiny_cnn

    torch.manual_seed(0)
    model = tiny_cnn(3).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_examples, 3, 8, 8, generator=g)
    if dead_channel:
        x[:, 2] = 0.0  # a dead input channel: exact zeros in the Fisher of conv 0
    with torch.no_grad():
        y = model(x).argmax(1)
    flip = torch.rand(n_examples, generator=g) < 0.3
    y[flip] = torch.randint(0, 3, (int(flip.sum()),), generator=g)
    weights = str(root / "tiny.safetensors")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, weights)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, n_examples, 16)]
    stats, basis = _mc_statistics(model, batches, 1, 1 if with_basis else None)
    posts, uris = _saved_posteriors(root, stats, methods, basis, inf_rank)
    rows = [{"image": x[i].numpy(), "label": int(y[i]), "path": f"{i}.png", "valid": True} for i in range(n_examples)]
    return {"model": {"name": "tiny_cnn", "weights": weights, "num_classes": 3}, "uris": uris, "rows": rows,
            "root": root, "net": model, "posts": posts, "batches": batches}


@pytest.fixture(scope="session")
def tiny_cnn_posteriors(tmp_path_factory):
    """Factory ``(n_examples, methods, *, dead_channel=False, with_basis=False, inf_rank=8)``:
    ``tiny_cnn(3)`` (``torch.manual_seed(0)``) on ``n_examples`` random 3x8x8 images, labels its
    argmax with 30% flipped; the weights as safetensors; posteriors of ``methods`` from an MC
    Fisher (batches of 16, generator seed 1; with the basis: EFB sums in it, INF of rank
    ``inf_rank``). ``dead_channel`` zeroes input channel 2 (exact zeros in the Fisher of conv 0).
    Returns ``model`` (the job's model spec), ``uris``, ``rows`` (image/label/path/valid),
    ``root``, ``net``, ``posts``, ``batches``."""
    made = {}

    def make(n_examples: int, methods, *, dead_channel: bool = False, with_basis: bool = False, inf_rank: int = 8):
        key = (n_examples, tuple(methods), dead_channel, with_basis, inf_rank)
        if key not in made:
            made[key] = _tiny_cnn_posteriors(tmp_path_factory.mktemp("tiny_cnn"), *key)
        return made[key]

    return make


def _demo_cnn_posteriors(root, size: int, methods, letters: bool, with_basis: bool, inf_rank: int):
    from pipelines.ingest import demo_data as dd

    dd.write_digits_imagefolder(root / "digits", size=size)
    if letters:
        dd.write_letters_ood(root / "letters", size=size, n_per_letter=20)
    model, info = dd.train_small_cnn(root / "digits", epochs=5, seed=0, cache_path=root / "cnn")
    x, y, _ = dd.load_imagefolder(root / "digits", "train")
    batches = [(x[i:i + 128], y[i:i + 128]) for i in range(0, len(x), 128)]
    stats, basis = _mc_statistics(model, batches, 0, 1 if with_basis else None)
    posts, uris = _saved_posteriors(root, stats, methods, basis, inf_rank)
    xv, yv, _ = dd.load_imagefolder(root / "digits", "val")
    return {"root": root, "net": model, "info": info, "posts": posts, "uris": uris, "val": (xv, yv),
            "count": stats.count,
            "model": {"name": "demo_cnn", "weights": str(root / "cnn" / "small_cnn.safetensors"), "num_classes": 10}}


@pytest.fixture(scope="session")
def demo_cnn_posteriors(tmp_path_factory):
    """Factory ``(size, methods, *, letters=False, with_basis=False, inf_rank=100)``: the demo
    data (scikit-learn digits as a ``size`` x ``size`` ImageFolder under ``root/digits``; with
    ``letters`` the rendered letters under ``root/letters``, 20 per letter), ``demo_cnn`` trained
    on its train split (5 epochs, seed 0) and posteriors of ``methods`` from an MC Fisher on that
    split (batches of 128, generator seed 0; with the basis: the EFB sums of a second pass, seed
    1, INF of rank ``inf_rank``). Returns ``root``, ``net``, ``info`` (the training summary),
    ``posts``, ``uris``, ``val`` (the val split in memory), ``count`` and ``model`` (the job's
    model spec)."""
    made = {}

    def make(size: int, methods, *, letters: bool = False, with_basis: bool = False, inf_rank: int = 100):
        key = (size, tuple(methods), letters, with_basis, inf_rank)
        if key not in made:
            made[key] = _demo_cnn_posteriors(tmp_path_factory.mktemp("demo_cnn"), *key)
        return made[key]

    return make
