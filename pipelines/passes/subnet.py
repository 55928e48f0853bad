"""Subnetwork Laplace in the Ray job: selection on the driver, a distributed ``S x S`` Fisher pass.

Daxberger et al. (2021), §3-5, on top of the curvature stage (:mod:`pipelines.passes.curvature`):

1. **Selection** (driver, §5 eq. 23): the ``S`` weights of largest diagonal-Laplace
   marginal variance ``σ_d² = 1 / (N diag_d/M + τ)`` (the run's ``n_data`` /
   ``prior_precision`` convention), read from the reduced pass-1 statistics
   ``<output>/stats/reduced`` (:func:`laplace_core.posteriors.subnet.select_subnetwork`). ``S`` is
   capped at ``D_total`` (all curvature weights). Memory check up front: ``S²`` numbers
   of the Fisher's dtype must fit the budget, else a one-line ``ValueError`` naming the
   largest ``S`` that fits (:func:`laplace_core.curvature.subnet_fisher.check_subnet_memory`).
2. **Fisher** (a pass kind, :class:`pipelines.distributed.kinds.SubnetFisherKind`, on the
   partitioned-pass engine :mod:`pipelines.distributed` that runs the curvature passes too):
   every worker runs :func:`laplace_core.curvature.subnet_fisher.collect_subnet_fisher` on its shard of each
   partition into one local ``S x S`` matrix, ``F_sum = Σ_k d_{k,S} d_{k,S}^T``, plus the
   count; its upper triangle is SUM-all-reduced per checkpoint interval and at the end; rank 0
   writes ``<output>/stats/subnet/`` (``fisher_triu``: the upper triangle, ``mask/<layer>``,
   JSON meta with every rank's record of the pass; a :mod:`laplace_core.io` artifact, manifest
   last; :func:`load_subnet_fisher` returns the full symmetric matrix). Fisher types: ``"mc"``
   (labels drawn from ``(seed, image key, draw)`` exactly as pass 1 draws them, so 1 or N
   workers give the same sums, and on the same images ``diag(F_sum)`` equals pass 1's
   Fisher diagonal at the selected entries), ``"empirical"`` (true labels), ``"ggn"``
   (exact GGN ``Σ_k J_S^T (diag p − p p^T) J_S``, ``C`` backward passes per batch), and
   ``"auto"``: ``ggn`` when the class count is at most :data:`GGN_MAX_CLASSES`, else the
   curvature pass's Fisher type.
3. **Posterior** (the posterior stage, driver): ``P_S = N F_sum/count + τ (S / D_total) I``,
   built and saved by :func:`pipelines.passes.posterior.build_and_save` (``posterior/subnet/``).

The keyed MC labels come from ``collect_subnet_fisher``'s ``KeyedSampler`` branch: the
batches carry the image keys, the labels are drawn from the forward pass the backward
passes reuse (one forward per batch, ``mc_samples`` backward passes, weights
``1/mc_samples``).

Resume: the finished artifact is skipped when its fingerprint (model, partitions, Fisher
type, seed, dtypes, masks) matches. While the pass runs, the workers all-reduce their sums
after a partition once ``checkpoint_every_s`` seconds have passed since the last time
(``0``: after every partition; ``None``: only at the end), and rank 0 then saves the
running sum (upper triangle) with the finished partition ids, counts and skips under
``<output>/stats/subnet_partial/ckpt-<k>`` (``k`` = partitions done; manifest last, the
previous checkpoint removed only after the new one is committed). A restarted worker group
(``FailureConfig``) or a re-submitted job with the same fingerprint starts from the latest
checkpoint and computes only the other partitions; each worker still holds one ``S x S``
matrix (rank 0's carries the running sum, the others' are zeroed after each all-reduce).
A checkpoint that does not load or fails its SHA-256 check is reported in one line and
passed over (:func:`load_checkpoint`): its partitions are computed again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from laplace_core.io import load_tensors, save_tensors
from laplace_core.curvature.statistics import CurvatureStatistics
from laplace_core.curvature.subnet_fisher import DEFAULT_MEMORY_BUDGET, check_subnet_memory
from laplace_core.posteriors.subnet import SELECTION_RULES, select_subnetwork

from pipelines.distributed.progress import say
from pipelines.storage import uris as storage
from pipelines.storage.store import RunStore
from pipelines.config.schema import SUBNET_FISHER_TYPES, PosteriorSpec
from pipelines.config.settings import same_as
from pipelines.passes.curvature import CurvatureConfig, pass_records
from pipelines.distributed import (
    DTYPES,
    Job,
    PassRun,
    dataset_name,
    fingerprint,
    index_partitions,
    decode_cpus_that_fit,
    fit_interruptibly,
    make_trainer,
    trainer_cpus,
    model_ref,
    put_sources,
    unpack_symmetric,
    worker_setup,
)
from pipelines.distributed import checkpoint as ckpt
from pipelines.distributed.comm import pack_symmetric
from pipelines.storage import layout
from pipelines.distributed.kinds import SubnetFisherKind

__all__ = [
    "SUBNET_FISHERS",
    "GGN_MAX_CLASSES",
    "SUBNET_PASS_NO",
    "SubnetConfig",
    "SubnetResult",
    "resolve_subnet_fisher",
    "subnet_config",
    "subnet_uri",
    "subnet_partial_uri",
    "latest_checkpoint",
    "load_checkpoint",
    "select_masks",
    "save_subnet_fisher",
    "load_subnet_fisher",
    "run_subnet_pass",
]

SUBNET_FISHERS = SUBNET_FISHER_TYPES  # ("auto", "mc", "empirical", "ggn"), posterior.subnet_fisher
GGN_MAX_CLASSES = 10
"""``fisher="auto"`` takes the exact GGN (``C`` backward passes per batch) up to this many classes."""
SUBNET_PASS_NO = 3
"""Pass number of the subnet Fisher pass in log lines and ``FaultInjection(pass_no=3)``."""
FORMAT = "infoform.subnet_fisher"
PARTIAL_FORMAT = "infoform.subnet_fisher_partial"


def resolve_subnet_fisher(name: str, num_classes: int | None, curvature_fisher: str = "mc") -> str:
    """``"auto"`` -> ``"ggn"`` when ``num_classes <= GGN_MAX_CLASSES``, else ``curvature_fisher``;
    other names are checked and returned."""
    if name not in SUBNET_FISHERS:
        raise ValueError(f"unknown subnet fisher {name!r}; valid: {', '.join(SUBNET_FISHERS)}")
    if name != "auto":
        return name
    if num_classes is not None and int(num_classes) <= GGN_MAX_CLASSES:
        return "ggn"
    return curvature_fisher


def subnet_config(posterior_spec, curvature_fisher: str, num_classes: int | None) -> "SubnetConfig":
    """:class:`SubnetConfig` of a run from its :class:`pipelines.config.schema.PosteriorSpec`
    (``subnet_size``, ``subnet_fisher`` resolved, ``subnet_rule``, ``subnet_memory_gb``, ``n_data``,
    ``prior_precision``)."""
    p = posterior_spec
    return SubnetConfig(subnet_size=int(p.subnet_size),
                        fisher=resolve_subnet_fisher(p.subnet_fisher, num_classes, curvature_fisher),
                        rule=p.subnet_rule,
                        n_data=p.n_data, prior_precision=float(p.prior_precision),
                        memory_budget_bytes=int(p.subnet_memory_gb * 2**30),
                        checkpoint_every_s=p.subnet_checkpoint_s)


subnet_uri = layout.subnet_uri


subnet_partial_uri = layout.subnet_partial_uri


@dataclass(frozen=True)
class SubnetConfig:
    """Settings of the subnet pass (runtime settings come from the :class:`CurvatureConfig`).

    ``subnet_size``: ``S`` (capped at ``D_total``). ``fisher``: ``mc``/``empirical``/``ggn``
    (resolve ``auto`` first with :func:`resolve_subnet_fisher`). ``n_data`` /
    ``prior_precision``: the diagonal-Laplace convention of the selection
    (``N`` default ``M``). ``memory_budget_bytes``: for one ``S x S`` matrix in ``dtype``.
    ``checkpoint_every_s``: seconds between saves of the running sum (module docstring;
    ``0``: after every partition, ``None``: never).
    """

    subnet_size: int
    fisher: str = "mc"
    rule: str = "wasserstein"
    n_data: float | None = same_as(PosteriorSpec, "n_data")
    prior_precision: float = same_as(PosteriorSpec, "prior_precision")
    selection_seed: int = 0
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET
    dtype: str = "float64"
    checkpoint_every_s: float | None = 600.0

    def __post_init__(self):
        if self.checkpoint_every_s is not None and not float(self.checkpoint_every_s) >= 0:
            raise ValueError(f"checkpoint_every_s must be >= 0 or None, got {self.checkpoint_every_s!r}")
        if isinstance(self.subnet_size, bool) or not isinstance(self.subnet_size, int) or self.subnet_size < 1:
            raise ValueError(f"subnet_size must be a positive int, got {self.subnet_size!r}")
        if self.fisher not in SUBNET_FISHERS or self.fisher == "auto":
            raise ValueError(f"subnet fisher must be one of mc, empirical, ggn (resolve 'auto' first), got {self.fisher!r}")
        if self.rule not in SELECTION_RULES:
            raise ValueError(f"unknown subnetwork selection rule {self.rule!r}; valid: {', '.join(SELECTION_RULES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown subnet dtype {self.dtype!r}; valid: {', '.join(DTYPES)}")
        if self.memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be > 0, got {self.memory_budget_bytes}")


@dataclass(frozen=True)
class SubnetResult:
    """``uri`` of the artifact; ``subnet_size`` (after the cap) of ``d_total`` weights;
    ``count`` examples in the sum; ``computed`` (False: a matching artifact was reused);
    timings and all-reduce payload of this run (zero when reused); ``per_layer``: selected
    weights per layer; ``zero_fisher``: selected weights whose pass-1 Fisher diagonal is 0
    (dead units, Daxberger et al. §6.3: prior variance, the largest, but no effect on the
    training data's predictions). ``computed_partitions`` / ``reused_partitions``: the
    partitions this run computed and those it took from a checkpoint (both empty when the
    artifact was reused). ``passes``: ``{"subnet": {"ranks": [...]}}``, every rank's record of the
    pass (reduces, all-reduce bytes, bytes written, seconds in compute, data wait, reduce, write)."""

    uri: str
    subnet_size: int
    d_total: int
    count: int
    fisher: str
    computed: bool
    fit_s: float
    allreduce_s: float
    allreduce_bytes: int
    rows: int
    skipped: dict[str, Any]
    per_layer: dict[str, int]
    zero_fisher: int = 0
    computed_partitions: tuple[int, ...] = ()
    reused_partitions: tuple[int, ...] = ()
    passes: dict[str, Any] = dataclasses.field(default_factory=dict)


# =========================================================================== selection + I/O
def select_masks(stats: CurvatureStatistics, scfg: SubnetConfig) -> tuple[dict[str, torch.Tensor], int, int]:
    """``(masks, S, D_total)``: Wasserstein (or random) selection from the reduced statistics,
    ``S = min(subnet_size, D_total)``, after the memory check (one-line ``ValueError``)."""
    D = int(sum(info.shape[0] * info.shape[1] for info in stats.infos.values()))
    if D == 0:
        raise ValueError("no curvature layers to select a subnetwork from")
    S = min(int(scfg.subnet_size), D)
    check_subnet_memory(S, scfg.memory_budget_bytes, DTYPES[scfg.dtype])
    masks = select_subnetwork(stats, S, rule=scfg.rule, prior_precision=scfg.prior_precision, n_data=scfg.n_data,
                              seed=scfg.selection_seed)
    return {k: v.cpu() for k, v in masks.items()}, S, D


def _masks_digest(masks: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k, mk in masks.items():
        h.update(k.encode())
        h.update(repr(tuple(mk.shape)).encode())
        h.update(mk.to(torch.uint8).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def save_subnet_fisher(uri: str, fisher_sum: torch.Tensor, count: int, masks: Mapping[str, torch.Tensor],
                       meta: Mapping[str, Any], store: RunStore) -> None:
    """``<uri>/`` artifact: ``fisher_triu`` (the upper triangle of the symmetric ``S x S`` sum,
    row by row), ``mask/<layer>`` (bool ``m x n``, model order)."""
    tensors = {"fisher_triu": pack_symmetric(fisher_sum.detach()).cpu().contiguous()}
    for k, mk in masks.items():
        tensors[f"mask/{k}"] = mk.detach().cpu().contiguous()
    save_tensors(uri, tensors, {**meta, "format": FORMAT, "version": 1, "count": int(count), "names": list(masks)},
                 store.fsspec_options(uri))


def load_subnet_fisher(uri: str, store: RunStore = RunStore()
                       ) -> tuple[torch.Tensor, int, dict[str, torch.Tensor], dict[str, Any]]:
    """``(fisher_sum, count, masks, meta)`` from :func:`save_subnet_fisher` (``fisher_sum`` the full,
    exactly symmetric ``S x S`` matrix; masks in model order)."""
    tensors, meta = load_tensors(uri, store.fsspec_options(uri))
    if meta.get("format") != FORMAT:
        raise ValueError(f"{uri}: not a subnet Fisher artifact (format {meta.get('format')!r})")
    masks = {k: tensors[f"mask/{k}"].to(torch.bool) for k in meta["names"]}
    return unpack_symmetric(tensors["fisher_triu"], int(meta["subnet_size"])), int(meta["count"]), masks, meta


# =========================================================================== worker side
def latest_checkpoint(base_uri: str, fingerprint: str, store: RunStore = RunStore()
                      ) -> tuple[str, dict[str, Any]] | None:
    """``(uri, meta)`` of the checkpoint under ``base_uri`` (:func:`subnet_partial_uri`) with
    the most finished partitions whose manifest is committed and whose fingerprint is
    ``fingerprint``; ``None`` when there is none. Checkpoints of another fingerprint (a
    different model, data or selection) are never used."""
    found = ckpt.list_checkpoints(base_uri, fingerprint, store, PARTIAL_FORMAT, tag="subnet")
    return found[0] if found else None


def load_checkpoint(base_uri: str, fingerprint: str, store: RunStore = RunStore()
                    ) -> tuple[str, dict[str, Any], torch.Tensor] | None:
    """``(uri, meta, fisher_sum)`` (the full symmetric ``S x S`` running sum) of the most
    advanced checkpoint that loads and passes its SHA-256 check. A corrupted or truncated one
    is reported in one line and passed over, so its partitions are computed again instead of
    failing the pass; ``None`` when no checkpoint is usable."""
    found = ckpt.load_checkpoint(base_uri, fingerprint, store, PARTIAL_FORMAT, tag="subnet")
    if found is None:
        return None
    uri, meta, tensors = found
    packed = tensors["fisher_triu"]
    size = int(round(((8 * packed.numel() + 1) ** 0.5 - 1) / 2))
    return uri, meta, unpack_symmetric(packed, size)


def _subnet_loop(config: dict) -> None:
    """``train_loop_per_worker``: the subnet Fisher pass on the engine (resume from the newest
    checkpoint, local ``S x S`` sums, all-reduce and checkpoint every ``checkpoint_every_s``),
    then rank 0 writes the artifact and removes the checkpoints."""
    import torch.distributed as dist

    from pipelines.ingest.models import load_model

    job: Job = config["job"]
    scfg: SubnetConfig = config["subnet"]
    masks: dict[str, torch.Tensor] = config["masks"]
    meta: dict[str, Any] = config["meta"]
    partial: str = config["partial_uri"]
    cfg = job.cfg
    rank, world, device = worker_setup(job)
    S = int(meta["subnet_size"])
    kind = SubnetFisherKind(cfg, S, masks, scfg.fisher, scfg.dtype, scfg.memory_budget_bytes)
    run = PassRun(kind, job, rank, world, device, partial).start()
    if rank == 0 and run.rec["reused"]:
        say(f"[subnet] resuming from {run.rec['resumed_from']}: {len(run.rec['reused'])} partition(s) done, "
              f"{len(run.todo)} to compute")
    model = load_model(job.model.name, job.model.weights, job.model.num_classes, options=job.store.options)
    kind.bind(model.to(device=device, dtype=DTYPES[cfg.model_dtype]).eval())
    res = run.run(scfg.checkpoint_every_s)
    count = res.counts["count"]
    if count <= 0:
        raise RuntimeError("subnet pass: no valid image in any partition")
    recs = [None] * world
    dist.all_gather_object(recs, res.record)
    if rank == 0:
        r = res.record
        save_subnet_fisher(config["uri"], res.state, count, masks, {
            **meta, "rows": res.rows, "invalid_rows": res.invalid, "skipped": res.skipped.to_dict(),
            "world_size": world, "collect_s": r["compute_s"], "allreduce_s": r["allreduce_s"],
            "allreduce_bytes": r["allreduce_bytes"], "allreduce_calls": r["allreduce_calls"],
            "checkpoint_s": r["write_s"], "checkpoints": r["checkpoints"], "ranks": recs,
            "written_at": time.time(), "computed_partitions": r["computed"], "reused_partitions": r["reused"],
        }, job.store)
        job.store.remove(partial, recursive=True)
        say(f"[subnet] S = {S}: Fisher over {count} examples written ({res.rows} rows, "
              f"{res.invalid} invalid)")
    dist.barrier()


# =========================================================================== driver side
def run_subnet_pass(
    model_spec,
    partitions: Sequence[Any],
    cfg: CurvatureConfig,
    scfg: SubnetConfig,
    store: RunStore,
    *,
    data_config=None,
    stats: CurvatureStatistics | None = None,
    run_name: str | None = None,
) -> SubnetResult:
    """Select the subnetwork from ``stats`` (default: ``<output>/stats/reduced``), check
    memory, and compute the all-reduced ``S x S`` Fisher on ``cfg.num_workers`` Ray Train
    workers over ``partitions`` (as :func:`pipelines.passes.curvature.run_curvature` takes them;
    ``store``: the run's store, which travels to every worker as is;
    runtime settings, ``seed``, ``mc_samples``, ``model_dtype`` from ``cfg``). Writes
    ``<output>/stats/subnet/``; reuses it when its fingerprint matches. Ray must be
    initialised (or this calls ``ray.init()``)."""
    import ray

    if not isinstance(cfg, CurvatureConfig) or not isinstance(scfg, SubnetConfig):
        raise ValueError("run_subnet_pass needs a CurvatureConfig and a SubnetConfig")
    if not partitions:
        raise ValueError("run_subnet_pass needs at least one data partition")
    output_uri = store.output
    if stats is None:
        stats = CurvatureStatistics.load(store.reduced_uri(), store.fsspec_options(output_uri))
    masks, S, D = select_masks(stats, scfg)
    model = model_ref(model_spec)
    ids, by_id, rows = index_partitions(partitions)
    meta = _subnet_meta(stats, masks, S, D, cfg, scfg)
    meta["fingerprint"] = fp = fingerprint({
        "model": dataclasses.asdict(model), "partitions": ids, "rows": [rows[p] for p in ids],
        "data": [getattr(by_id[p], "fingerprint", None) for p in ids], "masks": _masks_digest(masks),
        **{k: meta[k] for k in ("fisher", "mc_samples", "seed", "dtype", "model_dtype")},
    })
    uri = subnet_uri(output_uri)
    old = store.read_json(storage.join(uri, ckpt.MANIFEST)).get("meta", {}) \
        if store.exists(storage.join(uri, ckpt.MANIFEST)) else {}
    if old.get("format") == FORMAT and old.get("fingerprint") == fp:
        say(f"[subnet] {uri}: done earlier (same fingerprint), reused")
        return _result(uri, meta, old, scfg, computed=False, fit_s=0.0)

    if not ray.is_initialized():
        ray.init()
    use_gpu = cfg.use_gpu if cfg.use_gpu is not None else ray.cluster_resources().get("GPU", 0) > 0
    run_id = run_name or f"subnet-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    partial = subnet_partial_uri(output_uri)
    found = ckpt.load_checkpoint(partial, fp, store, PARTIAL_FORMAT, tag="subnet")
    done = set(found[1]["done"]) if found is not None else set()
    del found
    data_config = decode_cpus_that_fit(cfg, data_config, "subnet")
    sources, ready = put_sources(by_id, ids, data_config, cfg.num_workers)  # index partitions: read by the ranks when reached
    datasets = {dataset_name(SubnetFisherKind.name, pid): ready[pid] for pid in ids if pid in ready and pid not in done}
    job = Job(model=model, cfg=cfg, store=store, passes={SubnetFisherKind.name: tuple(ids)},
              rows=rows, run_id=run_id, use_gpu=bool(use_gpu), fingerprint=fp, sources=sources)
    trainer = make_trainer(_subnet_loop, {"job": job, "subnet": scfg, "masks": masks, "meta": meta, "uri": uri,
                                          "partial_uri": partial},
                            cfg, bool(use_gpu), run_id, output_uri, datasets)
    say(f"[subnet] S = {S} of {D} weights ({scfg.rule}), {scfg.fisher} Fisher on {cfg.num_workers} worker(s)")
    t0 = time.perf_counter()
    fit_interruptibly(trainer, trainer_cpus(cfg, data_config), "subnet")
    fit_s = time.perf_counter() - t0
    written = store.read_json(storage.join(uri, ckpt.MANIFEST))["meta"]
    return _result(uri, meta, written, scfg, computed=True, fit_s=fit_s)


def _subnet_meta(stats: CurvatureStatistics, masks: Mapping[str, torch.Tensor], S: int, D: int,
                 cfg: CurvatureConfig, scfg: SubnetConfig) -> dict[str, Any]:
    """The artifact's metadata of a selection (without its fingerprint); dead selected weights said in one line."""
    meta = {
        "subnet_size": S, "requested_size": int(scfg.subnet_size), "d_total": D, "fisher": scfg.fisher,
        "mc_samples": cfg.mc_samples if scfg.fisher == "mc" else 1, "seed": cfg.seed, "rule": scfg.rule,
        "n_data": scfg.n_data, "prior_precision": scfg.prior_precision, "dtype": scfg.dtype,
        "model_dtype": cfg.model_dtype, "per_layer": {k: int(mk.sum()) for k, mk in masks.items()},
        "zero_fisher": int(sum(int((stats.layers[k].diag[mk.to(stats.layers[k].diag.device)] == 0).sum())
                               for k, mk in masks.items())),
    }
    if meta["zero_fisher"]:
        say(f"[subnet] note: {meta['zero_fisher']} of the S = {S} selected weights have a zero Fisher diagonal "
              "(dead units: prior variance, no effect on the training data's predictions; Daxberger et al. §6.3)")
        if scfg.rule == "wasserstein":
            say("[subnet] hint: --set posterior.subnet_rule=wasserstein_live ranks only weights with a live "
                  "Fisher diagonal")
    return meta


def _result(uri: str, meta: Mapping[str, Any], written: Mapping[str, Any], scfg: SubnetConfig, *,
            computed: bool, fit_s: float) -> SubnetResult:
    """The :class:`SubnetResult` of the artifact at ``uri`` (``written``: its manifest's metadata);
    an artifact reused from before reports no collection (no all-reduce, no partitions)."""
    common = dict(uri=uri, subnet_size=meta["subnet_size"], d_total=meta["d_total"], count=int(written["count"]),
                  fisher=scfg.fisher, computed=computed, fit_s=fit_s, rows=int(written.get("rows", 0)),
                  skipped=written.get("skipped", {}), per_layer=meta["per_layer"], zero_fisher=meta["zero_fisher"])
    if not computed:
        return SubnetResult(**common, allreduce_s=0.0, allreduce_bytes=0)
    return SubnetResult(**common, allreduce_s=float(written.get("allreduce_s", 0.0)),
                        allreduce_bytes=int(written.get("allreduce_bytes", 0)),
                        computed_partitions=tuple(written.get("computed_partitions", ())),
                        reused_partitions=tuple(written.get("reused_partitions", ())),
                        passes=pass_records({"ranks": [{"subnet": r} for r in written.get("ranks", [])]}))
