"""Deterministic errors are not retried (issue 32): a ``ValueError`` raised in a Ray Train
worker ends the pass at its first occurrence, with one line naming the cause, although
``max_failures`` allows retries; lost workers are still retried (the kill-a-worker tests in
test_curvature.py and test_subnet_pass.py, unchanged)."""
from __future__ import annotations

import os

import pytest

import imagegen
import retry_factories
from pipelines.storage.store import RunStore
from pipelines.errors import StageError
from pipelines.ingest.index import DataConfig, partition
from pipelines.ingest.scan import scan
from pipelines.passes.curvature import CurvatureConfig, run_curvature
from pipelines.distributed.failures import DeterministicFirst, is_deterministic

pytestmark = pytest.mark.ray


def test_value_error_in_a_train_worker_ends_the_pass_at_once(tmp_path, ray_session):
    from pipelines.config.schema import ModelSpec

    tree = imagegen.make_imagenet_tree(tmp_path / "images", per_class=2, size=(12, 12))
    dcfg = DataConfig(root=str(tmp_path / "images"), split="train", image_size=12, resize_size=12,
                      decode_batch_size=2, decode_num_cpus=0.25, classes=imagegen.ALL_CLASSES)
    parts = partition(scan(dcfg), num_partitions=2)
    cfg = CurvatureConfig(num_workers=2, cpus_per_worker=0.5, use_gpu=False, batch_size=2, methods=("diag",),
                          max_failures=2, torch_threads=1)
    if os.path.exists(retry_factories.CALLS):
        os.remove(retry_factories.CALLS)
    spec = ModelSpec(name="retry_factories:raises_value_error", weights=None, num_classes=len(tree.classes))
    with pytest.raises(StageError) as err:
        run_curvature(spec, parts, cfg, RunStore.open(str(tmp_path / "out")), data_config=dcfg)
    msg = str(err.value)
    assert "\n" not in msg and "ValueError" in msg and "'head9'" in msg and "not retried" in msg, msg
    # one attempt: each of the 2 workers built the model once (3 attempts with retries: 6 calls)
    assert retry_factories.calls() <= cfg.num_workers, retry_factories.calls()


def test_the_policy_tells_errors_of_the_input_from_lost_workers():
    from ray.exceptions import RayActorError
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    assert is_deterministic(KeyError("x")) and is_deterministic(ValueError("x"))
    assert not is_deterministic(RuntimeError("gloo: connection closed")) and not is_deterministic(OSError("net"))
    import torch  # torch's own shape errors are RuntimeErrors that a retry raises again
    for bad in (lambda: torch.nn.Linear(1568, 4)(torch.zeros(2, 100352)),
                lambda: torch.nn.Conv2d(3, 8, 3)(torch.zeros(2, 1, 8, 8))):
        with pytest.raises(RuntimeError) as got:
            bad()
        assert is_deterministic(got.value), got.value
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    def user(e):  # how Ray Train hands over an exception raised by the worker's code
        return UserExceptionWithTraceback(e, traceback_str=f"Traceback ...\n{type(e).__name__}: {e}")

    policy = DeterministicFirst(FailureConfig(max_failures=2))
    lost = WorkerGroupError("worker died", {0: RayActorError()})
    assert policy.make_decision(lost) == FailureDecision.RETRY  # retried, as before
    bad = WorkerGroupError("bad input", {0: user(RuntimeError("collective aborted")), 1: user(ValueError("bad key"))})
    assert policy.make_decision(bad) == FailureDecision.RAISE
    # a worker lost and a ValueError on another (collateral): retried
    both = WorkerGroupError("lost", {0: RayActorError(), 1: user(ValueError("stream ended"))})
    assert DeterministicFirst(FailureConfig(max_failures=2)).make_decision(both) == FailureDecision.RETRY
    flaky = WorkerGroupError("flaky", {0: user(OSError("connection reset"))})
    assert DeterministicFirst(FailureConfig(max_failures=2)).make_decision(flaky) == FailureDecision.RETRY


def test_value_error_in_a_search_trial_ends_the_search_at_once(tmp_path, ray_session):
    """A trial actor whose model raises ValueError (max_failures=2): the experiment stops at the
    first trial, one StageError line with the cause, the factory called once (a retried trial
    would call it 3 times), and no experiment state is left to resume into the same error."""
    import torch

    from pipelines.evaluation.runtime import SearchConfig
    from pipelines.evaluation.tune import chunk_refs, run_experiment
    from pipelines.storage import uris as storage

    rows = [{"image": torch.zeros(3, 8, 8).numpy(), "label": i % 3, "path": f"{i}.png", "valid": True}
            for i in range(32)]
    cfg = SearchConfig(num_actors=1, batch_size=8, chunk_size=16, mc_samples=2, cpus_per_actor=0.5, torch_threads=1,
                       num_configs=3, log10_n=(0.0, 4.0), log10_tau=(-2.0, 3.0), max_failures=2)
    chunks, images, _ = chunk_refs(ray_session.data.from_items(rows, override_num_blocks=2), cfg)
    if os.path.exists(retry_factories.CALLS):
        os.remove(retry_factories.CALLS)
    model = {"name": "retry_factories:raises_value_error", "weights": None, "num_classes": 3}
    root = str(tmp_path / "tune")
    with pytest.raises(StageError) as err:
        run_experiment(model, {"diag": str(tmp_path / "posterior")}, chunks, images, cfg, storage_root=root)
    msg = str(err.value)
    assert "\n" not in msg and "ValueError" in msg and "'head9'" in msg and "not retried" in msg, msg
    assert retry_factories.calls() == 1
    assert storage.listdir(root) == []
