"""Scaling of the distributed curvature pass: 1 vs 2 (or more) CPU workers.

Runs :func:`pipelines.passes.curvature.run_curvature` on the same synthetic images with
each worker count (one torch thread per worker) and prints, per run, the pass-1
wall time, images/s, the time spent in the reduce (statistics all-reduce + counts and
skip reports) and its share of the pass, the number of reduces, and the speedup over the
first worker count. ``--checkpoint-every-s`` sets ``curvature.checkpoint_every_s`` (default
600: one reduce at the end of the pass; 0: one per partition, the schedule before
:mod:`pipelines.distributed`).

    python benchmarks/scaling.py                      # demo_cnn, 512 images 32x32, workers 1 2
    python benchmarks/scaling.py --model resnet18 --images 256 --size 64 --workers 1 2 4

Starts its own local Ray (``num_cpus`` = ``--cpus``, default the machine's cores) in a
temporary directory and shuts it down at the end; everything it writes goes to a
temporary directory that is removed afterwards (``--keep`` to keep it).
Numbers on a shared 2-core machine are noisy: repeat with ``--repeats``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)


def _datasets(n: int, size: int, partitions: int, num_classes: int, seed: int):
    import numpy as np
    import ray.data

    rng = np.random.default_rng(seed)
    per = [len(c) for c in np.array_split(np.arange(n), partitions)]
    out, start = [], 0
    for k in per:
        items = [
            {
                "image": rng.standard_normal((3, size, size)).astype(np.float32),
                "label": int(rng.integers(num_classes)),
                "path": f"synthetic/{start + i:06d}",
                "valid": True,
            }
            for i in range(k)
        ]
        out.append(ray.data.from_items(items, override_num_blocks=max(1, min(8, k // 16))))
        start += k
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo_cnn")
    ap.add_argument("--num-classes", type=int, default=10)
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--methods", nargs="*", default=["diag", "kfac"])
    ap.add_argument("--fisher", default="mc", choices=["mc", "empirical"])
    ap.add_argument("--cpus", type=float, default=None, help="Ray num_cpus (default: os.cpu_count())")
    ap.add_argument("--cpus-per-worker", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--checkpoint-every-s", type=float, default=600.0)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = ap.parse_args(argv)

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    pp = os.environ.get("PYTHONPATH", "")
    if _REPO not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = _REPO + (os.pathsep + pp if pp else "")

    import ray
    import torch

    from pipelines.passes.curvature import CurvatureConfig, run_curvature
    from pipelines.storage.store import RunStore
    from pipelines.ingest.models import load_model

    work = tempfile.mkdtemp(prefix="infoform-scaling-")
    ray_tmp = tempfile.mkdtemp(prefix="rsc", dir="/tmp")
    ray.init(num_cpus=args.cpus or os.cpu_count(), include_dashboard=False, _temp_dir=ray_tmp,
             logging_level=logging.WARNING)
    ray.data.DataContext.get_current().enable_progress_bars = False
    rows = []
    try:
        weights = os.path.join(work, "model.pt")
        torch.save(load_model(args.model, num_classes=args.num_classes).state_dict(), weights)
        spec = type("Spec", (), {"name": args.model, "weights": weights, "num_classes": args.num_classes})()
        for rep in range(args.repeats):
            for w in args.workers:
                parts = _datasets(args.images, args.size, args.partitions, args.num_classes, seed=rep)
                cfg = CurvatureConfig(num_workers=w, use_gpu=False, cpus_per_worker=args.cpus_per_worker,
                                      fisher=args.fisher, batch_size=args.batch_size, methods=tuple(args.methods),
                                      max_failures=0, checkpoint_every_s=args.checkpoint_every_s,
                                      torch_threads=1, log_every_s=30.0)
                out = os.path.join(work, f"run-w{w}-r{rep}")
                t0 = time.perf_counter()
                res = run_curvature(spec, parts, cfg, RunStore.open(out))
                total = time.perf_counter() - t0
                p1 = res.timings["worker"]["pass1"]
                ranks = [r["pass1"] for r in res.timings["worker"].get("ranks", [])] or [p1]
                rows.append({
                    "workers": w, "repeat": rep, "images": p1["images"], "pass1_s": p1["wall_s"],
                    "collect_s": max(r["compute_s"] + r["data_wait_s"] for r in ranks),
                    # per-rank compute with the data waits taken out: what the pass costs once
                    # its pipeline runs (the waits include the pipeline's start-up, a fixed cost)
                    "compute_s": max(r["compute_s"] for r in ranks),
                    "reduces": p1["reduces"], "reduce_s": max(r["reduce_s"] for r in ranks),
                    "data_wait_s": max(r.get("data_wait_s", 0.0) for r in ranks),
                    "data_start_s": max(r.get("data_start_s", 0.0) for r in ranks),
                    "write_s": p1.get("write_s", 0.0), "allreduce_s": p1["allreduce_s"],
                    "allreduce_bytes": p1["allreduce_bytes"], "allreduce_share": p1["allreduce_s"] / max(p1["wall_s"], 1e-12),
                    "reduce_share": max(r["reduce_s"] for r in ranks) / max(p1["wall_s"], 1e-12),
                    "images_per_s": p1["images"] / max(p1["wall_s"], 1e-12), "fit_s": res.timings["fit_s"], "total_s": total,
                })
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    base, base_c = {}, {}
    for r in rows:
        base.setdefault(r["repeat"], r["pass1_s"])
        base_c.setdefault(r["repeat"], r["compute_s"])
        r["speedup"] = base[r["repeat"]] / max(r["pass1_s"], 1e-12)
        r["compute_speedup"] = base_c[r["repeat"]] / max(r["compute_s"], 1e-12)
    print(f"model={args.model} images={args.images} size={args.size} partitions={args.partitions} "
          f"batch={args.batch_size} fisher={args.fisher} methods={','.join(args.methods)} "
          f"checkpoint_every_s={args.checkpoint_every_s:g}")
    print(f"{'workers':>7} {'rep':>3} {'pass1 s':>8} {'img/s':>8} {'speedup':>7} {'reduces':>7} {'reduce s':>8} "
          f"{'reduce %':>8} {'allred s':>8} {'MB/worker':>9} {'collect s':>9} {'wait s':>7} {'start s':>7} {'write s':>7} "
          f"{'fit s':>7} {'compute s':>9} {'c-speedup':>9}")
    for r in rows:
        print(f"{r['workers']:>7} {r['repeat']:>3} {r['pass1_s']:>8.2f} {r['images_per_s']:>8.1f} {r['speedup']:>7.2f} "
              f"{r['reduces']:>7} {r['reduce_s']:>8.3f} {100 * r['reduce_share']:>7.1f}% "
              f"{r['allreduce_s']:>8.3f} {r['allreduce_bytes'] / 2**20:>9.2f} "
              f"{r['collect_s']:>9.2f} {r['data_wait_s']:>7.2f} {r['data_start_s']:>7.2f} {r['write_s']:>7.2f} {r['fit_s']:>7.1f} "
              f"{r['compute_s']:>9.2f} {r['compute_speedup']:>9.2f}")
    print("reduce s: slowest rank's time in the reduces (all-reduce of the sums + counts + skip reports, incl. "
          "waiting for the other ranks to arrive); collect s: slowest rank's compute incl. waiting for data; wait s: "
          "slowest rank's wait for the data pipeline, start s: of which until each partition's first batch; write s: "
          "rank 0's checkpoint writes; compute s: slowest rank's compute without data waits; c-speedup: its ratio to the "
          "first row (the pass's speedup once the pipeline runs)")
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
