"""Memory: posterior sizes in the layout of Lee et al. (2020) Table 3, and peak RSS of the MC
predictive against laplace-torch's at several sample counts (CPU, float32).

    python benchmarks/memory.py [--rank 100] [--exact resnet18] [--exact-size 32]
                                [--rss-model resnet18] [--samples 10 30 100] [--size 64] [--batch 32]
                                [--skip-sizes] [--skip-rss] [--out memory.json]

**Sizes** (no data, no weights: torchvision models on the ``meta`` device, ImageNet heads with
1000 classes as in the paper) for resnet18/50/152 and densenet121/161: numbers stored and MB
(2^20 bytes at 4 bytes/number) for ``diag`` (``Σ mn``), ``kfac`` (``Σ n² + m²``), ``efb``
(``Σ n² + m² + mn``), counted by :mod:`laplace_core.posteriors.sizes` over the same Linear/Conv2d layers
(BatchNorm is a point estimate), and the ratio to ``diag``. INF at rank ``K`` stores
``|I| m + |J| n + |I||J| + mn`` per layer (``U_g``, ``U_a``, ``Λ_L``, ``D``), where ``I``/``J``
are the distinct rows/columns of the top-``K`` EFB eigenvalues (Algorithm 1): they depend on
data, so from shapes alone the count is an interval, both ends from the same exact formula:

* lower bound: :func:`laplace_core.posteriors.sizes.inf_lower_bound` (fewest rows/columns that can hold
  ``K`` entries, ``a b >= K``);
* upper bound: ``|I| = min(m, K)``, ``|J| = min(n, K)`` (``K`` entries touch at most ``K``
  rows and ``K`` columns).

``--exact MODEL`` also computes the exact INF count for ``MODEL`` (random init, 1000 classes)
from real EFB eigenvalues: statistics on ``--exact-batches`` random batches of
``--exact-batch`` images at ``--exact-size`` (pass 1 + eigh + EFB pass, then
:func:`laplace_core.posteriors.sizes.model_sizes` with ``stats``). It is exact for that data only.

**Peak RSS** of one MC predictive call on one batch (``--batch`` images at ``--size``,
``--rss-model`` with 10 classes, the setup of ``benchmarks/peers.py``) at each ``--samples``
count: ours (``MCPredictor(model, post, K).predict(x)``, KFAC and INF rank-100 posteriors fitted
once by the parent on ``--fit-batches`` batches and loaded from safetensors) and laplace-torch
(``KronLaplace`` fitted with ``CurvlinopsEF`` on the same batches, then
``la(x, pred_type="nn", link_approx="mc", n_samples=K)``). One subprocess per measurement;
``VmHWM`` from ``/proc/self/status`` is reset (``5 > /proc/self/clear_refs``) right before the
predictive call, so ``peak`` is the process's peak during the call and ``growth = peak − RSS
before the call`` is what the call itself adds (``ru_maxrss`` is not used: it survives
``execve`` and cannot be reset). laplace-torch draws all ``K`` weight vectors at once
(``K x P`` floats, several copies inside its Kronecker product), so a laplace-torch run whose
predicted growth (``3 K P × 4`` bytes) exceeds ``--max-gb`` is skipped and reported as such.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

SIZE_MODELS = ("resnet18", "resnet50", "resnet152", "densenet121", "densenet161")
# Lee et al. (2020) Table 3: numbers stored (Diag, KFAC, EFB, INF at rank 100).
PAPER_TABLE3 = {
    "resnet18": (11_679_912, 95_013_546, 106_693_458, 12_317_373),
    "resnet50": (25_503_912, 153_851_562, 179_355_474, 27_614_896),
    "resnet152": (60_041_384, 389_519_018, 449_560_402, 65_558_402),
    "densenet121": (7_895_208, 103_094_954, 110_990_162, 9_711_081),
    "densenet161": (28_461_064, 379_105_514, 407_566_578, 32_329_191),
}
RSS_KINDS = ("ours_kfac", "ours_inf", "laplace_kron")


# ------------------------------------------------------------------ sizes
def _meta_model(name: str, num_classes: int = 1000):
    import torch
    import torchvision

    with torch.device("meta"):
        return getattr(torchvision.models, name)(weights=None, num_classes=num_classes)


def inf_upper_bound(m: int, n: int, rank: int) -> int:
    """Largest possible INF count of an ``m x n`` layer at rank ``K``: ``|I| = min(m, K)``,
    ``|J| = min(n, K)`` in ``|I| m + |J| n + |I||J| + mn`` (``K`` taken as at most ``mn``)."""
    from laplace_core.posteriors.sizes import inf_count

    k = min(rank, m * n)
    return inf_count(m, n, min(m, k), min(n, k))


def size_rows(rank: int, exact: dict[str, int]) -> list[dict]:
    from laplace_core.posteriors.sizes import model_sizes

    rows = []
    for name in SIZE_MODELS:
        rep = model_sizes(_meta_model(name), rank=rank, name=name)
        tot = rep.totals
        upper = sum(inf_upper_bound(ls.m, ls.n, rank) for ls in rep.layers)
        rows.append({
            "model": name, "layers": len(rep.layers), "diag": tot["diag"], "kfac": tot["kfac"],
            "efb": tot["efb"], "inf_lower": rep.inf_lower_bound, "inf_upper": upper,
            "inf_exact": exact.get(name), "paper": PAPER_TABLE3[name],
        })
    return rows


def exact_inf(name: str, rank: int, size: int, batch: int, batches: int) -> dict:
    """Exact INF count of ``name`` (random init, 1000 classes) from EFB eigenvalues on random data."""
    import torch
    import torchvision

    from laplace_core.curvature.collect import collect_efb, collect_statistics
    from laplace_core.basis.eigenbasis import eigenbasis
    from laplace_core.posteriors.sizes import model_sizes

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None).eval()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 1000, (batch,), generator=g))
            for _ in range(batches)]
    t = time.perf_counter()
    stats = collect_statistics(model, data, fisher="empirical")
    basis = eigenbasis(stats)
    efb, cnt = collect_efb(model, data, basis, fisher="empirical")
    stats = stats.with_efb(efb, cnt)
    rep = model_sizes(model, rank=rank, stats=stats, name=name)
    return {"model": name, "inf": rep.totals["inf"], "seconds": time.perf_counter() - t,
            "data": f"{batches} x {batch} random images {size}x{size}, random labels, random init"}


def _mb(x: int) -> str:
    from laplace_core.posteriors.sizes import to_mb

    return f"{to_mb(x):,.1f}"


def format_sizes(rows: list[dict], rank: int) -> str:
    out = [f"| model | Diag numbers | MB | KFAC numbers | MB | x Diag | EFB numbers | MB | x Diag | "
           f"INF K={rank} numbers | MB | x Diag | INF exact (random data) | x Diag | paper INF x Diag |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        d = r["diag"]
        lo, hi = r["inf_lower"], r["inf_upper"]
        ex = r["inf_exact"]
        pd, _, _, pi = r["paper"]
        out.append(
            f"| {r['model']} | {d:,} | {_mb(d)} | {r['kfac']:,} | {_mb(r['kfac'])} | {r['kfac'] / d:.2f} | "
            f"{r['efb']:,} | {_mb(r['efb'])} | {r['efb'] / d:.2f} | {lo:,} – {hi:,} | "
            f"{_mb(lo)} – {_mb(hi)} | {lo / d:.3f} – {hi / d:.3f} | "
            f"{'—' if ex is None else f'{ex:,}'} | {'—' if ex is None else f'{ex / d:.3f}'} | {pi / pd:.3f} |")
    return "\n".join(out)


# ------------------------------------------------------------------ peak RSS of the predictive
def _rss_child(a) -> dict:
    import torch

    import peers

    warnings.filterwarnings("ignore")
    torch.set_num_threads(a.threads)
    model, batches = peers._setup(_SetupArgs(a.rss_model, a.size, a.batch, a.fit_batches))
    x = batches[0][0]
    if a.kind in ("ours_kfac", "ours_inf"):
        from laplace_core.posteriors.structures.base import load_posterior
        from laplace_core.predictive.monte_carlo import MCPredictor

        post = load_posterior(a.post)
        pred = lambda: MCPredictor(model, post, n_samples=a.samples, seed=0).predict(x)  # noqa: E731
    elif a.kind == "laplace_kron":
        from laplace import Laplace
        from laplace.curvature import CurvlinopsEF

        la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="kron",
                     backend=CurvlinopsEF)
        la.fit(peers.batches_loader(batches))
        pred = lambda: la(x, pred_type="nn", link_approx="mc", n_samples=a.samples)  # noqa: E731
    else:
        raise ValueError(f"unknown kind {a.kind!r}; valid: {', '.join(RSS_KINDS)}")
    before = _vm("VmRSS")
    peers._reset_peak()
    t = time.perf_counter()
    with torch.no_grad():
        p = pred()
    sec = time.perf_counter() - t
    assert torch.isfinite(p).all() and p.shape == (x.shape[0], 10)
    peak = peers.vm_hwm_mib()
    return {"kind": a.kind, "samples": a.samples, "rss_before_mib": before, "peak_mib": peak,
            "growth_mib": peak - before, "seconds": sec}


class _SetupArgs:
    def __init__(self, model, size, batch, batches):
        self.model, self.size, self.batch, self.batches = model, size, batch, batches


def _vm(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _mem_available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def _fit_posteriors(a, tmp: Path) -> tuple[dict[str, str], int]:
    import torch

    import peers
    from laplace_core.curvature.collect import collect_efb, collect_statistics
    from laplace_core.basis.eigenbasis import eigenbasis
    from laplace_core.posteriors.build import build_posterior

    torch.set_num_threads(a.threads)
    model, batches = peers._setup(_SetupArgs(a.rss_model, a.size, a.batch, a.fit_batches))
    stats = collect_statistics(model, batches, fisher="empirical")
    basis = eigenbasis(stats)
    efb, cnt = collect_efb(model, batches, basis, fisher="empirical")
    stats = stats.with_efb(efb, cnt)
    paths = {}
    for kind, meth, rank in (("ours_kfac", "kfac", None), ("ours_inf", "inf", a.rank)):
        post = build_posterior(stats, meth, rank=rank, basis=basis, dtype=torch.float32)
        paths[kind] = str(tmp / f"{meth}.post")
        post.save(paths[kind])
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return paths, n_params


def rss_runs(a) -> tuple[list[dict], int]:
    results = []
    with tempfile.TemporaryDirectory() as d:
        paths, n_params = _fit_posteriors(a, Path(d))
        for k in a.samples:  # interleaved by sample count
            for kind in RSS_KINDS:
                if kind == "laplace_kron":
                    need_gb = 3 * k * n_params * 4 / 2**30
                    if need_gb > a.max_gb:
                        results.append({"kind": kind, "samples": k, "skipped":
                                        f"predicted growth {need_gb:.1f} GB > --max-gb {a.max_gb}"})
                        print(f"skip {kind} K={k}", file=sys.stderr, flush=True)
                        continue
                cmd = [sys.executable, __file__, "--child", kind, "--samples-child", str(k),
                       "--rss-model", a.rss_model, "--size", str(a.size), "--batch", str(a.batch),
                       "--fit-batches", str(a.fit_batches), "--threads", str(a.threads)]
                if kind in paths:
                    cmd += ["--post", paths[kind]]
                r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                if r.returncode != 0:
                    res = {"kind": kind, "samples": k, "error": (r.stderr.strip().splitlines() or [f"rc {r.returncode}"])[-1]}
                else:
                    res = json.loads(r.stdout.strip().splitlines()[-1])
                results.append(res)
                print(f"{kind} K={k}: {res}", file=sys.stderr, flush=True)
    return results, n_params


def format_rss(results: list[dict]) -> str:
    out = ["| predictive | K samples | RSS before MiB | peak during call MiB | growth MiB | call s |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        if "peak_mib" in r:
            out.append(f"| {r['kind']} | {r['samples']} | {r['rss_before_mib']:.0f} | {r['peak_mib']:.0f} | "
                       f"{r['growth_mib']:.0f} | {r['seconds']:.1f} |")
        else:
            out.append(f"| {r['kind']} | {r['samples']} | — | — | {r.get('skipped', r.get('error'))} | — |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=100)
    ap.add_argument("--exact", nargs="*", default=[], help="models for the exact INF count (runs a fit)")
    ap.add_argument("--exact-size", type=int, default=32)
    ap.add_argument("--exact-batch", type=int, default=8)
    ap.add_argument("--exact-batches", type=int, default=1)
    ap.add_argument("--rss-model", default="resnet18")
    ap.add_argument("--samples", type=int, nargs="+", default=[10, 30, 100])
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--fit-batches", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-gb", type=float, default=8.0, help="skip laplace-torch runs predicted above this")
    ap.add_argument("--skip-sizes", action="store_true")
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--samples-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--post", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        a.kind, a.samples = a.child, a.samples_child
        print(json.dumps(_rss_child(a)))
        return 0
    res: dict = {"config": vars(a), "load_avg_start": os.getloadavg(), "mem_available_gb": _mem_available_gb()}
    if not a.skip_sizes:
        exact = {}
        for name in a.exact:
            e = exact_inf(name, a.rank, a.exact_size, a.exact_batch, a.exact_batches)
            res.setdefault("exact", []).append(e)
            exact[name] = e["inf"]
        rows = size_rows(a.rank, exact)
        res["sizes"] = rows
        print(f"\nPosterior sizes (Lee et al. 2020 Table 3 layout), 1000 classes, rank K={a.rank}; "
              "INF from shapes is [lower bound, upper bound] of the exact per-layer formula\n")
        print(format_sizes(rows, a.rank))
        for e in res.get("exact", []):
            print(f"\nexact INF count for {e['model']}: {e['inf']:,} ({e['data']})")
    if not a.skip_rss:
        results, n_params = rss_runs(a)
        res["rss"], res["rss_n_params"] = results, n_params
        print(f"\nPeak RSS of one MC predictive call, {a.rss_model} (10 classes, {n_params:,} weights under the "
              f"posterior), {a.batch} images {a.size}x{a.size}, {a.threads} threads\n")
        print(format_rss(results))
    res["load_avg_end"] = os.getloadavg()
    print(f"\nload average start {res['load_avg_start']}, end {res['load_avg_end']}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
