"""The Ray Train side shared by every partitioned pass: the job object the workers receive,
the ``TorchTrainer`` factory (lossless data split, gloo or NCCL, ``FailureConfig``), the
worker set-up, the partition bookkeeping on the driver, and the test-only fault injection.

Nothing here sets ``os.environ``: the run's store (:class:`pipelines.storage.store.RunStore`: the
output and the resolved storage options) travels inside :class:`Job` and does every read and write.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from laplace_core.curvature.batch_loop import DTYPES  # re-exported: the config's dtype names -> torch dtypes
from pipelines.distributed.cluster import train_log_level
from pipelines.storage import layout
from pipelines.storage import uris as storage
from pipelines.storage.store import RunStore

__all__ = ["DTYPES", "FaultInjection", "ModelRef", "Job", "model_ref", "make_trainer", "lossless_data_config",
           "gpu_shortfall", "worker_setup", "index_partitions", "partition_dataset", "path_keys", "fingerprint",
           "put_sources", "fetch_share"]


@dataclass(frozen=True)
class FaultInjection:
    """Test-only: worker ``rank`` (``None``: whichever rank gets there first) kills its
    own process (``os._exit(1)``) in pass ``pass_no`` (1: pass 1, 2: EFB, 3: subnet) while
    reading partition ``partition``, after ``after_batches`` valid batches, exactly once: it
    first writes ``once_marker`` (a URI), and a restarted attempt that finds the marker
    runs clean. Rank 0 commits each checkpoint before it reads on; another rank may reach its
    fault while rank 0 still writes one, and the kill then loses it: a test that asserts what
    a restart resumes from names ``rank=0``."""

    pass_no: int
    partition: int
    once_marker: str
    rank: int | None = None
    after_batches: int = 1

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "FaultInjection":
        known = {"pass", "pass_no", "partition", "rank", "once_marker", "after_batches"}
        bad = set(d) - known
        if bad:
            raise ValueError(f"unknown fault_injection keys {sorted(bad)}; valid: {sorted(known)}")
        return cls(
            pass_no=int(d.get("pass_no", d.get("pass", 1))),
            partition=int(d["partition"]),
            rank=None if d.get("rank") is None else int(d["rank"]),
            once_marker=str(d["once_marker"]),
            after_batches=int(d.get("after_batches", 1)),
        )


@dataclass(frozen=True)
class ModelRef:
    name: str
    weights: str | None
    num_classes: int | None


@dataclass(frozen=True)
class Job:
    """Everything a worker needs; pickled into ``train_loop_config``.

    ``cfg``: the runtime settings (a :class:`pipelines.passes.curvature.CurvatureConfig`: workers,
    batch size, Fisher type, seed, dtypes, bucket size, log interval, fault injection).
    ``passes``: pass name -> the partition ids it covers, in order. ``rows``: expected rows
    per partition (``None``: unknown). ``store``: the run's store (output and storage options).
    ``extra``: what a pass kind needs beyond that (picklable). ``sources``: an object ref of
    the small dict of :func:`put_sources` (the data config and one object ref per partition and
    rank); each rank then fetches and builds the dataset of its own share of a partition when
    the pass reaches it (no dataset, split coordinator or decode pipeline exists before)."""

    model: ModelRef
    cfg: Any
    store: RunStore
    passes: dict[str, tuple[int, ...]]
    rows: dict[int, int | None]
    run_id: str
    use_gpu: bool
    fingerprint: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    sources: Any = None

    @property
    def output_uri(self) -> str:
        """The run's output (the store's)."""
        return self.store.output


def put_sources(by_id: dict, pids, data_config, world: int = 1) -> tuple[Any, dict]:
    """``(object ref of the sources of the index partitions among pids, Ray Datasets among them by
    pid)``. Each index partition (``pipelines.ingest.index`` Partition / DatasetIndex) is put in the
    object store as ``world`` objects, one per rank's share (:func:`~pipelines.ingest.index.rank_share`),
    so that a worker fetches only its own files (:func:`fetch_share`); the ref is to a small
    dict ``{"data_config", "world", "shares": {pid: [ref per rank]}, "bytes": [bytes per rank]}``.
    Ready-made Ray Datasets go to the trainer as they are."""
    import ray
    import ray.data

    from pipelines.malloc import release_object_store_pages
    from pipelines.ingest.index import rank_share

    lazy = {pid: by_id[pid] for pid in pids if not isinstance(by_id[pid], ray.data.Dataset)}
    ready = {pid: by_id[pid] for pid in pids if isinstance(by_id[pid], ray.data.Dataset)}
    if not lazy:
        return None, ready
    world = max(1, int(world))
    shares: dict[int, list] = {}
    nbytes = [0] * world
    for pid, part in lazy.items():
        refs = []
        for rank in range(world):
            share = rank_share(part, rank, world)
            nbytes[rank] += share_bytes(share)
            refs.append(ray.put(share))
        shares[pid] = refs
    ref = ray.put({"data_config": data_config, "world": world, "shares": shares, "bytes": nbytes})
    release_object_store_pages()  # the pages the driver wrote the shares on stay the store's only
    return ref, ready


def fetch_share(src: dict, pid: int, rank: int, world: int) -> tuple[Any, int]:
    """``(this rank's share of partition pid or None, bytes fetched)`` from :func:`put_sources`'s
    dict: the rank's own object when the job runs with the planned number of workers; otherwise
    every share of the partition, put back together and split for ``world`` ranks."""
    import ray

    from pipelines.ingest.index import merge_shares, rank_share

    refs = src["shares"][pid]
    if src["world"] == world:
        share = ray.get(refs[rank])
        return share, share_bytes(share)
    shares = ray.get(list(refs))
    return rank_share(merge_shares(shares), rank, world), sum(share_bytes(s) for s in shares)


def share_bytes(share: Any) -> int:
    """The bytes of a share's file list: its paths' buffer (a ``PathList``; a ``PackedPathList``
    counted as the PathList it unpacks to; the UTF-8 of a tuple of paths) plus 8 per label."""
    paths = share.paths
    size = getattr(paths, "unpacked_nbytes", getattr(paths, "nbytes", None))
    if size is None:
        size = sum(len(p.encode()) for p in paths)
    return int(size) + 8 * len(share.labels)


def fingerprint(obj: Any) -> str:
    """16 hex digits of SHA-256 of ``obj`` as sorted JSON."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def path_keys(paths: Sequence[str]) -> torch.Tensor:
    """Stable int64 example keys (first 63 bits of SHA-1 of the relative path) for keyed
    MC label sampling: the same image gets the same label draw on any worker, in any
    partition layout and after any restart."""
    return torch.tensor([int.from_bytes(hashlib.sha1(p.encode()).digest()[:8], "little") & ((1 << 63) - 1)
                         for p in paths], dtype=torch.int64)


def worker_setup(job: Job) -> tuple[int, int, torch.device]:
    """``(rank, world_size, device)`` of this Ray Train worker; also sets the torch thread count
    and the process's malloc settings (:mod:`pipelines.malloc`)."""
    import ray.train

    from pipelines.malloc import tune_malloc

    tune_malloc()
    ctx = ray.train.get_context()
    if job.cfg.torch_threads:
        torch.set_num_threads(int(job.cfg.torch_threads))
    if job.use_gpu:
        import ray.train.torch as rtt

        device = rtt.get_device()
    else:
        device = torch.device("cpu")
    return ctx.get_world_rank(), ctx.get_world_size(), device


def lossless_data_config():
    """A ``ray.train.DataConfig`` whose split delivers every row exactly once.

    Ray Train's default ``streaming_split(..., equal=True)`` may drop rows to make the
    shards equal; sums must see every image, so this uses ``equal=False``.
    """
    import ray.train

    class LosslessSplit(ray.train.DataConfig):
        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            output = [{} for _ in range(world_size)]
            for name, ds in datasets.items():
                if ds.name is None:
                    ds.set_name(name)
                ds = ds.copy(ds)
                ds.context.execution_options = self._resolve_execution_options(name)
                hints = worker_node_ids if self._enable_shard_locality else None
                for i, split in enumerate(ds.streaming_split(world_size, equal=False, locality_hints=hints)):
                    output[i][name] = split
            return output

    return LosslessSplit()


def gpu_shortfall(need: float, have: float) -> str | None:
    """One warning line when the Train workers ask for more GPUs (``need``) than the cluster
    has now (``have``): they then wait for an autoscaler to add GPU nodes, or forever."""
    if need <= have:
        return None
    return (f"[curvature] the Train workers ask for {need:g} GPU(s), the cluster has {have:g} now: they wait "
            "until an autoscaler adds GPU nodes (on a cluster without GPUs, set curvature.use_gpu=false)")


def make_trainer(loop, loop_config: dict, cfg, use_gpu: bool, name: str, output_uri: str, datasets: dict):
    """The ``TorchTrainer`` every pass runs on: ``cfg.num_workers`` workers (GPU + NCCL
    when ``use_gpu``, else gloo), ``FailureConfig(cfg.max_failures)`` for lost workers (a
    deterministic error is not retried: :mod:`pipelines.distributed.failures`), the lossless data
    config; Ray Train's own files go next to a local output, or to a temp dir for S3."""
    import ray
    import ray.train
    from ray.train.torch import TorchConfig

    from pipelines.distributed.failures import Trainer

    # Ray Train 2.60 starts a PreemptionWatcher actor per worker group with max_restarts=-1 and the
    # worker handles as constructor arguments, which makes every run log core_worker.cc's
    # "constructor arguments in the object store and max_restarts > 0" error line. It only watches
    # for cloud preemption notices; a lost node is still retried through FailureConfig and the
    # pass checkpoints. Off unless the user turned it on (the driver's value reaches the controller).
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    resources = {"CPU": cfg.cpus_per_worker}
    if use_gpu:
        resources["GPU"] = cfg.gpus_per_worker
        note = gpu_shortfall(cfg.num_workers * cfg.gpus_per_worker, float(ray.cluster_resources().get("GPU", 0.0)))
        if note:
            print(note, flush=True)
    if storage.is_remote(output_uri):
        storage_path = os.path.join(tempfile.gettempdir(), "infoform_ray_train")
    else:
        storage_path = os.path.abspath(layout.train_storage_uri(output_uri))
    return Trainer(
        loop,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.num_workers, use_gpu=use_gpu,
                                               resources_per_worker=resources),
        run_config=ray.train.RunConfig(name=name, storage_path=storage_path,
                                       failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
                                       logging_config=ray.train.LoggingConfig(log_level=train_log_level())),
        datasets=datasets,
        dataset_config=lossless_data_config(),
    )


def model_ref(model_spec) -> ModelRef:
    """A model name, or anything with ``.name``, ``.weights``, ``.num_classes``."""
    if isinstance(model_spec, str):
        return ModelRef(model_spec, None, None)
    try:
        return ModelRef(str(model_spec.name), model_spec.weights, model_spec.num_classes)
    except AttributeError:
        raise ValueError("model_spec must be a model name or have .name, .weights, .num_classes") from None


def _partition_id(p, i: int) -> int:
    for attr in ("index", "id", "pid"):
        v = getattr(p, attr, None)
        if isinstance(v, int):
            return v
    return i


def _partition_rows(p) -> int | None:
    import ray.data

    if isinstance(p, ray.data.Dataset):
        return None
    for attr in ("num_rows", "size"):
        v = getattr(p, attr, None)
        if isinstance(v, int):
            return v
    files = getattr(p, "files", None)
    if files is not None:
        return len(files)
    try:
        return len(p)
    except TypeError:
        return None


def partition_dataset(p, data_config):
    """A partition as a Ray Dataset (``pipelines.ingest.batches.build_dataset``), or ``p`` if it is one."""
    import ray.data

    if isinstance(p, ray.data.Dataset):
        return p
    from pipelines.ingest.batches import build_dataset

    return build_dataset(p, data_config)


def index_partitions(partitions: Sequence[Any]) -> tuple[list[int], dict[int, Any], dict[int, int | None]]:
    """``(ids, partition by id, rows by id)``; ids must be unique (they name the datasets and
    the checkpoints' finished-partition lists)."""
    ids = [_partition_id(p, i) for i, p in enumerate(partitions)]
    if len(set(ids)) != len(ids):
        raise ValueError(f"partition ids must be unique, got {ids}")
    by_id = dict(zip(ids, partitions))
    return ids, by_id, {pid: _partition_rows(p) for pid, p in by_id.items()}


def free_cpus(need: float, settle_s: float) -> tuple[float, float]:
    """``(free, total)`` CPUs of the cluster once ``need`` are free, or after ``settle_s`` seconds
    of waiting for the resources of work that just ended to come back (polled every 0.5 s)."""
    import ray

    deadline = time.perf_counter() + settle_s
    free = float(ray.available_resources().get("CPU", 0.0))
    while free + 1e-9 < need and time.perf_counter() < deadline:
        time.sleep(0.5)
        free = float(ray.available_resources().get("CPU", 0.0))
    return free, float(ray.cluster_resources().get("CPU", 0.0))


def decode_cpus_that_fit(cfg, data_config, what: str, settle_s: float = 30.0):
    """``data_config`` with its decode tasks' CPU ask lowered to what is free beside the pass's
    workers, when less than a whole ask is (after up to ``settle_s`` seconds for resources of
    finished work to come back): the workers read their shards through those tasks, and a
    decode task that can never be scheduled would hold the pass for ever. Said in one line;
    the sums do not depend on it. ``data_config`` as it is when it fits or has no decode ask."""
    import dataclasses

    ask = float(getattr(data_config, "decode_num_cpus", 0.0) or 0.0)
    workers = cfg.num_workers * float(cfg.cpus_per_worker)
    if ask <= 0:
        return data_config
    free, total = free_cpus(workers + ask, settle_s)
    left = round(free - workers, 4)
    if free + 1e-9 >= workers + ask or left <= 0:
        return data_config
    print(f"[{what}] {free:g} of {total:g} CPUs are free: the decode tasks "
          f"ask for {left:g} CPU instead of {ask:g} so that they fit beside the workers ({workers:g} CPU)", flush=True)
    return dataclasses.replace(data_config, decode_num_cpus=left)


def fit_interruptibly(trainer, need_cpus: float, what: str, settle_s: float = 30.0):
    """``trainer.fit()``, run on a helper thread while the driver's main thread waits in
    one-second steps: Ray Train's own ``fit`` blocks in one ``ray.get`` that no signal handler
    interrupts (a test's timeout, a scheduler's SIGTERM), and this keeps them working. Before
    it starts, the free CPUs are compared with ``need_cpus`` (the workers plus one decode task
    of their data); when they stay short for ``settle_s`` seconds (resources of earlier work not
    yet given back), one line says what is missing: the workers' decode tasks would wait for
    them. Returns what ``fit`` returns and raises what it raises."""
    import threading

    free, total = free_cpus(need_cpus, settle_s)
    if free + 1e-9 < need_cpus:
        print(f"[{what}] only {free:g} of {total:g} CPUs are free, the workers and their decode tasks ask for "
              f"{need_cpus:g}: it runs once other work gives CPUs back", flush=True)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            box["error"] = e

    thread = threading.Thread(target=target, name=f"{what}-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(1.0)
    if "error" in box:
        raise box["error"]
    return box.get("result")


def trainer_cpus(cfg, data_config) -> float:
    """The CPUs a pass needs free to make progress: every worker's plus one decode task of the
    data the ranks read (``data.decode_num_cpus``; none for ready-made datasets)."""
    decode = float(getattr(data_config, "decode_num_cpus", 0.0) or 0.0)
    return cfg.num_workers * float(cfg.cpus_per_worker) + decode
