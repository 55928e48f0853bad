"""The measurements of ``benchmarks/gpu_check.py`` (one function per phase; the script runs them
in order under a time budget and writes one JSON).

* :func:`precision_check` (e): pass 1 and the EFB pass in fp32 with TF32 off (the reference),
  then in every other precision, on the same batches, empirical Fisher (both runs differentiate
  the same labels), the EFB pass in the reference's eigenbasis; per layer the scale-normalised
  error ``||X - X_ref||_F / ||X_ref||_F`` of ``A``, ``G``, ``diag`` and ``efb`` (the EFB
  eigenvalues). Bound: :data:`BF16_CHECK_RTOL` (docs/design.md §1, "Precision").
* :func:`time_passes` (b): pass 1 and the EFB pass as the Ray workers run them
  (``pipelines.distributed.kinds``: MC Fisher with keyed labels, float64 sums, channels-last
  convolutions under a half precision on a GPU), one configuration after another.
* :func:`time_kronfluence` (c): kronfluence 1.0.1's covariance and lambda passes (its own
  functions, ``all_low_precision_factor_arguments(bf16)``: what its ImageNet example's
  ``--use_half_precision`` runs), nothing written to disk.
* :func:`time_mc_forward` (d): the evaluation actors' MC predictive (``make_predictor`` +
  ``predict_chunk_stats`` on fixed-size chunks) with ``K`` draws of an INF posterior, fp32 and
  bf16 (``in_precision``), beside ``K`` plain forwards.

Timing: each pass reads one synthetic batch (already on the device) ``n`` times through
:class:`TimedBatches`, which synchronises the device and takes a timestamp before each yield;
throughput = images over the yield-to-yield intervals after the warm-up batches (steady state:
neither setup nor the final flush is in it; the whole call's ``wall_s`` is reported beside it).
Peak memory: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (model,
batch, sums, workspace).
"""
from __future__ import annotations

import contextlib
import copy
import statistics
import time
from typing import Any, Callable

import torch

from laplace_core.basis.eigenbasis import eigenbasis
from laplace_core.curvature.collect import collect_efb, collect_statistics
from laplace_core.curvature.keyed_rng import KeyedSampler

#: Bound on the scale-normalised error of bf16's A, G, diag and EFB sums against fp32 (TF32 off),
#: per layer, worst layer: docs/design.md §1 "Precision" gives the reasoning.
BF16_CHECK_RTOL = 0.05
#: The precision configurations: (autocast precision, TF32 for matmuls, TF32 for cuDNN convs).
#: ``fp32_strict`` is the check's reference; ``fp32_default`` is torch's default (what the
#: pipeline runs today: cuDNN TF32 on, matmul TF32 off); ``fp32_tf32`` turns matmul TF32 on too.
CONFIGS: dict[str, tuple[str, bool, bool]] = {
    "fp32_strict": ("fp32", False, False),
    "fp32_default": ("fp32", False, True),
    "fp32_tf32": ("fp32", True, True),
    "bf16": ("bf16", False, True),
    "bf16_tf32": ("bf16", True, True),
}
MIB = 2**20


def syncer(dev: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)


@contextlib.contextmanager
def tf32(matmul: bool, cudnn: bool):
    """TF32 flags set for the block, restored after."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def pass_options(config: str, model: torch.nn.Module) -> dict[str, Any]:
    """``precision`` and ``channels_last`` as the workers set them (``pipelines.distributed.kinds``:
    channels-last under a half precision on a GPU for models with convolutions)."""
    precision = CONFIGS[config][0]
    conv = any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    on_gpu = next(model.parameters()).device.type == "cuda"
    return {"precision": precision, "channels_last": precision != "fp32" and conv and on_gpu}


class TimedBatches:
    """``x, y`` (and per-example keys) ``n`` times; a timestamp after a device sync before each
    yield. Stops early, after at least ``min_n`` batches, once ``deadline`` (perf_counter) passed."""

    def __init__(self, x, y, n: int, sync, *, keys: bool = True, min_n: int = 3, deadline: float | None = None):
        self.x, self.y, self.n, self.sync, self.keys = x, y, n, sync, keys
        self.min_n, self.deadline = min_n, deadline
        self.stamps: list[float] = []

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        self.stamps = []
        b = self.x.shape[0]
        for i in range(self.n):
            self.sync()
            self.stamps.append(time.perf_counter())
            if self.deadline is not None and i >= self.min_n and self.stamps[-1] > self.deadline:
                return
            if self.keys:
                yield self.x, self.y, torch.arange(i * b, (i + 1) * b, device=self.x.device)
            else:
                yield self.x, self.y


def measure(run: Callable[[TimedBatches], Any], batches: TimedBatches, warmup: int) -> tuple[dict, Any]:
    """Run ``run(batches)``; throughput over the intervals between yields after ``warmup``."""
    dev = batches.x.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    out = run(batches)
    batches.sync()
    wall = time.perf_counter() - t0
    iv = [b - a for a, b in zip(batches.stamps[warmup:], batches.stamps[warmup + 1:])]
    size = int(batches.x.shape[0])
    rec = {"batch": size, "measured_batches": len(iv), "wall_s": round(wall, 4),
           "img_per_s": round(size * len(iv) / sum(iv), 1) if iv else None,
           "batch_s_median": round(statistics.median(iv), 5) if iv else None,
           "peak_mem_mib": round(torch.cuda.max_memory_allocated(dev) / MIB, 1) if dev.type == "cuda" else None}
    return rec, out


# --------------------------------------------------------------------------- (e) precision check
def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    return float((a - ref).norm() / ref.norm().clamp_min(1e-300))


def _stats_pair(model, batches, config: str, basis=None):
    prec, mm, cudnn = CONFIGS[config]
    opts = pass_options(config, model)
    with tf32(mm, cudnn):
        stats = collect_statistics(model, batches, fisher="empirical", **opts)
        efb = collect_efb(model, batches, basis, fisher="empirical", **opts)[0] if basis is not None else None
    return stats, efb


def precision_check(model, batches, configs, rtol: float = BF16_CHECK_RTOL) -> dict:
    """Errors of every config's A, G, diag, efb against ``fp32_strict``; ``ok`` when bf16's
    worst layer is within ``rtol`` (the other configs are reported, not bounded)."""
    ref, _ = _stats_pair(model, batches, "fp32_strict")
    basis = eigenbasis(ref)
    _, efb_ref = _stats_pair(model, batches, "fp32_strict", basis)
    out: dict[str, Any] = {"reference": "fp32_strict", "rtol": rtol, "layers": len(ref.layers),
                           "images": int(ref.count), "errors": {}}
    for config in configs:
        if config == "fp32_strict":
            continue
        stats, efb = _stats_pair(model, batches, config, basis)
        errs = {f: [_rel(getattr(stats.layers[k], f), getattr(ls, f)) for k, ls in ref.layers.items()]
                for f in ("A", "G", "diag")}
        errs["efb"] = [_rel(efb[k], efb_ref[k]) for k in efb_ref]
        worst = {f: max(v) for f, v in errs.items()}
        out["errors"][config] = {"worst": worst, "median": {f: statistics.median(v) for f, v in errs.items()},
                                 "worst_layer": {f: list(ref.layers)[v.index(max(v))] if f != "efb" else
                                                 list(efb_ref)[v.index(max(v))] for f, v in errs.items()}}
    bf16 = out["errors"].get("bf16")
    out["ok"] = bool(bf16 and max(bf16["worst"].values()) <= rtol and max(bf16["worst"].values()) > 0)
    return out, ref.with_efb(efb_ref, int(ref.count)), basis


# --------------------------------------------------------------------------- (b) our passes
def time_passes(model, x, y, basis, configs, n: int, warmup: int, deadline: float) -> dict:
    """Pass 1 and the EFB pass per config, as the workers run them (MC Fisher, keyed labels)."""
    sync = syncer(x.device)
    out = {}
    for config in configs:
        prec, mm, cudnn = CONFIGS[config]
        opts = pass_options(config, model)
        rec = {"precision": prec, "tf32_matmul": mm, "tf32_cudnn": cudnn, **opts}
        with tf32(mm, cudnn):
            tb = TimedBatches(x, y, n, sync, deadline=deadline)
            rec["pass1"], _ = measure(lambda b: collect_statistics(model, b, generator=KeyedSampler(0), **opts), tb,
                                      warmup)
            tb = TimedBatches(x, y, n, sync, deadline=deadline)
            rec["efb"], _ = measure(lambda b: collect_efb(model, b, basis, generator=KeyedSampler(1), **opts), tb,
                                    warmup)
        out[config] = rec
    return out


# --------------------------------------------------------------------------- (c) kronfluence
def time_kronfluence(model, x, y, n: int, warmup: int, deadline: float) -> dict:
    """kronfluence's bf16 covariance pass, its eigendecomposition (float64, untimed against
    ours: reported) and its bf16 lambda pass on a copy of ``model``; MC labels (its default)."""
    import kronfluence
    from kronfluence.analyzer import prepare_model
    from kronfluence.factor.covariance import fit_covariance_matrices_with_loader
    from kronfluence.factor.eigen import fit_lambda_matrices_with_loader, perform_eigendecomposition
    from kronfluence.utils.common.factor_arguments import all_low_precision_factor_arguments
    from kronfluence.utils.state import State

    from benchmarks.peers_kronfluence import kronfluence_task

    dev = x.device
    task = kronfluence_task()
    peer = prepare_model(copy.deepcopy(model), task).to(dev)
    State._shared_state.clear()  # a fresh State on this device (it is a process-wide singleton)
    state = State(cpu=dev.type == "cpu")
    args = all_low_precision_factor_arguments(strategy="ekfac", dtype=torch.bfloat16)
    sync = syncer(dev)
    out = {"version": getattr(kronfluence, "__version__", "?"), "factor_args": "all_low_precision_factor_arguments"
           "(ekfac, bf16)", "device": str(state.device)}
    tb = TimedBatches(x, y, n, sync, keys=False, deadline=deadline)
    out["covariance"], (_, cov) = measure(
        lambda b: fit_covariance_matrices_with_loader(peer, state, task, b, args, disable_tqdm=True), tb, warmup)
    t0 = time.perf_counter()
    eig = perform_eigendecomposition(cov, peer, state, args, disable_tqdm=True)
    sync()
    out["eigendecomposition_s"] = round(time.perf_counter() - t0, 3)
    tb = TimedBatches(x, y, n, sync, keys=False, deadline=deadline)
    out["lambda"], _ = measure(
        lambda b: fit_lambda_matrices_with_loader(peer, state, task, b, args, eig, disable_tqdm=True), tb, warmup)
    return out


# --------------------------------------------------------------------------- (d) MC forward
def time_mc_forward(model, stats, basis, x, mc: int, batch: int, repeats: int, precisions=("fp32", "bf16")) -> dict:
    """The actors' MC predictive of an INF posterior (rank 100) over ``x`` (one chunk), per
    precision, best of ``repeats``; beside it ``mc`` plain fp32 forwards of the same batches."""
    from laplace_core.posteriors.build import build_posterior
    from pipelines.evaluation.chunks import iter_chunks
    from pipelines.evaluation.predictors import in_precision, make_predictor, predict_chunk_stats
    from pipelines.evaluation.runtime import EvalConfig

    dev = x.device
    sync = syncer(dev)
    rank = 100  # the ImageNet preset's posterior.rank
    post = build_posterior(stats, "inf", rank=rank, prior_precision=1e4, basis=basis)
    cfg = EvalConfig(mc_samples=mc, batch_size=batch, chunk_size=x.shape[0], seed=0, device=str(dev))
    chunk = next(iter(iter_chunks([(x, torch.zeros(x.shape[0], dtype=torch.long))], batch, cfg.batches_per_chunk,
                                  device=dev)))
    n_img = int(chunk.count)
    out: dict[str, Any] = {"method": "inf", "rank": rank, "K": mc, "images": n_img, "batch": batch}

    def best(fn) -> float:
        ts = []
        for _ in range(repeats + 1):  # the first is a warm-up
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        return min(ts[1:])

    def plain():
        with torch.no_grad():
            for _ in range(mc):
                for xb in chunk.xs:
                    model(xb)

    out["plain_fp32"] = _mc_rec(best(plain), n_img, mc, dev)
    for prec in precisions:
        m = in_precision(copy.deepcopy(model), prec)
        pred = make_predictor(m, post.to(dev), "nn", mc, 0, int(cfg.sample_cache_mb * MIB))
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        out[prec] = _mc_rec(best(lambda: predict_chunk_stats(m, pred, chunk)), n_img, mc, dev)
    return out


def _mc_rec(seconds: float, n_img: int, mc: int, dev) -> dict:
    return {"seconds": round(seconds, 4), "img_per_s": round(n_img / seconds, 1),
            "forwards_per_s": round(n_img * mc / seconds, 1),
            "peak_mem_mib": round(torch.cuda.max_memory_allocated(dev) / MIB, 1) if dev.type == "cuda" else None}


def make_data(classes: int, size: int, batch: int, dev, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, size, size, generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)
    return x.to(dev), y.to(dev)


__all__ = ["BF16_CHECK_RTOL", "CONFIGS", "TimedBatches", "measure", "precision_check",
           "time_passes", "time_kronfluence", "time_mc_forward", "make_data", "syncer", "tf32", "pass_options"]
