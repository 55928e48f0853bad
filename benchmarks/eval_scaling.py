"""Scaling of the Ray MC evaluation (``pipelines.evaluation.evaluate.evaluate``): 1 vs 2 (or more) actors
on a fixed posterior.

    flock /tmp/infoform-ray.lock python benchmarks/eval_scaling.py [--size 32] [--split train]
        [--methods inf kfac] [--mc-samples 30] [--actors 1 2] [--repeats 2] [--out eval_scaling.json]

Setup (driver process, no Ray, not timed): scikit-learn digits written as a ``size x size``
ImageFolder (``pipelines.ingest.demo_data``), ``demo_cnn`` trained for ``--epochs`` epochs, curvature
on the train split in this process (MC Fisher, EFB pass) and one posterior per ``--methods``
(INF at rank 100) saved as artifacts. Those fixed posteriors are then evaluated on
``--split`` (Ray Data via ``pipelines.ingest.batches.build_dataset``, no OOD set) with each actor
count, one torch thread and ``--cpus-per-actor`` Ray CPUs per actor (the default 0.5 leaves
Ray Data a CPU to decode with on a 2-core machine), the same seed, batch size and
``K_mc``; repetitions are interleaved (1, 2, 1, 2, ...) and medians reported.

Per run: the driver's wall time of ``evaluate`` (actor start, model and posterior load,
decode, MAP + every method; ``timing.wall_s``), the slowest actor's compute for each method
(``seconds_max``) and the slowest load (``load_s_max``). Speedup = median wall(1 actor) /
median wall(n actors). The metrics of every actor count must agree (the sharding-invariance
the module guarantees; checked to 1e-9 relative on NLL and accuracy, a mismatch is
reported). Starts its own local Ray (``num_cpus`` = ``--cpus``, default the machine's
cores) in a temporary directory and shuts it down; run it under the shared Ray lock.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics as pystats
import sys
import tempfile
import time
from pathlib import Path

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["PYTHONPATH"] = os.pathsep.join([_REPO, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])

NORM = (0.5, 0.5, 0.5)


def _data_cfg(root: Path, split: str, size: int):
    from pipelines.ingest.index import DataConfig

    return DataConfig(root=str(root / "digits"), split=split, image_size=size, resize_size=size,
                      mean=NORM, std=NORM, decode_batch_size=64)


def _fit(work: Path, a) -> tuple[dict, dict[str, str]]:
    """Digits ImageFolder, trained demo_cnn, posteriors saved under ``work`` (driver, no Ray)."""
    import torch

    import laplace_core as lc
    from pipelines.ingest import demo_data as dd

    dd.write_digits_imagefolder(work / "digits", size=a.size)
    model, info = dd.train_small_cnn(work / "digits", epochs=a.epochs, seed=0, cache_path=work / "cnn")
    x, y, _ = dd.load_imagefolder(work / "digits", "train")
    batches = [(x[i:i + 128], y[i:i + 128]) for i in range(0, len(x), 128)]
    stats = lc.collect_statistics(model, batches, fisher="mc", generator=torch.Generator().manual_seed(0))
    basis = lc.eigenbasis(stats)
    stats = lc.collect_statistics(model, batches, fisher="mc", generator=torch.Generator().manual_seed(1),
                                  basis=basis)  # second pass: A, G, diag and the EFB sums in ``basis``
    uris = {}
    for m in a.methods:
        uris[m] = str(work / "posterior" / m)
        lc.build_posterior(stats, m, rank=100 if m == "inf" else None, basis=basis).save(uris[m])
    spec = {"name": "demo_cnn", "weights": str(work / "cnn" / "small_cnn.safetensors"), "num_classes": 10}
    return spec, uris


def _agree(r1: dict, r2: dict, tol: float = 1e-9) -> list[str]:
    bad = []
    for m in r1:
        for k in ("nll", "accuracy"):
            u, v = r1[m].get(k), r2[m].get(k)
            if isinstance(u, float) and isinstance(v, float) and not math.isclose(u, v, rel_tol=tol, abs_tol=tol):
                bad.append(f"{m}.{k}: {u} vs {v}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--split", default="train")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=["inf", "kfac"])
    ap.add_argument("--mc-samples", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--actors", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cpus-per-actor", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import ray

    from pipelines.ingest.batches import build_dataset
    from pipelines.ingest.scan import scan
    from pipelines.evaluation.evaluate import evaluate
    from pipelines.evaluation.runtime import EvalConfig

    work = Path(tempfile.mkdtemp(prefix="infoform-evalscale-"))
    ray_tmp = tempfile.mkdtemp(prefix="res", dir="/tmp")
    load = [os.getloadavg()]
    rows, results = [], {}
    try:
        t0 = time.perf_counter()
        spec, uris = _fit(work, a)
        setup_s = time.perf_counter() - t0
        ray.init(num_cpus=a.cpus or os.cpu_count(), include_dashboard=False, _temp_dir=ray_tmp,
                 logging_level=logging.WARNING)
        ray.data.DataContext.get_current().enable_progress_bars = False
        c = _data_cfg(work, a.split, a.size)
        for rep in range(a.repeats):
            for n in a.actors:
                cfg = EvalConfig(num_actors=n, mc_samples=a.mc_samples, seed=0, batch_size=a.batch_size,
                                 torch_threads=1, cpus_per_actor=a.cpus_per_actor)
                t = time.perf_counter()
                res = evaluate(spec, uris, build_dataset(scan(c), c), None, cfg)
                wall = time.perf_counter() - t
                failed = {m: r["reason"] for m, r in res.items() if r["status"] != "ok"}
                row = {"actors": n, "repeat": rep, "wall_s": wall, "failed": failed,
                       "load_s_max": next(iter(res.values()))["timing"]["load_s_max"],
                       "seconds_max": {m: r["timing"]["seconds_max"] for m, r in res.items()},
                       "n_examples": next(iter(res.values())).get("n")}
                rows.append(row)
                results.setdefault(n, res)
                print(f"rep {rep} actors {n}: wall {wall:.1f}s {row['seconds_max']}", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    load.append(os.getloadavg())

    med = {n: pystats.median(r["wall_s"] for r in rows if r["actors"] == n) for n in a.actors}
    base = med[a.actors[0]]
    mismatch = {n: _agree(results[a.actors[0]], results[n]) for n in a.actors[1:]}
    print(f"\ndemo_cnn, digits '{a.split}' split at {a.size}x{a.size}, methods map+{'+'.join(a.methods)}, "
          f"K_mc={a.mc_samples}, batch {a.batch_size}, 1 torch thread and {a.cpus_per_actor} Ray CPU per actor, "
          f"medians of {a.repeats} interleaved runs; setup {setup_s:.0f}s (not timed); "
          f"load average start {load[0]}, end {load[1]}\n")
    methods = list(next(iter(results.values())))
    print("| actors | median wall s | speedup vs " + str(a.actors[0]) + " | " +
          " | ".join(f"{m} actor-max s" for m in methods) + " |")
    print("| ---: | ---: | ---: | " + " | ".join("---:" for _ in methods) + " |")
    for n in a.actors:
        per = {m: pystats.median(r["seconds_max"][m] for r in rows if r["actors"] == n) for m in methods}
        print(f"| {n} | {med[n]:.1f} | {base / med[n]:.2f} | " + " | ".join(f"{per[m]:.1f}" for m in methods) + " |")
    for n, bad in mismatch.items():
        print(f"- metrics {a.actors[0]} vs {n} actors: {'agree (1e-9)' if not bad else 'MISMATCH ' + '; '.join(bad)}")
    if a.out:
        Path(a.out).write_text(json.dumps({"config": vars(a), "load_avg": load, "setup_s": setup_s, "rows": rows,
                                           "median_wall_s": med, "speedup": {n: base / med[n] for n in a.actors},
                                           "mismatch": mismatch}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
