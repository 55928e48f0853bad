"""Overhead of Monte-Carlo evaluation over plain forward passes, per posterior method.

    ratio(method) = best time of the MC evaluation with K_mc samples over a fixed set
                    (pipelines.evaluation.evaluate.evaluate_shard: draw θ_t, set weights, forward,
                    float64 sums, metric updates)
                  / best time of K_mc plain forward passes of the MAP model over the same set,
                    measured right before and after it (interleaved; the machine may be shared)

Target (issue): ratio <= 1.15 for INF. Runs in one process on CPU, no Ray (the actors
run exactly ``evaluate_shard``). The posteriors are built from a short curvature pass
on random images (the timing does not depend on the data); the set is random images.

    python benchmarks/eval_overhead.py                       # resnet18 at 64x64
    python benchmarks/eval_overhead.py --model demo_cnn --size 32
    python benchmarks/eval_overhead.py --model resnet50 --size 224 --num-classes 1000 --device cuda
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import laplace_core as lc  # noqa: E402
from pipelines.evaluation.evaluate import evaluate_shard  # noqa: E402
from pipelines.evaluation.runtime import EvalConfig  # noqa: E402
from pipelines.ingest.models import load_model  # noqa: E402


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--num-classes", type=int, default=10)
    ap.add_argument("--size", type=int, default=64, help="image side (pixels)")
    ap.add_argument("--n-images", type=int, default=128, help="images in the fixed evaluation set")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--mc-samples", type=int, default=30)
    ap.add_argument("--methods", default="diag,kfac,efb,inf")
    ap.add_argument("--rank", type=int, default=100, help="INF top-K per layer")
    ap.add_argument("--stats-images", type=int, default=16, help="images for the curvature pass")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=3, help="best of this many (interleaved) timings")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (model, posteriors and draws there)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = [m for m in args.methods.split(",") if m]

    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    model = load_model(args.model, None, args.num_classes).to(dev)
    xs = torch.randn(args.stats_images, 3, args.size, args.size, generator=g).to(dev)
    t0 = time.perf_counter()
    batches = [(xs[i:i + 8], None) for i in range(0, len(xs), 8)]
    stats = lc.collect_statistics(model, batches, fisher="mc", generator=torch.Generator(dev).manual_seed(1))
    _log(f"curvature pass {time.perf_counter() - t0:.1f} s")
    basis = lc.eigenbasis(stats)
    _log(f"eigenbasis {time.perf_counter() - t0:.1f} s")
    if any(m in ("efb", "inf") for m in methods):
        stats = lc.collect_statistics(model, batches, fisher="mc", generator=torch.Generator(dev).manual_seed(1),
                                      basis=basis)
        _log(f"EFB pass {time.perf_counter() - t0:.1f} s")
    # τ large enough that the weights stay sensible; the timing does not depend on (N, τ)
    posts = {m: lc.build_posterior(stats, m, rank=args.rank if m == "inf" else None, prior_precision=1e4,
                                   basis=basis) for m in methods}
    setup_s = time.perf_counter() - t0

    x = torch.randn(args.n_images, 3, args.size, args.size, generator=g)
    y = torch.randint(0, args.num_classes, (args.n_images,), generator=g)
    data = [(x[i:i + args.batch_size], y[i:i + args.batch_size]) for i in range(0, args.n_images, args.batch_size)]
    # one chunk = the whole set: each θ_t is drawn once (as an actor does for a chunk)
    cfg = EvalConfig(mc_samples=args.mc_samples, batch_size=args.batch_size, chunk_size=args.n_images, seed=0,
                     device=args.device)

    def plain() -> float:
        fixed = [torch.cat([b, b.new_zeros(args.batch_size - b.shape[0], *b.shape[1:])]).to(dev) for b, _ in data]
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            for _ in range(args.mc_samples):
                for b in fixed:
                    model(b)
        sync()
        return time.perf_counter() - t

    def mc(method: str) -> float:
        _, info = evaluate_shard(model, {method: posts[method]}, data, None, cfg)
        if info["failed"]:
            raise RuntimeError(f"{method}: {info['failed']}")
        return info["seconds"][method]

    # Interleaved, best of ``repeats``: the machine may be shared, so every method's MC timing
    # is paired with plain timings taken right next to it.
    plain()  # warm-up
    mc(methods[0])
    best_plain = {m: math.inf for m in methods}
    best_mc = {m: math.inf for m in methods}
    for r in range(args.repeats):
        for m in methods:
            best_plain[m] = min(best_plain[m], plain())
            best_mc[m] = min(best_mc[m], mc(m))
            best_plain[m] = min(best_plain[m], plain())
            _log(f"repeat {r}: {m} mc {best_mc[m]:.2f} s, plain {best_plain[m]:.2f} s")
    base = min(best_plain.values())
    rows = [(m, best_mc[m], best_mc[m] / best_plain[m], posts[m].num_stored(), best_plain[m]) for m in methods]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {args.model} ({n_params / 1e6:.2f}M params, {args.num_classes} classes), input 3x{args.size}x{args.size}, "
          f"{args.n_images} images in batches of {args.batch_size}, K_mc = {args.mc_samples}, "
          f"torch threads {torch.get_num_threads()}, "
          f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}; INF rank {args.rank}; setup {setup_s:.1f} s")
    print(f"{'method':<8} {'MC eval s':>10} {'plain s':>8} {'ratio':>7} {'stored':>12}")
    print(f"{'plain':<8} {'-':>10} {base:>8.2f} {1.0:>7.3f} {'-':>12}")
    for m, s, r, ns, b in rows:
        print(f"{m:<8} {s:>10.2f} {b:>8.2f} {r:>7.3f} {ns:>12,}")
    print("ratio = MC evaluation time / time of K_mc plain forward passes over the same set (target INF <= 1.15)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
