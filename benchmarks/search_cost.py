"""Cost of the ``(N, τ)`` search on Ray Tune: scheduler none/ASHA x algorithm random/TPE.

    flock /tmp/infoform-ray.lock python benchmarks/search_cost.py [--model demo_cnn] [--size 32]
        [--configs 24] [--methods diag kfac] [--chunk-size 16] [--reduction-factor 4]
        [--mc-samples 4] [--out search_cost.json]
    flock /tmp/infoform-ray.lock python benchmarks/search_cost.py --model resnet18 --size 64

Setup (driver process, no Ray, not timed): scikit-learn digits written as a ``size x size``
ImageFolder (``pipelines.ingest.demo_data``: train / val / test), the model trained on
train (``demo_cnn``: the demo's; ``resnet18``: torchvision's, 10 classes, trained from
scratch with Adam for ``--epochs``), MC-Fisher curvature on at most ``--curvature-images``
train images and one posterior per ``--methods`` saved as artifacts. Then, for each
(scheduler, algorithm), :func:`pipelines.evaluation.search.search`
on the **val** split (``--configs`` configurations per method, ``--chunk-size`` images per ASHA
step, ``--reduction-factor``) and :func:`pipelines.evaluation.evaluate.evaluate` of the chosen
``(N, τ)`` on the **test** split. Printed per row: image-samples the search evaluated
(images x ``K``) and their share of the full search's, the search's wall time, and per method
the chosen configuration's test NLL and ECE. Starts its own local Ray (``--cpus``) in a
temporary directory and shuts it down; run it under the shared Ray lock. Wall times on a
shared machine are noisy: the load average is printed with the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
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


def _fit(work: Path, a) -> tuple[dict, dict[str, str]]:
    """Digits ImageFolder, trained demo_cnn, posteriors saved under ``work`` (driver, no Ray)."""
    import torch

    import laplace_core as lc
    from pipelines.ingest import demo_data as dd

    dd.write_digits_imagefolder(work / "digits", size=a.size)
    x, y, _ = dd.load_imagefolder(work / "digits", "train")
    if a.model == "demo_cnn":
        model, _ = dd.train_small_cnn(work / "digits", epochs=a.epochs, seed=0, cache_path=work / "cnn")
        spec = {"name": "demo_cnn", "weights": str(work / "cnn" / "small_cnn.safetensors"), "num_classes": 10}
    else:
        model, spec = _train_torchvision(a.model, x, y, a.epochs, work)
    x, y = x[:a.curvature_images], y[:a.curvature_images]
    batches = [(x[i:i + 32], y[i:i + 32]) for i in range(0, len(x), 32)]
    stats = lc.collect_statistics(model, batches, fisher="mc", generator=torch.Generator().manual_seed(0))
    basis = lc.eigenbasis(stats) if {"efb", "inf"} & set(a.methods) else None
    if basis is not None:
        stats = lc.collect_statistics(model, batches, fisher="mc", generator=torch.Generator().manual_seed(1),
                                      basis=basis)
    uris = {}
    for m in a.methods:
        uris[m] = str(work / "posterior" / m)
        lc.build_posterior(stats, m, rank=100 if m == "inf" else None, basis=basis).save(uris[m])
    return spec, uris


def _train_torchvision(name: str, x, y, epochs: int, work: Path):
    """A torchvision classifier (10 classes) trained from scratch on ``x, y`` (Adam, batches
    of 64, seeded), in eval mode, saved as safetensors; ``(model, spec)``."""
    import torch
    import torchvision
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = torchvision.models.get_model(name, num_classes=10)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for epoch in range(epochs):
        model.train()
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), 64):
            idx = perm[i:i + 64]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            acc = sum(int((model(x[i:i + 256]).argmax(1) == y[i:i + 256]).sum()) for i in range(0, len(x), 256))
        print(f"[setup] {name} epoch {epoch + 1}/{epochs}: train accuracy {acc / len(x):.3f}", file=sys.stderr,
              flush=True)
    weights = str(work / f"{name}.safetensors")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, weights)
    return model, {"name": name, "weights": weights, "num_classes": 10}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo_cnn", choices=["demo_cnn", "resnet18"])
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--curvature-images", type=int, default=2048)
    ap.add_argument("--reduction-factor", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=["diag", "kfac"])
    ap.add_argument("--configs", type=int, default=24)
    ap.add_argument("--chunk-size", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--mc-samples", type=int, default=4)
    ap.add_argument("--eval-mc-samples", type=int, default=16)
    ap.add_argument("--cpus", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import ray

    from pipelines.evaluation.evaluate import evaluate
    from pipelines.evaluation.runtime import EvalConfig, SearchConfig
    from pipelines.evaluation.search import search
    from pipelines.ingest.batches import build_dataset
    from pipelines.ingest.index import DataConfig
    from pipelines.ingest.scan import scan

    work = Path(tempfile.mkdtemp(prefix="infoform-searchcost-"))
    ray_tmp = tempfile.mkdtemp(prefix="rsc", dir="/tmp")
    load = [os.getloadavg()]
    rows = []
    try:
        spec, uris = _fit(work, a)
        ray.init(num_cpus=a.cpus or os.cpu_count(), include_dashboard=False, _temp_dir=ray_tmp,
                 logging_level=logging.WARNING)
        ray.data.DataContext.get_current().enable_progress_bars = False

        def ds(split):
            c = DataConfig(root=str(work / "digits"), split=split, image_size=a.size, resize_size=a.size,
                           mean=NORM, std=NORM, decode_batch_size=64)
            return build_dataset(scan(c), c)

        base = SearchConfig(num_actors=2, batch_size=a.batch_size, chunk_size=a.chunk_size, mc_samples=a.mc_samples,
                            torch_threads=1, cpus_per_actor=0.5, num_configs=a.configs, log10_n=(0.0, 5.0),
                            log10_tau=(-2.0, 4.0), seed=0, reduction_factor=a.reduction_factor)
        for sched in ("none", "asha"):
            for alg in ("random", "tpe"):
                cfg = dataclasses.replace(base, scheduler=sched, algorithm=alg)
                t = time.perf_counter()
                res = search(spec, uris, ds("val"), cfg)
                wall = time.perf_counter() - t
                ev = evaluate(spec, uris, ds("test"), None, EvalConfig(num_actors=2, mc_samples=a.eval_mc_samples,
                                                                      batch_size=a.batch_size, torch_threads=1),
                              hyper=res.hyper())
                row = {"scheduler": sched, "algorithm": alg, "wall_s": wall, "image_samples": res.info["image_samples"],
                       "image_samples_full": res.info["image_samples_full"],
                       "chosen": {m: res.chosen[m] for m in uris},
                       "test": {m: {"nll": ev[m]["nll"], "ece": ev[m]["ece"]} for m in uris}}
                rows.append(row)
                print(f"{sched}/{alg}: {wall:.1f}s {row['image_samples']} image-samples", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    load.append(os.getloadavg())
    full = next(r for r in rows if r["scheduler"] == "none" and r["algorithm"] == "random")["image_samples"]
    print(f"\n{a.model} on digits {a.size}x{a.size}: search on val, {a.configs} configurations per method "
          f"({'+'.join(a.methods)}), K={a.mc_samples}, chunks of {a.chunk_size} images, ASHA reduction factor "
          f"{a.reduction_factor}; "
          f"test K={a.eval_mc_samples}; 2 trials at once, 0.5 CPU and 1 thread each; load average start "
          f"{load[0]}, end {load[1]}\n")
    print("| scheduler | algorithm | image-samples | share of full | wall s | " +
          " | ".join(f"{m} test NLL | {m} test ECE" for m in a.methods) + " |")
    print("| --- | --- | ---: | ---: | ---: | " + " | ".join("---: | ---:" for _ in a.methods) + " |")
    for r in rows:
        print(f"| {r['scheduler']} | {r['algorithm']} | {r['image_samples']} | {r['image_samples'] / full:.2f} | "
              f"{r['wall_s']:.1f} | " + " | ".join(f"{r['test'][m]['nll']:.4f} | {r['test'][m]['ece']:.4f}"
                                                  for m in a.methods) + " |")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "load": load, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
