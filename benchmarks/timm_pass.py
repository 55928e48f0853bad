"""Pass 1 of a large timm model on this CPU (issue 40): seconds per image, peak RSS, factor sizes,
eigendecomposition time.

    python benchmarks/timm_pass.py [--model timm:vit_base_patch16_224 ...] [--images 64] [--batch 16] [--threads 1]
        [--no-eigh]

Each model runs in a fresh process (what a curvature worker holds: the model, one batch, the
pass's sums), so its peak RSS (``ru_maxrss``) is that model's alone. The model is timm's
architecture with random weights (``pretrained=False``, eval mode, 1000 classes; the cost does not
depend on the weights' values), the images random ``3 x 224 x 224`` tensors (the decode is not
part of pass 1). Pass 1 is :func:`laplace_core.curvature.collect.collect_statistics` (KFAC ``A``,
``G``, the exact Fisher diagonal; ``fisher="mc"``, one draw, float64 sums), timed over all
``--images`` images after one warm-up batch; then :func:`laplace_core.basis.eigenbasis.eigenbasis`
(every layer's ``eigh`` of ``A`` and ``G``) is timed. Prints one JSON line per model.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("timm:vit_base_patch16_224", "timm:convnext_tiny")


def measure(name: str, images: int, batch: int, threads: int, eigh: bool = True) -> dict:
    from laplace_core.basis.eigenbasis import eigenbasis
    from laplace_core.curvature.collect import collect_statistics
    from pipelines.ingest.models import load_model

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = load_model(name, "random")
    rss_model = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    g = torch.Generator().manual_seed(0)
    x = torch.randn(images, 3, 224, 224, generator=g)
    y = torch.randint(0, 1000, (images,), generator=g)
    batches = [(x[i:i + batch], y[i:i + batch]) for i in range(0, images, batch)]
    collect_statistics(model, batches[:1], fisher="mc", generator=torch.Generator().manual_seed(1))  # warm-up
    t0 = time.perf_counter()
    stats = collect_statistics(model, batches, fisher="mc", generator=torch.Generator().manual_seed(1))
    t_pass = time.perf_counter() - t0
    factors = sum(ls.A.numel() + ls.G.numel() for ls in stats.layers.values() if ls.A is not None)
    diag = sum(ls.diag.numel() for ls in stats.layers.values())
    t_eig = None
    if eigh:  # its time does not depend on the number of images
        t0 = time.perf_counter()
        eigenbasis(stats)
        t_eig = round(time.perf_counter() - t0, 2)
    return {"model": name, "images": images, "batch": batch, "threads": threads, "layers": len(stats.layers),
            "s_per_image": round(t_pass / images, 3), "pass_s": round(t_pass, 1),
            "factor_numbers": factors, "factor_mib_f64": round(factors * 8 / 2**20, 1), "diag_numbers": diag,
            "eigh_s": t_eig, "rss_after_build_mib": round(rss_model),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "loadavg": [round(v, 2) for v in os.getloadavg()]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", help=f"timm:NAME (repeatable; default {', '.join(MODELS)})")
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-eigh", action="store_true", help="pass 1 only (the eigendecomposition's time does not "
                   "depend on the number of images)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: measure one model here
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.model[0], a.images, a.batch, a.threads, not a.no_eigh)), flush=True)
        return 0
    for name in a.model or MODELS:
        subprocess.run([sys.executable, __file__, "--one", "--model", name, "--images", str(a.images),
                        "--batch", str(a.batch), "--threads", str(a.threads), *(["--no-eigh"] if a.no_eigh else [])],
                       check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
