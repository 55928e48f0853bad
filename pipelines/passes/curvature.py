"""The curvature stage on Ray Train: pass 1, the eigenbasis, the EFB pass, the reduced statistics.

Data flow: **partitions -> per-worker running sums -> all-reduce per checkpoint interval
(and once at the end) -> pass-1 sums -> eigenbasis (spread over workers) -> EFB sums (same
scheme) -> reduced statistics.** Both passes run on the partitioned-pass engine
(:mod:`pipelines.distributed`, pass kinds :class:`~pipelines.distributed.kinds.Pass1Kind`
and :class:`~pipelines.distributed.kinds.EfbKind`). The posteriors are built by the posterior
stage (:func:`pipelines.passes.posterior.build_posteriors`) from what this stage leaves.

Every worker runs the same :func:`laplace_core.curvature.collect.collect_statistics` that a unit test
runs in one process; statistics are sums, so the all-reduced sums of ``W`` workers equal the
single-process sums over the same images, up to round-off. For ``fisher="mc"`` each label is
drawn from ``(seed, key of the image path, draw)`` (:func:`path_keys`), so it does not matter
which worker sees which image, nor whether a worker was restarted.

Artifact layout under ``output_uri`` (local path or ``s3://bucket/prefix``); each ``<dir>/``
is a :mod:`laplace_core.io` artifact (``tensors.safetensors`` + ``manifest.json``, manifest
written last):

``stats/passes/pass1/ckpt-<k>/``
    the reduced pass-1 running sum of ``k`` finished partitions (``A`` and ``G`` as upper
    triangles, the diagonal), their ids, counts and skip report; ``final`` once the pass is
    done. At most one at a time (the older one is removed after the newer one commits).
``stats/passes/pass2/ckpt-<k>/``
    the EFB running sum (``<layer>/efb``) of ``k`` finished EFB partitions (the finished pass
    is not checkpointed again: ``stats/reduced`` follows it).
``stats/eigenbasis/``
    ``<layer>/{U_A,S_A,U_G,S_G}`` of ``A/M`` and ``G/M``.
``stats/reduced/``
    the final ``CurvatureStatistics`` (pass-1 sums with the EFB sums attached).
``stats/worker_report.json``
    rank 0's record of the last (successful) attempt, every rank's under ``ranks``: per pass
    the reduces, all-reduce calls and bytes, bytes written, seconds in compute, data wait,
    reduce and write, partitions computed and reused.
``stats/curvature.json``
    run summary.

Fault tolerance: ``FailureConfig(max_failures)`` restarts the worker group after a worker
dies; the restarted loop resumes each pass from its newest valid checkpoint (and reuses a
saved eigenbasis), as does a re-submitted job with the same settings.
``checkpoint_every_s`` sets the interval (``0``: after every partition).
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence


from laplace_core.curvature.batch_loop import PRECISIONS
from laplace_core.basis.eigenbasis import Eigenbasis
from laplace_core.curvature.layer_selection import check_selection
from laplace_core.curvature.layers import find_layers
from laplace_core.curvature.statistics import CurvatureStatistics

from pipelines.config.schema import CurvatureSpec, PosteriorSpec
from pipelines.config.settings import same_as
from pipelines.storage import uris as storage
from pipelines.storage.store import RunStore
from pipelines.distributed import (
    DTYPES,
    FaultInjection,
    Job,
    PassRun,
    broadcast_object,
    say,
    buckets,
    dataset_name,
    fingerprint,
    gpu_shortfall,
    index_partitions,
    load_checkpoint,
    decode_cpus_that_fit,
    fit_interruptibly,
    make_trainer,
    trainer_cpus,
    model_ref,
    put_sources,
    path_keys,
    worker_setup,
)
from laplace_core.posteriors.methods import layer_methods, method_info
from pipelines.distributed.checkpoint import tensor_bytes
from pipelines.storage import layout
from pipelines.distributed.kinds import EfbKind, Pass1Kind
from pipelines.passes.eigen import distributed_eigenbasis, load_eigenbasis, save_eigenbasis

__all__ = [
    "FaultInjection",
    "CurvatureConfig",
    "CurvatureResult",
    "BASIS_METHODS",
    "EFB_METHODS",
    "run_curvature",
    "pass_uri",
    "basis_uri",
    "reduced_uri",
    "efb_partition_ids",
    "finished_partitions",
    "path_keys",
    "buckets",
    "gpu_shortfall",
    "curvature_fingerprint",
]

#: Per-layer methods (the registry's; ``subnet`` has a pass of its own).
METHOD_NAMES = layer_methods()
#: Methods that need the second (EFB) pass.
EFB_METHODS = frozenset(m for m in METHOD_NAMES if method_info(m).needs_efb)
#: Methods that need the eigenbasis.
BASIS_METHODS = frozenset(m for m in METHOD_NAMES if method_info(m).needs_basis)


# =========================================================================== config
@dataclass(frozen=True)
class CurvatureConfig(CurvatureSpec):
    """Settings of the distributed curvature pass: the ``curvature`` section
    (:class:`~pipelines.config.schema.CurvatureSpec`: every setting, its default, range and
    help) plus what the run takes from ``posterior``: ``methods`` (which passes run:
    ``EFB_METHODS`` need pass 2, ``BASIS_METHODS`` the eigenbasis; the posteriors themselves are
    built by the posterior stage), ``norm_layers`` and ``layers``; ``fault_injection`` is for tests.

    ``cpus_per_worker``: 0.5 on a 2-core machine, so that Ray Data keeps a CPU to read shards
    (with 1 CPU per worker and 2 CPUs, no CPU is left to read them and the pass waits).
    ``efb_fraction`` / ``efb_max_examples``: the second (EFB) pass runs on an evenly spaced,
    deterministic subset of the partitions (:func:`efb_partition_ids`).
    ``checkpoint_every_s``: the workers all-reduce their running sums and rank 0 commits a
    checkpoint when this many seconds have passed since the last one, and once at the end
    (``0``: after every partition; ``None``: only at the end).
    """

    methods: tuple[str, ...] = same_as(PosteriorSpec, "methods", choices=None)  # per-layer ones: _check
    norm_layers: str = same_as(PosteriorSpec, "norm_layers")
    layers: str | tuple[str, ...] = same_as(PosteriorSpec, "layers")
    fault_injection: FaultInjection | None = field(default=None, metadata={"fingerprint": False})

    def _check(self) -> None:
        if isinstance(self.fault_injection, Mapping):
            object.__setattr__(self, "fault_injection", FaultInjection.from_mapping(self.fault_injection))
        object.__setattr__(self, "methods", tuple(self.methods))
        object.__setattr__(self, "layers", check_selection(self.layers))
        for m in self.methods:
            if m not in METHOD_NAMES:
                raise ValueError(f"unknown posterior method {m!r}; valid: {', '.join(METHOD_NAMES)}")

    @property
    def needs_basis(self) -> bool:
        return any(m in BASIS_METHODS for m in self.methods)

    @property
    def needs_efb(self) -> bool:
        return any(m in EFB_METHODS for m in self.methods)


@dataclass(frozen=True)
class CurvatureResult:
    """What a run produced (everything is also in the artifacts under ``output_uri``).

    ``stats``: reduced statistics (pass-1 sums of all partitions + EFB sums); ``basis``: the
    eigenbasis (None when no method needs it); ``timings``: per pass and stage seconds;
    ``allreduce_seconds`` / ``allreduce_bytes``: time in and payload of the statistics
    all-reduces of the last attempt (rank 0); ``passes``: per pass the records of every rank
    (:func:`pipelines.distributed.engine.new_pass_record`); ``skipped``: rows read / invalid
    rows per pass; ``computed_partitions`` / ``reused_partitions``: ``{"pass1": (...),
    "pass2": (...)}``: the partitions this run computed and those it took from checkpoints.
    """

    output_uri: str
    stats: CurvatureStatistics
    basis: Eigenbasis | None
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
    passes: dict[str, Any] = dataclasses.field(default_factory=dict)


# =========================================================================== layout
pass_uri = layout.pass_uri


basis_uri = layout.basis_uri


reduced_uri = layout.reduced_uri


def _manifest(uri: str) -> str:
    return storage.join(uri, "manifest.json")


def finished_partitions(store: RunStore, name: str, fp: str) -> list[int]:
    """The finished partitions of pass ``name`` in its newest usable checkpoint with fingerprint
    ``fp`` (:func:`curvature_fingerprint`); [] when there is none."""
    found = load_checkpoint(store.pass_uri(name), fp, store)
    return [int(p) for p in found[1]["done"]] if found is not None else []


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


# =========================================================================== worker side
def _eigen_work(stats: CurvatureStatistics) -> str:
    """``eigendecomposition of N factors (largest n x n)``: what the silent step between the passes does."""
    dims = [d for k, info in stats.infos.items() if not info.diag_only for d in info.shape]
    return f"eigendecomposition of {len(dims)} factors (largest {max(dims, default=0)} x {max(dims, default=0)})"


def _train_loop(config: dict) -> None:
    """``train_loop_per_worker``: pass 1, eigenbasis, pass 2, reduced statistics."""
    import torch.distributed as dist

    from pipelines.ingest.models import load_model

    job: Job = config["job"]
    cfg: CurvatureConfig = job.cfg
    rank, world, device = worker_setup(job)
    rec: dict[str, Any] = {"rank": rank, "world_size": world, "device": str(device), "backend": dist.get_backend()}
    t_all = time.perf_counter()
    kind1 = Pass1Kind(cfg)
    run1 = PassRun(kind1, job, rank, world, device, pass_uri(job.output_uri, kind1.name)).start()  # overlaps the load
    t0 = time.perf_counter()
    model = load_model(job.model.name, job.model.weights, job.model.num_classes, options=job.store.options)
    model = model.to(device=device, dtype=DTYPES[cfg.model_dtype]).eval()
    _, infos, excluded = find_layers(model, norm_layers=cfg.norm_layers, layers=cfg.layers)
    rec["model_load_s"] = time.perf_counter() - t0

    kind1.bind(model, infos, excluded)
    res1 = run1.run(cfg.checkpoint_every_s)
    rec["pass1"] = res1.record
    rec["skipped_pass1"] = res1.info()
    stats = kind1.statistics(res1.state, res1.counts)
    del res1

    basis = None
    kind2 = EfbKind(cfg)
    # open pass 2's first partition now: its data start-up overlaps the eigendecomposition
    run2 = PassRun(kind2, job, rank, world, device, pass_uri(job.output_uri, kind2.name)).start() \
        if job.passes.get("pass2") else None
    if cfg.needs_basis:
        basis = _eigenbasis(job, stats, rank, world, device, rec)

    if run2 is not None:
        dev_basis = Eigenbasis(layers={k: b.to(device=device) for k, b in basis.layers.items()},
                               clamped=dict(basis.clamped))
        kind2.bind(model, infos, dev_basis)
        res2 = run2.run(cfg.checkpoint_every_s)
        rec["pass2"] = res2.record
        rec["skipped_pass2"] = res2.info()
        stats = stats.with_efb(kind2.efb(res2.state), res2.counts["efb_count"])
        del res2

    _write_reduced(job, stats, rank, world, rec, t_all)


def _eigenbasis(job: Job, stats: CurvatureStatistics, rank: int, world: int, device, rec: dict[str, Any]) -> Eigenbasis:
    """The run's eigenbasis: loaded when an earlier attempt saved it, else spread over the
    workers and saved by rank 0; ``rec`` gets ``eigenbasis`` ("loaded"/"computed") and ``eigen_s``."""
    import torch.distributed as dist

    buri = basis_uri(job.output_uri)
    have = broadcast_object(job.store.exists(_manifest(buri)) if rank == 0 else None, rank)
    t0 = time.perf_counter()
    if have:
        basis = load_eigenbasis(buri, job.store)
        rec["eigenbasis"] = "loaded"
    else:
        if rank == 0:
            say(f"[curvature] eigenbasis: {_eigen_work(stats)}, spread over {world} worker(s)")
        basis = distributed_eigenbasis(stats, rank, world, device, rec, every_s=job.cfg.log_every_s)
        rec["eigenbasis"] = "computed"
        if rank == 0:
            save_eigenbasis(buri, basis, stats.count, job.store)
        dist.barrier()
    rec["eigen_s"] = time.perf_counter() - t0
    if rank == 0:
        say(f"[curvature] eigenbasis {rec['eigenbasis']} in {rec['eigen_s']:.1f} s")
    return basis


def _write_reduced(job: Job, stats: CurvatureStatistics, rank: int, world: int, rec: dict[str, Any],
                   t_all: float) -> None:
    """Rank 0 writes ``stats/reduced`` and the worker report (every rank's record); all ranks meet after."""
    import torch.distributed as dist

    if rank == 0:
        t0 = time.perf_counter()
        stats.save(job.store.reduced_uri(), job.store.fsspec_options(job.output_uri))
        rec["write_reduced_s"] = time.perf_counter() - t0
        rec["reduced_bytes"] = tensor_bytes(stats.flat_tensors())
    rec["total_s"] = time.perf_counter() - t_all
    recs = [None] * world
    dist.all_gather_object(recs, {k: v for k, v in rec.items() if not k.startswith("skipped")})
    if rank == 0:
        job.store.write_json_atomic(job.store.worker_report_uri(), {**rec, "ranks": recs})
    dist.barrier()


# =========================================================================== driver side
def curvature_fingerprint(model, ids: Sequence[int], efb_ids: Sequence[int], rows: Mapping[int, int | None],
                          by_id: Mapping[int, Any], cfg: "CurvatureConfig") -> str:
    """What the checkpoints of a run depend on: the model, the partitions (ids, sizes, data
    fingerprints), the EFB subset and the settings that change the sums. A checkpoint with
    another fingerprint is never used."""
    return fingerprint({
        "model": dataclasses.asdict(model), "partitions": list(ids), "efb": list(efb_ids),
        "rows": [rows[p] for p in ids], "data": [getattr(by_id[p], "fingerprint", None) for p in ids],
        **{k: getattr(cfg, k) for k in ("fisher", "mc_samples", "seed", "model_dtype", "stats_dtype", "needs_basis")},
        **({} if cfg.precision == "fp32" else {"precision": cfg.precision}),  # fp32 checkpoints keep their fingerprint
    })


def run_curvature(
    model_spec,
    partitions: Sequence[Any],
    cfg: CurvatureConfig,
    store: RunStore,
    *,
    data_config=None,
    run_name: str | None = None,
) -> CurvatureResult:
    """Run the curvature stage; see the module docstring.

    ``model_spec``: a model name or anything with ``.name``, ``.weights``, ``.num_classes``
    (e.g. :class:`pipelines.config.schema.ModelSpec`); loaded in every worker with
    :func:`pipelines.ingest.models.load_model`. ``partitions``: fixed, ordered data partitions
    (``pipelines.ingest.index`` partitions, turned into Ray Datasets with ``build_dataset(partition,
    data_config)``, or ready ``ray.data.Dataset`` objects with columns ``image`` (float32
    3xHxW), ``label``, optional ``valid``/``path``). Partition ids are the partitions'
    ``index`` or their list position. ``store``: the run's store (its output and resolved storage
    options), handed to every worker as is. Ray must be initialised (or this calls ``ray.init()``).
    """
    import ray

    if not isinstance(cfg, CurvatureConfig):
        raise ValueError(f"cfg must be a CurvatureConfig, got {type(cfg).__name__}")
    if not partitions:
        raise ValueError("run_curvature needs at least one data partition")
    if not ray.is_initialized():
        ray.init()
    output_uri = store.output
    model = model_ref(model_spec)
    ids, by_id, rows = index_partitions(partitions)
    efb_ids = efb_partition_ids(ids, rows, cfg.efb_fraction, cfg.efb_max_examples) if cfg.needs_efb else ()
    use_gpu = cfg.use_gpu if cfg.use_gpu is not None else ray.cluster_resources().get("GPU", 0) > 0
    run_id = run_name or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    fp = curvature_fingerprint(model, ids, efb_ids, rows, by_id, cfg)

    passes = {"pass1": tuple(ids), "pass2": tuple(efb_ids)}
    done = {name: finished_partitions(store, name, fp) for name in passes}
    # index partitions: each rank builds the dataset of its share when its pass reaches the
    # partition (every partition is there, should a rank resume from an older checkpoint);
    # ready-made Ray Datasets go to the trainer as they are
    data_config = decode_cpus_that_fit(cfg, data_config, "curvature")
    sources, ready = put_sources(by_id, ids, data_config, cfg.num_workers)
    datasets = {dataset_name(name, pid): ready[pid] for name, pids in passes.items() for pid in pids
                if pid in ready and pid not in done[name]}

    job = Job(model=model, cfg=cfg, store=store, passes=passes, rows=rows, run_id=run_id,
              use_gpu=bool(use_gpu), fingerprint=fp, sources=sources)
    trainer = make_trainer(_train_loop, {"job": job}, cfg, bool(use_gpu), f"curvature-{run_id}", output_uri, datasets)
    t0 = time.perf_counter()
    fit_interruptibly(trainer, trainer_cpus(cfg, data_config), "curvature")
    fit_s = time.perf_counter() - t0

    return _curvature_result(job, done, fit_s)


def _curvature_result(job: Job, done: Mapping[str, Sequence[int]], fit_s: float) -> CurvatureResult:
    """After the fit: the reduced statistics, the eigenbasis and the worker report read back, the
    partitions computed here and those taken from checkpoints (``done``), and the summary written
    to ``stats/curvature.json``."""
    store, cfg, passes = job.store, job.cfg, job.passes
    output_uri = store.output
    stats = CurvatureStatistics.load(store.reduced_uri(), store.fsspec_options(output_uri))
    basis = load_eigenbasis(basis_uri(output_uri), store) if cfg.needs_basis else None
    report = store.read_json(store.worker_report_uri())

    computed = {k: tuple(p for p in v if p not in done[k]) for k, v in passes.items()}
    reused = {k: tuple(p for p in v if p in done[k]) for k, v in passes.items()}
    per_pass = {k: {"ranks": [r.get(k, {}) for r in report.get("ranks", [])]} for k in passes if k in report}
    ar_s = float(sum(report[k].get("allreduce_s", 0.0) for k in per_pass))
    ar_b = int(sum(report[k].get("allreduce_bytes", 0) for k in per_pass))
    timings = {"fit_s": fit_s, "worker": report}
    skipped = {"pass1": report.get("skipped_pass1", {}), "pass2": report.get("skipped_pass2", {})}
    summary = {
        "run_id": job.run_id,
        "model": dataclasses.asdict(job.model),
        "config": _cfg_json(cfg),
        "fingerprint": job.fingerprint,
        "num_workers": cfg.num_workers,
        "use_gpu": job.use_gpu,
        "partitions": list(passes["pass1"]),
        "efb_partitions": list(passes["pass2"]),
        "computed_partitions": {k: list(v) for k, v in computed.items()},
        "reused_partitions": {k: list(v) for k, v in reused.items()},
        "count": stats.count,
        "efb_count": stats.efb_count,
        "excluded": stats.excluded,
        "clamped_eigenvalues": basis.total_clamped() if basis is not None else 0,
        "allreduce_s": ar_s,
        "allreduce_bytes": ar_b,
        "passes": pass_records(report),
        "timings": timings,
        "skipped": skipped,
    }
    store.write_json_atomic(store.curvature_summary_uri(), summary)
    return CurvatureResult(
        output_uri=output_uri, stats=stats, basis=basis, timings=timings, allreduce_seconds=ar_s,
        allreduce_bytes=ar_b, skipped=skipped, computed_partitions=computed, reused_partitions=reused,
        efb_partitions=tuple(passes["pass2"]), num_workers=cfg.num_workers, use_gpu=job.use_gpu, run_id=job.run_id,
        passes=summary["passes"],
    )


PASS_RECORD_KEYS = ("reduces", "allreduce_calls", "allreduce_bytes", "bytes_written", "checkpoints", "compute_s",
                    "data_wait_s", "reduce_s", "write_s", "wall_s", "computed", "reused", "source_bytes", "gc_freed")


def pass_records(report: Mapping[str, Any], names: Sequence[str] = ("pass1", "pass2", "subnet")) -> dict[str, Any]:
    """Per pass, the record of every rank (``PASS_RECORD_KEYS``) from a worker report
    (``{..., "ranks": [rank records]}``): what run.json shows."""
    out = {}
    for name in names:
        ranks = [r.get(name) for r in report.get("ranks", []) if isinstance(r.get(name), dict)]
        if ranks:
            out[name] = {"ranks": [{k: r.get(k) for k in PASS_RECORD_KEYS} for r in ranks]}
    return out


def _cfg_json(cfg: CurvatureConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["methods"] = list(cfg.methods)
    return json.loads(json.dumps(d, default=str))
