"""The distributed curvature pass (Ray Train ``TorchTrainer``), DESIGN §2 and §4.

Data flow: **partitions -> per-worker sums -> all-reduce -> partition file (written
in the background while the next partition is computed) -> running sum of the
partitions (files read back only for partitions an earlier attempt finished) -> eigenbasis (spread over workers) -> EFB sums (second
pass, same scheme) -> reduced statistics -> posteriors.**

Every worker runs the same :func:`laplace_core.collect.collect_statistics` that a
unit test runs in one process; statistics are sums, so the all-reduced sums of
``W`` workers over a partition equal the single-process sums over the same
images, up to round-off. For ``fisher="mc"`` each label is drawn from
``(seed, key of the image path, draw)`` (:class:`laplace_core.keyed_rng.KeyedSampler`,
:func:`path_keys`), so it does not matter which worker sees which image, nor whether
a worker was restarted.

Artifact layout under ``output_uri`` (local path or ``s3://bucket/prefix``); each
``<dir>/`` is a :mod:`laplace_core.io` artifact (``tensors.safetensors`` +
``manifest.json``, manifest written last):

``stats/partitions/pass1/part-00003/``
    reduced pass-1 sums of partition 3 (a ``CurvatureStatistics`` + partition meta:
    rows read, invalid rows, run id, write time). A partition is *finished* when its
    ``manifest.json`` exists; a re-run skips it, so nothing is counted twice.
``stats/partitions/pass2/part-00003/``
    reduced EFB sums (``<layer>/efb``, ``m x n``) of partition 3 in the run's eigenbasis.
``stats/eigenbasis/``
    ``<layer>/{U_A,S_A,U_G,S_G}`` of ``A/M`` and ``G/M`` (pass-1 sums of all partitions).
``stats/reduced/``
    the final ``CurvatureStatistics`` (pass-1 sums of all partitions, in partition
    order, with the EFB sums of the EFB subset attached).
``stats/worker_report.json``
    rank 0's timings of the last (successful) attempt, with every rank's under ``ranks``.
``stats/curvature.json``
    run summary: timings per pass, all-reduce seconds and bytes, skipped images,
    which partitions this run computed, posterior summaries.
``posterior/<method>/``
    one :class:`laplace_core.structures.base.Posterior` per requested method.

Fault tolerance: ``FailureConfig(max_failures)`` restarts the worker group after
a worker dies; the restarted loop skips finished partitions (and reuses a saved
eigenbasis), so a run resumes at partition granularity, also across jobs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch

from laplace_core.eigenbasis import Eigenbasis, LayerBasis, layer_eigenbasis
from laplace_core.io import load_tensors, save_tensors
from laplace_core.layers import check_norm_layers, find_layers
from laplace_core.statistics import CurvatureStatistics, flat_sums, layers_from_sums, zero_layer

from . import storage
from .eigen import assign_layers
from .posterior import BASIS_METHODS, EFB_METHODS, build_and_save

__all__ = [
    "FaultInjection",
    "CurvatureConfig",
    "CurvatureResult",
    "run_curvature",
    "partition_uri",
    "basis_uri",
    "reduced_uri",
    "efb_partition_ids",
    "finished_partitions",
    "load_eigenbasis",
    "save_eigenbasis",
]

FISHER_TYPES = ("mc", "empirical")
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64}
METHOD_NAMES = ("diag", "kfac", "kfac_exact", "efb", "inf")


# =========================================================================== config
@dataclass(frozen=True)
class FaultInjection:
    """Test-only: worker ``rank`` (``None``: whichever rank gets there first) kills its
    own process (``os._exit(1)``) in pass ``pass_no`` while reading partition
    ``partition``, after ``after_batches`` valid batches, exactly once: it first
    writes ``once_marker`` (a URI), and a restarted attempt that finds the marker
    runs clean."""

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
class CurvatureConfig:
    """Settings of the distributed curvature pass.

    ``use_gpu=None``: use GPUs when the cluster has any (checked from the driver).
    ``cpus_per_worker``: 0.5 on a 2-core machine, so that Ray Data keeps a CPU to
    read shards (1 CPU per worker hangs there, see ENVIRONMENT.md).
    ``efb_fraction`` / ``efb_max_examples``: the second (EFB) pass runs on an evenly
    spaced, deterministic subset of the partitions (:func:`efb_partition_ids`).
    ``model_dtype``: the dtype the model computes in (``float64`` for exact tests);
    ``stats_dtype``: the dtype of the accumulated sums.
    ``bucket_mb``: size of the flattened all-reduce buffers.
    """

    num_workers: int = 2
    use_gpu: bool | None = None
    cpus_per_worker: float = 0.5
    gpus_per_worker: float = 1.0
    fisher: str = "mc"
    mc_samples: int = 1
    seed: int = 0
    batch_size: int = 32
    methods: tuple[str, ...] = ("diag", "kfac", "efb", "inf")
    rank: int | None = 100
    n_data: float | None = None
    prior_precision: float = 1.0
    efb_fraction: float = 1.0
    efb_max_examples: int | None = None
    max_failures: int = 2
    torch_threads: int | None = 1
    model_dtype: str = "float32"
    stats_dtype: str = "float64"
    bucket_mb: float = 64.0
    log_every_s: float = 10.0
    fault_injection: FaultInjection | None = None
    norm_layers: str = "map"  # laplace_core.layers.NORM_LAYER_MODES: "diag" adds normalisation layers (diagonal)

    def __post_init__(self):
        if isinstance(self.fault_injection, Mapping):
            object.__setattr__(self, "fault_injection", FaultInjection.from_mapping(self.fault_injection))
        object.__setattr__(self, "methods", tuple(self.methods))
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.fisher not in FISHER_TYPES:
            raise ValueError(f"unknown fisher {self.fisher!r}; valid: {', '.join(FISHER_TYPES)}")
        if self.mc_samples < 1:
            raise ValueError(f"mc_samples must be >= 1, got {self.mc_samples}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        check_norm_layers(self.norm_layers)
        for m in self.methods:
            if m not in METHOD_NAMES:
                raise ValueError(f"unknown posterior method {m!r}; valid: {', '.join(METHOD_NAMES)}")
        for name in ("model_dtype", "stats_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; valid: {', '.join(DTYPES)}")
        if not (0.0 < self.efb_fraction <= 1.0):
            raise ValueError(f"efb_fraction must be in (0, 1], got {self.efb_fraction}")
        if self.efb_max_examples is not None and self.efb_max_examples < 1:
            raise ValueError(f"efb_max_examples must be >= 1, got {self.efb_max_examples}")
        if self.cpus_per_worker <= 0:
            raise ValueError(f"cpus_per_worker must be > 0, got {self.cpus_per_worker}")
        if self.max_failures < -1:
            raise ValueError(f"max_failures must be >= -1 (-1 = unlimited), got {self.max_failures}")

    @property
    def needs_basis(self) -> bool:
        return any(m in BASIS_METHODS for m in self.methods)

    @property
    def needs_efb(self) -> bool:
        return any(m in EFB_METHODS for m in self.methods)


@dataclass(frozen=True)
class CurvatureResult:
    """What a run produced (everything is also in the artifacts under ``output_uri``).

    ``stats``: reduced statistics (pass-1 sums of all partitions + EFB sums);
    ``basis``: the eigenbasis (None when no method needs it); ``posteriors``:
    method -> summary from :func:`pipelines.posterior.build_and_save`; ``timings``:
    per pass and stage seconds; ``allreduce_seconds`` / ``allreduce_bytes``: time
    in and payload of the statistics all-reduces of this run (per worker);
    ``skipped``: rows read / invalid rows per pass (+ a sample of invalid paths);
    ``computed_partitions`` / ``reused_partitions``: ``{"pass1": (...), "pass2": (...)}``.
    """

    output_uri: str
    stats: CurvatureStatistics
    basis: Eigenbasis | None
    posteriors: dict[str, dict[str, Any]]
    timings: dict[str, Any]
    allreduce_seconds: float
    allreduce_bytes: int
    skipped: dict[str, Any]
    computed_partitions: dict[str, tuple[int, ...]]
    reused_partitions: dict[str, tuple[int, ...]]
    efb_partitions: tuple[int, ...]
    num_workers: int
    use_gpu: bool
    run_id: str


# =========================================================================== layout
def partition_uri(output_uri: str, pass_no: int, pid: int) -> str:
    """``<output>/stats/partitions/pass<k>/part-<pid:05d>``."""
    return storage.join(output_uri, "stats", "partitions", f"pass{pass_no}", f"part-{pid:05d}")


def _manifest(uri: str) -> str:
    return storage.join(uri, "manifest.json")


def _basis_uri(output_uri: str) -> str:
    return storage.join(output_uri, "stats", "eigenbasis")


def _reduced_uri(output_uri: str) -> str:
    return storage.join(output_uri, "stats", "reduced")


#: Public names of the artifact locations: ``<output>/stats/eigenbasis`` and ``<output>/stats/reduced``.
basis_uri = _basis_uri
reduced_uri = _reduced_uri


def finished_partitions(output_uri: str, pass_no: int, ids: Sequence[int], endpoint_url: str | None = None) -> list[int]:
    """Partitions of ``ids`` whose artifact manifest exists (the commit point)."""
    return [pid for pid in ids if storage.exists(_manifest(partition_uri(output_uri, pass_no, pid)), endpoint_url)]


def efb_partition_ids(
    ids: Sequence[int], rows: Mapping[int, int | None], fraction: float = 1.0, max_examples: int | None = None
) -> tuple[int, ...]:
    """Deterministic, evenly spaced subset of the partitions for the EFB pass.

    ``k = ceil(fraction * P)`` partitions at positions ``floor(i P / k)``; with
    ``max_examples`` the smallest such ``k`` whose rows reach ``max_examples``
    (needs known partition sizes). Only depends on the arguments.
    """
    ids = list(ids)
    P = len(ids)
    if P == 0:
        return ()

    def pick(k: int) -> list[int]:
        return [ids[(i * P) // k] for i in range(k)]

    k = max(1, min(P, math.ceil(fraction * P - 1e-9)))
    if max_examples is not None:
        if any(rows.get(p) is None for p in ids):
            raise ValueError("efb_max_examples needs partitions with known sizes")
        for kk in range(1, k + 1):
            if sum(int(rows[p]) for p in pick(kk)) >= max_examples:
                k = kk
                break
    return tuple(pick(k))


# =========================================================================== eigenbasis I/O
def save_eigenbasis(uri: str, basis: Eigenbasis, count: int) -> None:
    """``<uri>/`` artifact with ``<layer>/{U_A,S_A,U_G,S_G}`` and the clamp counts."""
    meta = {
        "format": "infoform.eigenbasis",
        "version": 1,
        "names": list(basis.layers),
        "clamped": {k: int(v) for k, v in basis.clamped.items()},
        "count": int(count),
    }
    save_tensors(uri, basis.flat_tensors(), meta)


def load_eigenbasis(uri: str) -> Eigenbasis:
    tensors, meta = load_tensors(uri)
    if meta.get("format") != "infoform.eigenbasis":
        raise ValueError(f"{uri}: not an eigenbasis artifact (format {meta.get('format')!r})")
    return Eigenbasis.from_flat(tensors, list(meta["names"]), meta.get("clamped", {}))


# =========================================================================== worker side
@dataclass(frozen=True)
class _ModelRef:
    name: str
    weights: str | None
    num_classes: int | None


@dataclass(frozen=True)
class _Job:
    """Everything a worker needs; pickled into ``train_loop_config``."""

    model: _ModelRef
    cfg: CurvatureConfig
    output_uri: str
    endpoint_url: str | None
    pass1: tuple[int, ...]
    pass2: tuple[int, ...]
    rows: dict[int, int | None]
    run_id: str
    use_gpu: bool


class _Counter:
    """Rows read, valid rows and the skip report (undecodable images) of one worker
    in one partition."""

    def __init__(self):
        from .data import SkipReport

        self.rows = 0
        self.valid = 0
        self.batches = 0
        self.wait_s = 0.0  # time spent waiting for the data pipeline
        self.first_wait_s: float | None = None  # of which: until the first batch (pipeline start-up)
        self.skipped = SkipReport()


def path_keys(paths: Sequence[str]) -> torch.Tensor:
    """Stable int64 example keys (first 63 bits of SHA-1 of the relative path) for keyed
    MC label sampling: the same image gets the same label draw on any worker, in any
    partition layout and after any restart."""
    return torch.tensor([int.from_bytes(hashlib.sha1(p.encode()).digest()[:8], "little") & ((1 << 63) - 1)
                         for p in paths], dtype=torch.int64)


def _iter_valid_batches(shard, job: _Job, pass_no: int, pid: int, rank: int,
                        device, dtype, counter: _Counter, progress) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(x, y, keys)`` batches of the shard's valid rows on ``device`` in the model dtype
    (:func:`pipelines.data.iter_valid_batches`); counts rows and skipped images.

    Also the test-only fault injection point.
    """
    from .data import iter_valid_batches

    fi = job.cfg.fault_injection
    it = iter_valid_batches(shard, batch_size=job.cfg.batch_size, device=device)
    while True:
        t0 = time.perf_counter()
        b = next(it, None)
        dt = time.perf_counter() - t0
        counter.wait_s += dt
        if counter.first_wait_s is None:
            counter.first_wait_s = dt
        if b is None:
            return
        n = int(b.y.shape[0]) + b.skipped.count
        counter.rows += n
        if b.skipped.count:
            counter.skipped = counter.skipped.merge(b.skipped)
        if b.y.shape[0] == 0:
            progress(n)
            continue
        counter.valid += int(b.y.shape[0])
        counter.batches += 1
        yield b.x.to(dtype=dtype), b.y, path_keys(b.paths).to(b.y.device)
        progress(n)
        if (fi is not None and fi.pass_no == pass_no and fi.partition == pid and fi.rank in (None, rank)
                and counter.batches >= fi.after_batches):
            ep = job.endpoint_url
            if not storage.exists(fi.once_marker, ep):
                storage.write_json_atomic(fi.once_marker, {"pass": pass_no, "partition": pid, "rank": rank,
                                                           "time": time.time()}, ep)
                print(f"[curvature] fault injection: rank {rank} exits in pass {pass_no} partition {pid}", flush=True)
                os._exit(1)


class _FirstBatch:
    """A partition's batch generator whose first batch is fetched in a background
    thread: Ray Data's start-up for a partition's dataset (about 2 s on 2 CPUs) then
    overlaps the compute of the previous partition instead of adding to it.
    ``get()`` returns ``(first_batch_or_None, generator)``; an error in the fetch
    (fault injection, unreadable shard) is re-raised there."""

    def __init__(self, batches: Iterator):
        import threading

        self._batches = batches
        self._first = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="first-batch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._first = next(self._batches, None)
        except BaseException as e:  # re-raised by get()
            self._error = e

    def get(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._first, self._batches


class _Progress:
    """Rank-0 log line every ``every_s`` seconds: images/s and ETA of the pass."""

    def __init__(self, pass_no: int, total: int | None, world: int, rank: int, every_s: float):
        self.pass_no, self.total, self.world, self.rank, self.every_s = pass_no, total, world, rank, every_s
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.done_local = 0
        self.done_global = 0  # exact, updated after each partition

    def __call__(self, n: int) -> None:
        self.done_local += n
        now = time.perf_counter()
        if self.rank == 0 and now - self.last >= self.every_s:
            self.last = now
            est = self.done_global + self.done_local * self.world
            rate = est / max(now - self.t0, 1e-9)
            eta = "?" if not self.total else f"{max(self.total - est, 0) / max(rate, 1e-9):.0f}s"
            print(f"[curvature] pass {self.pass_no}: ~{est}/{self.total or '?'} images, "
                  f"{rate:.1f} img/s, ETA {eta}", flush=True)

    def restart(self, now: float) -> None:
        """Start the rate's clock at ``now`` (the pass's own start, after whatever ran before)."""
        self.t0 = self.last = now

    def partition_done(self, rows_global: int) -> None:
        self.done_global += rows_global
        self.done_local = 0


def _zero_stats(infos, excluded, cfg: CurvatureConfig, device, dtype) -> CurvatureStatistics:
    layers = {k: zero_layer(info, dtype, device) for k, info in infos.items()}
    return CurvatureStatistics(layers=layers, infos=dict(infos), count=0, fisher=cfg.fisher,
                               mc_samples=cfg.mc_samples, excluded=dict(excluded))


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Consecutive groups of tensor indices whose total size stays under ``bucket_bytes``
    (a single larger tensor gets a bucket of its own)."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, t in enumerate(tensors):
        nb = t.numel() * t.element_size()
        if cur and size + nb > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nb
    if cur:
        out.append(cur)
    return out


def _allreduce_sum(tensors: list[torch.Tensor], bucket_bytes: int, rec: dict) -> list[torch.Tensor]:
    """SUM-all-reduce of ``tensors`` (same dtype/device) in flattened buckets.

    Returns new tensors with the summed values; adds seconds/bytes/calls to ``rec``.
    """
    import torch.distributed as dist

    out: list[torch.Tensor | None] = [None] * len(tensors)
    for group in _buckets(tensors, bucket_bytes):
        flat = torch.cat([tensors[i].reshape(-1) for i in group])
        t0 = time.perf_counter()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)
        rec["allreduce_s"] += time.perf_counter() - t0
        rec["allreduce_bytes"] += flat.numel() * flat.element_size()
        rec["allreduce_calls"] += 1
        off = 0
        for i in group:
            k = tensors[i].numel()
            out[i] = flat[off: off + k].view_as(tensors[i])
            off += k
    return out  # type: ignore[return-value]


def _broadcast_object(obj, rank: int):
    import torch.distributed as dist

    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class _PartitionWriter:
    """Rank 0's partition writes, one at a time in a background thread, so that writing
    partition ``k`` overlaps computing partition ``k + 1``. ``submit`` waits for the
    previous write first (at most one reduced copy in flight); ``wait`` re-raises a
    failed write. The commit point is still the manifest, written last: a write cut
    short by a crash leaves an unfinished partition that a re-run recomputes."""

    def __init__(self):
        self._thread = None
        self._error: BaseException | None = None
        self.seconds = 0.0

    def submit(self, fn) -> None:
        import threading

        self.wait()

        def run():
            t0 = time.perf_counter()
            try:
                fn()
            except BaseException as e:  # re-raised in the training loop by wait()
                self._error = e
            finally:
                self.seconds += time.perf_counter() - t0

        self._thread = threading.Thread(target=run, name="partition-writer", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err


class _PassSum:
    """Running sum of one pass's reduced partition sums, in partition order.

    Partitions computed now arrive from the all-reduce (every rank holds them);
    partitions finished by an earlier attempt are read from their files. Adding in
    partition-id order reproduces the left fold of
    :meth:`~laplace_core.statistics.CurvatureStatistics.merge_all` over the partition
    files bit for bit, without reading back what this run just computed.
    """

    def __init__(self):
        self.tensors: list[torch.Tensor] | None = None
        self.nums = [0, 0, 0, 0]  # count, efb_count, skipped_batches, skipped_examples
        self.rows = 0
        self.skipped = None

    def add(self, tensors: Sequence[torch.Tensor], nums: Sequence[int], rows: int, skipped) -> None:
        if self.tensors is None:
            self.tensors = [t.detach().cpu().clone() for t in tensors]
        else:
            for acc, t in zip(self.tensors, tensors):
                acc.add_(t.detach().cpu())
        self.nums = [a + int(b) for a, b in zip(self.nums, nums)]
        self.rows += int(rows)
        self.skipped = skipped if self.skipped is None else self.skipped.merge(skipped)

    def info(self) -> dict:
        from .data import SkipReport

        return {"rows": self.rows, "skipped": (self.skipped or SkipReport()).to_dict()}


def _load_partition(pass_no: int, job: _Job, pid: int, names: Sequence[str]):
    """``(tensors, nums, rows, skipped)`` of a partition file written by an earlier attempt."""
    from .data import SkipReport

    uri = partition_uri(job.output_uri, pass_no, pid)
    tensors, meta = load_tensors(uri)
    if pass_no == 1:
        st = CurvatureStatistics.from_flat(meta, tensors)
        if list(st.layers) != list(names):
            raise ValueError(f"{uri}: partition layers {list(st.layers)[:3]}... do not match the model's")
        flat = flat_sums(st.layers, st.infos)
        nums = [st.count, 0, st.skipped_batches, st.skipped_examples]
    else:
        if meta.get("format") != "infoform.efb_partition":
            raise ValueError(f"{uri}: not an EFB partition artifact")
        flat = [tensors[f"{k}/efb"] for k in names]
        nums = [0, int(meta["efb_count"]), 0, 0]
    return flat, nums, int(meta.get("rows", 0)), SkipReport.from_dict(meta["skipped"])


class _PassPlan:
    """Which partitions of pass ``pass_no`` are finished (rank 0 looks, all ranks agree)
    and which to compute, plus the data pipelines opened ahead of time: ``start()``
    opens the first partition to compute (so its start-up overlaps the model load or
    the eigendecomposition), :func:`_run_pass` opens each next one while the current
    one computes."""

    def __init__(self, pass_no: int, job: _Job, rank: int, world: int, device):
        self.pass_no, self.job, self.rank, self.world, self.device = pass_no, job, rank, world, device
        self.ids = job.pass1 if pass_no == 1 else job.pass2
        ep = job.endpoint_url
        self.done = _broadcast_object(finished_partitions(job.output_uri, pass_no, self.ids, ep) if rank == 0 else None,
                                      rank)
        self.todo = [p for p in self.ids if p not in set(self.done)]
        known = [job.rows.get(p) for p in self.todo]
        total = sum(known) if self.todo and all(r is not None for r in known) else None
        self.progress = _Progress(pass_no, total, world, rank, job.cfg.log_every_s)
        self.opened: dict[int, tuple[_Counter, _FirstBatch]] = {}

    def open(self, pid: int) -> None:
        import ray.train

        counter = _Counter()
        shard = ray.train.get_dataset_shard(f"p{self.pass_no}_{pid}")
        batches = _iter_valid_batches(shard, self.job, self.pass_no, pid, self.rank, self.device,
                                      DTYPES[self.job.cfg.model_dtype], counter, self.progress)
        self.opened[pid] = (counter, _FirstBatch(batches))

    def start(self) -> "_PassPlan":
        if self.todo and self.todo[0] not in self.opened:
            self.open(self.todo[0])
        return self


def _run_pass(plan: _PassPlan, model, infos, excluded, basis: Eigenbasis | None, rec: dict) -> _PassSum:
    """Compute, all-reduce and store every unfinished partition of ``plan``'s pass;
    return the pass's sum over all its partitions (finished ones read from their files)."""
    import torch.distributed as dist

    from laplace_core.collect import collect_efb, collect_statistics
    from laplace_core.keyed_rng import KeyedSampler

    job, pass_no, rank, world, device = plan.job, plan.pass_no, plan.rank, plan.world, plan.device
    cfg = job.cfg
    ids, done, todo, prog, opened = plan.ids, plan.done, plan.todo, plan.progress, plan.opened
    stats_dtype = DTYPES[cfg.stats_dtype]
    p = rec.setdefault(f"pass{pass_no}", {"collect_s": 0.0, "allreduce_s": 0.0, "allreduce_bytes": 0, "allreduce_calls": 0,
                                          "write_s": 0.0, "read_s": 0.0, "images": 0, "invalid": 0, "computed": [],
                                          "reused": list(done)})
    names = [k for k, i in infos.items() if pass_no == 1 or not i.diag_only]  # pass 2: no EFB for norm layers
    acc = _PassSum()
    writer = _PartitionWriter()
    t_pass = time.perf_counter()
    prog.restart(t_pass)  # the rate counts from here: model load / eigendecomposition waits are not in it
    if rank == 0 and todo:
        print(f"[curvature] pass {pass_no}: {len(todo)} partition(s) to compute, {len(done)} already finished", flush=True)
    plan.start()
    for pid in ids:
        if pid in done:
            t0 = time.perf_counter()
            acc.add(*_load_partition(pass_no, job, pid, names))
            p["read_s"] += time.perf_counter() - t0
            continue
        counter, pre = opened.pop(pid)
        # MC labels drawn from (seed, image key, draw): independent of which worker sees
        # which image, so 1 and N workers (and restarted ones) give the same sums.
        gen = KeyedSampler(cfg.seed)
        t0 = time.perf_counter()
        first, batches = pre.get()
        blocked = time.perf_counter() - t0
        counter.wait_s += blocked - (counter.first_wait_s or 0.0)  # count what the loop waited, not the thread
        counter.first_wait_s = blocked
        nxt = todo.index(pid) + 1
        if nxt < len(todo):  # start the next partition's data pipeline while this one computes
            plan.open(todo[nxt])

        def chain():
            yield first
            yield from batches

        if pass_no == 1:
            if first is None:
                local = _zero_stats(infos, excluded, cfg, device, stats_dtype)
            else:
                local = collect_statistics(model, chain(), fisher=cfg.fisher, mc_samples=cfg.mc_samples,
                                           generator=gen, dtype=stats_dtype, norm_layers=cfg.norm_layers)
            tensors = [t.to(device=device, dtype=stats_dtype) for t in flat_sums(local.layers, infos)]
            nums = [local.count, 0, local.skipped_batches, local.skipped_examples]
            del local
        else:
            if first is None:
                efb_local = {k: torch.zeros(i.shape, dtype=stats_dtype, device=device) for k, i in infos.items()}
                n_local = 0
            else:
                efb_local, n_local = collect_efb(model, chain(), basis, fisher=cfg.fisher, mc_samples=cfg.mc_samples,
                                                 generator=gen, dtype=stats_dtype, norm_layers=cfg.norm_layers)
            tensors = [efb_local[k].to(device=device, dtype=stats_dtype) for k in names]
            nums = [0, n_local, 0, 0]
            del efb_local
        p["collect_s"] += time.perf_counter() - t0
        p["data_wait_s"] = p.get("data_wait_s", 0.0) + counter.wait_s
        p["data_start_s"] = p.get("data_start_s", 0.0) + (counter.first_wait_s or 0.0)
        # ---- all-reduce (pass 1: A, G, diag; pass 2: efb) + counts, in flat buckets
        counts = torch.tensor(nums + [counter.rows, counter.skipped.count], dtype=torch.float64, device=device)
        sub = {"allreduce_s": 0.0, "allreduce_bytes": 0, "allreduce_calls": 0}
        reduced = _allreduce_sum(tensors + [counts], int(cfg.bucket_mb * 2**20), sub)
        del tensors
        for k2 in sub:
            p[k2] += sub[k2]
        counts_r = [int(round(float(v))) for v in reduced[-1].cpu()]
        count, efb_count, sk_b, sk_e, rows_read, rows_invalid = counts_r
        reports = [None] * world
        dist.all_gather_object(reports, counter.skipped)
        skip_report = reports[0]
        for r in reports[1:]:
            skip_report = skip_report.merge(r)
        expected = job.rows.get(pid)
        if expected is not None and rows_read != expected:
            raise RuntimeError(f"pass {pass_no} partition {pid}: workers read {rows_read} rows, expected {expected}")
        prog.partition_done(rows_read)
        p["images"] += rows_read
        p["invalid"] += rows_invalid
        p["computed"].append(pid)
        vals = [t.detach().cpu() for t in reduced[:-1]]
        del reduced
        acc.add(vals, [count, efb_count, sk_b, sk_e], rows_read, skip_report)
        # ---- rank 0 writes the partition in the background (manifest last = commit point)
        if rank == 0:
            part_meta = {"partition": pid, "pass": pass_no, "rows": rows_read, "invalid_rows": rows_invalid,
                         "skipped": skip_report.to_dict(), "run_id": job.run_id, "written_at": time.time(),
                         "world_size": world}
            uri = partition_uri(job.output_uri, pass_no, pid)
            if pass_no == 1:
                layers = layers_from_sums(vals, infos)
                st = CurvatureStatistics(layers=layers, infos=dict(infos), count=count, skipped_batches=sk_b,
                                         skipped_examples=sk_e, fisher=cfg.fisher, mc_samples=cfg.mc_samples,
                                         excluded=dict(excluded))
                payload = (st.flat_tensors(), {**st.meta(), **part_meta})
            else:
                meta = {"format": "infoform.efb_partition", "version": 1, "efb_count": efb_count,
                        "names": names, **part_meta}
                payload = ({f"{k}/efb": vals[i] for i, k in enumerate(names)}, meta)

            def write(uri=uri, payload=payload, pid=pid, rows=rows_read, invalid=rows_invalid):
                save_tensors(uri, *payload)
                print(f"[curvature] pass {pass_no}: partition {pid} done ({rows} rows, {invalid} invalid)", flush=True)

            t0 = time.perf_counter()
            writer.submit(write)
            p["write_s"] += time.perf_counter() - t0  # time spent waiting for the previous write
        del vals
    t0 = time.perf_counter()
    writer.wait()
    dist.barrier()  # every computed partition is committed before anyone goes on
    p["write_s"] += time.perf_counter() - t0
    p["write_thread_s"] = writer.seconds
    p["wall_s"] = time.perf_counter() - t_pass
    return acc


def _pass1_statistics(acc: _PassSum, infos, excluded, cfg: CurvatureConfig) -> CurvatureStatistics:
    names = list(infos)
    t = acc.tensors
    layers = layers_from_sums(t, infos)
    count, _, sk_b, sk_e = acc.nums
    return CurvatureStatistics(layers=layers, infos=dict(infos), count=count, skipped_batches=sk_b,
                               skipped_examples=sk_e, fisher=cfg.fisher, mc_samples=cfg.mc_samples,
                               excluded=dict(excluded))


def _distributed_eigenbasis(stats: CurvatureStatistics, rank: int, world: int, device, rec: dict) -> Eigenbasis:
    """Each rank decomposes its layers (:func:`pipelines.eigen.assign_layers`), then every
    rank broadcasts its packed results (one collective per rank)."""
    import torch.distributed as dist

    shapes = {k: info.shape for k, info in stats.infos.items() if not info.diag_only}  # norm layers: no factors
    plan = assign_layers(shapes, world)
    t0 = time.perf_counter()
    # on the worker's device (a GPU's float64 eigh of resnet50's factors: ~1.5 s, against
    # minutes on a few CPU threads); kept on the CPU afterwards like the statistics
    mine = {k: layer_eigenbasis(stats.layers[k].A.to(device), stats.layers[k].G.to(device), stats.count,
                                name=k).to(device="cpu") for k in plan[rank]}
    rec["eigh_s"] = time.perf_counter() - t0
    rec["eigh_layers"] = list(plan[rank])
    t0 = time.perf_counter()
    got: dict[str, LayerBasis] = {}
    nbytes = 0
    for src in range(world):
        names = plan[src]
        sizes = []
        for k in names:
            m, n = shapes[k]
            sizes.append((n * n, n, m * m, m, 1))
        total = sum(sum(s) for s in sizes)
        if total == 0:
            continue
        if src == rank:
            buf = torch.cat([torch.cat([b.U_A.reshape(-1), b.S_A, b.U_G.reshape(-1), b.S_G,
                                        torch.tensor([float(b.clamped)], dtype=torch.float64)])
                             for b in (mine[k] for k in names)]).to(device=device, dtype=torch.float64)
        else:
            buf = torch.empty(total, dtype=torch.float64, device=device)
        dist.broadcast(buf, src=src)
        nbytes += buf.numel() * 8
        buf = buf.cpu()
        off = 0
        for k, (a2, a, g2, g, _) in zip(names, sizes):
            m, n = shapes[k]
            U_A = buf[off: off + a2].reshape(n, n); off += a2
            S_A = buf[off: off + a]; off += a
            U_G = buf[off: off + g2].reshape(m, m); off += g2
            S_G = buf[off: off + g]; off += g
            clamped = int(buf[off]); off += 1
            got[k] = mine[k] if src == rank else LayerBasis(U_A.clone(), S_A.clone(), U_G.clone(), S_G.clone(), clamped)
    rec["eigen_broadcast_s"] = time.perf_counter() - t0
    rec["eigen_broadcast_bytes"] = nbytes
    layers = {k: got[k] for k in stats.layers if k in shapes}
    return Eigenbasis(layers=layers, clamped={k: b.clamped for k, b in layers.items()})


def _worker_setup(job: _Job) -> tuple[int, int, torch.device]:
    """``(rank, world_size, device)`` of this Ray Train worker; also points S3 at the
    job's endpoint, sets the torch thread count and the process's malloc settings
    (:mod:`pipelines.malloc`). Shared by every pass's loop."""
    import ray.train

    from .malloc import tune_malloc

    tune_malloc()
    ctx = ray.train.get_context()
    if job.endpoint_url:
        os.environ["AWS_ENDPOINT_URL_S3"] = job.endpoint_url
    if job.cfg.torch_threads:
        torch.set_num_threads(int(job.cfg.torch_threads))
    if job.use_gpu:
        import ray.train.torch as rtt

        device = rtt.get_device()
    else:
        device = torch.device("cpu")
    return ctx.get_world_rank(), ctx.get_world_size(), device


def _train_loop(config: dict) -> None:
    """``train_loop_per_worker``: pass 1, eigenbasis, pass 2, reduced statistics."""
    import torch.distributed as dist

    from .models import load_model

    job: _Job = config["job"]
    cfg = job.cfg
    rank, world, device = _worker_setup(job)
    rec: dict[str, Any] = {"rank": rank, "world_size": world, "device": str(device), "backend": dist.get_backend()}
    t_all = time.perf_counter()
    plan1 = _PassPlan(1, job, rank, world, device).start()  # data start-up overlaps the model load
    t0 = time.perf_counter()
    model = load_model(job.model.name, job.model.weights, job.model.num_classes, endpoint_url=job.endpoint_url)
    model = model.to(device=device, dtype=DTYPES[cfg.model_dtype]).eval()
    _, infos, excluded = find_layers(model, norm_layers=cfg.norm_layers)
    rec["model_load_s"] = time.perf_counter() - t0

    acc1 = _run_pass(plan1, model, infos, excluded, None, rec)
    stats = _pass1_statistics(acc1, infos, excluded, cfg)
    rec["skipped_pass1"] = acc1.info()
    del acc1

    basis = None
    # open pass 2's first partition now: its data start-up overlaps the eigendecomposition
    plan2 = _PassPlan(2, job, rank, world, device).start() if job.pass2 else None
    if cfg.needs_basis:
        buri = _basis_uri(job.output_uri)
        have = _broadcast_object(storage.exists(_manifest(buri), job.endpoint_url) if rank == 0 else None, rank)
        t0 = time.perf_counter()
        if have:
            basis = load_eigenbasis(buri)
            rec["eigenbasis"] = "loaded"
        else:
            basis = _distributed_eigenbasis(stats, rank, world, device, rec)
            rec["eigenbasis"] = "computed"
            if rank == 0:
                save_eigenbasis(buri, basis, stats.count)
            dist.barrier()
        rec["eigen_s"] = time.perf_counter() - t0

    if job.pass2:
        dev_basis = Eigenbasis(layers={k: b.to(device=device) for k, b in basis.layers.items()}, clamped=dict(basis.clamped))
        acc2 = _run_pass(plan2, model, infos, excluded, dev_basis, rec)
        rec["skipped_pass2"] = acc2.info()
        stats = stats.with_efb(dict(zip([k for k, i in stats.infos.items() if not i.diag_only], acc2.tensors)), acc2.nums[1])

    if rank == 0:
        t0 = time.perf_counter()
        stats.save(_reduced_uri(job.output_uri))
        rec["write_reduced_s"] = time.perf_counter() - t0
    rec["total_s"] = time.perf_counter() - t_all
    recs = [None] * world
    dist.all_gather_object(recs, {k: v for k, v in rec.items() if not k.startswith("skipped")})
    if rank == 0:
        storage.write_json_atomic(storage.join(job.output_uri, "stats", "worker_report.json"),
                                  {**rec, "ranks": recs}, job.endpoint_url)
    dist.barrier()


# =========================================================================== driver side
def _lossless_data_config():
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


def _make_trainer(loop, loop_config: dict, cfg: CurvatureConfig, use_gpu: bool, name: str, output_uri: str,
                  datasets: dict):
    """The ``TorchTrainer`` every pass runs on: ``cfg.num_workers`` workers (GPU + NCCL
    when ``use_gpu``, else gloo), ``FailureConfig(cfg.max_failures)``, the lossless data
    config; Ray Train's own files go next to a local output, or to a temp dir for S3."""
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    resources = {"CPU": cfg.cpus_per_worker}
    if use_gpu:
        resources["GPU"] = cfg.gpus_per_worker
        note = gpu_shortfall(cfg.num_workers * cfg.gpus_per_worker, float(ray.cluster_resources().get("GPU", 0.0)))
        if note:
            print(note, flush=True)
    if storage.is_remote(output_uri):
        storage_path = os.path.join(tempfile.gettempdir(), "infoform_ray_train")
    else:
        storage_path = os.path.abspath(storage.join(output_uri, "_ray_train"))
    return TorchTrainer(
        loop,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.num_workers, use_gpu=use_gpu,
                                               resources_per_worker=resources),
        run_config=ray.train.RunConfig(name=name, storage_path=storage_path,
                                       failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures)),
        datasets=datasets,
        dataset_config=_lossless_data_config(),
    )


def _model_ref(model_spec) -> _ModelRef:
    if isinstance(model_spec, str):
        return _ModelRef(model_spec, None, None)
    try:
        return _ModelRef(str(model_spec.name), model_spec.weights, model_spec.num_classes)
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


def _partition_dataset(p, data_config, endpoint_url):
    import ray.data

    if isinstance(p, ray.data.Dataset):
        return p
    from .data import build_dataset

    return build_dataset(p, data_config)


@contextlib.contextmanager
def _endpoint_env(endpoint_url: str | None):
    """Temporarily export ``AWS_ENDPOINT_URL_S3`` so that :mod:`laplace_core.io` (plain
    fsspec URLs, no endpoint argument) reaches the same S3-compatible store."""
    if not endpoint_url:
        yield
        return
    old = os.environ.get("AWS_ENDPOINT_URL_S3")
    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint_url
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("AWS_ENDPOINT_URL_S3", None)
        else:
            os.environ["AWS_ENDPOINT_URL_S3"] = old


def _index_partitions(partitions: Sequence[Any]) -> tuple[list[int], dict[int, Any], dict[int, int | None]]:
    """``(ids, partition by id, rows by id)``; ids must be unique (they name the artifacts)."""
    ids = [_partition_id(p, i) for i, p in enumerate(partitions)]
    if len(set(ids)) != len(ids):
        raise ValueError(f"partition ids must be unique, got {ids}")
    by_id = dict(zip(ids, partitions))
    return ids, by_id, {pid: _partition_rows(p) for pid, p in by_id.items()}


def run_curvature(
    model_spec,
    partitions: Sequence[Any],
    cfg: CurvatureConfig,
    output_uri: str,
    *,
    data_config=None,
    endpoint_url: str | None = None,
    run_name: str | None = None,
) -> CurvatureResult:
    """Run the distributed curvature pass and build the posteriors; see the module docstring.

    ``model_spec``: a model name or anything with ``.name``, ``.weights``,
    ``.num_classes`` (e.g. :class:`pipelines.config.ModelSpec`); loaded in every
    worker with :func:`pipelines.models.load_model`. ``partitions``: fixed, ordered
    data partitions (``pipelines.data`` partitions, turned into Ray Datasets with
    ``build_dataset(partition, data_config)``, or ready ``ray.data.Dataset`` objects
    with columns ``image`` (float32 3xHxW), ``label``, optional ``valid``/``path``).
    Partition ids are the partitions' ``index`` or their list position. Ray must be
    initialised (or this calls ``ray.init()``).
    """
    import ray

    if not isinstance(cfg, CurvatureConfig):
        raise ValueError(f"cfg must be a CurvatureConfig, got {type(cfg).__name__}")
    if not partitions:
        raise ValueError("run_curvature needs at least one data partition")
    if not ray.is_initialized():
        ray.init()
    endpoint_url = storage.resolve_endpoint(endpoint_url) if storage.is_remote(output_uri) else endpoint_url
    model = _model_ref(model_spec)
    ids, by_id, rows = _index_partitions(partitions)
    efb_ids = efb_partition_ids(ids, rows, cfg.efb_fraction, cfg.efb_max_examples) if cfg.needs_efb else ()
    use_gpu = cfg.use_gpu if cfg.use_gpu is not None else ray.cluster_resources().get("GPU", 0) > 0
    run_id = run_name or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"

    done1 = finished_partitions(output_uri, 1, ids, endpoint_url)
    done2 = finished_partitions(output_uri, 2, efb_ids, endpoint_url)
    datasets = {}
    for pid in ids:
        if pid not in done1:
            datasets[f"p1_{pid}"] = _partition_dataset(by_id[pid], data_config, endpoint_url)
    for pid in efb_ids:
        if pid not in done2:
            datasets[f"p2_{pid}"] = _partition_dataset(by_id[pid], data_config, endpoint_url)

    job = _Job(model=model, cfg=cfg, output_uri=output_uri, endpoint_url=endpoint_url, pass1=tuple(ids),
               pass2=tuple(efb_ids), rows=rows, run_id=run_id, use_gpu=bool(use_gpu))
    trainer = _make_trainer(_train_loop, {"job": job}, cfg, bool(use_gpu), f"curvature-{run_id}", output_uri,
                            datasets)
    t0 = time.perf_counter()
    trainer.fit()
    fit_s = time.perf_counter() - t0

    with _endpoint_env(endpoint_url if storage.is_remote(output_uri) else None):
        stats = CurvatureStatistics.load(_reduced_uri(output_uri))
        basis = load_eigenbasis(_basis_uri(output_uri)) if cfg.needs_basis else None
        report = storage.read_json(storage.join(output_uri, "stats", "worker_report.json"), endpoint_url)
        t0 = time.perf_counter()
        posteriors = build_and_save(stats, basis, cfg.methods, cfg.rank, output_uri,
                                    n_data=cfg.n_data, prior_precision=cfg.prior_precision) if cfg.methods else {}
        post_s = time.perf_counter() - t0

    computed = {"pass1": tuple(p for p in ids if p not in done1), "pass2": tuple(p for p in efb_ids if p not in done2)}
    reused = {"pass1": tuple(done1), "pass2": tuple(done2)}
    passes = {k: v for k, v in report.items() if k.startswith("pass")}
    ar_s = float(sum(v.get("allreduce_s", 0.0) for v in passes.values()))
    ar_b = int(sum(v.get("allreduce_bytes", 0) for v in passes.values()))
    timings = {"fit_s": fit_s, "posterior_s": post_s, "worker": report}
    skipped = {"pass1": report.get("skipped_pass1", {}), "pass2": report.get("skipped_pass2", {})}
    summary = {
        "run_id": run_id,
        "model": dataclasses.asdict(model),
        "config": _cfg_json(cfg),
        "num_workers": cfg.num_workers,
        "use_gpu": bool(use_gpu),
        "partitions": list(ids),
        "efb_partitions": list(efb_ids),
        "computed_partitions": {k: list(v) for k, v in computed.items()},
        "reused_partitions": {k: list(v) for k, v in reused.items()},
        "count": stats.count,
        "efb_count": stats.efb_count,
        "excluded": stats.excluded,
        "clamped_eigenvalues": basis.total_clamped() if basis is not None else 0,
        "allreduce_s": ar_s,
        "allreduce_bytes": ar_b,
        "timings": timings,
        "skipped": skipped,
        "posteriors": posteriors,
    }
    storage.write_json_atomic(storage.join(output_uri, "stats", "curvature.json"), summary, endpoint_url)
    return CurvatureResult(
        output_uri=output_uri, stats=stats, basis=basis, posteriors=posteriors, timings=timings,
        allreduce_seconds=ar_s, allreduce_bytes=ar_b, skipped=skipped, computed_partitions=computed,
        reused_partitions=reused, efb_partitions=tuple(efb_ids), num_workers=cfg.num_workers,
        use_gpu=bool(use_gpu), run_id=run_id,
    )


def _cfg_json(cfg: CurvatureConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["methods"] = list(cfg.methods)
    return json.loads(json.dumps(d, default=str))
