"""Bytes all-reduced and written per pass, per partition (before) vs per interval (now).

For each model, with the ``imagenet-resnet50`` preset's partitions (1,281,167 images,
``data.partition_size`` 20,000 -> 65 partitions, ``curvature.efb_fraction`` 1) at 16 workers,
prints per pass:

* **before** (one reduce per partition, full float64 ``A``, ``G``, diagonal; every
  partition's reduced sums written by rank 0);
* **after** (:mod:`pipelines.distributed`: workers keep running sums, one reduce per
  ``checkpoint_every_s`` interval and one at the end, ``A``/``G`` as upper triangles; rank 0
  writes one checkpoint per reduce, pass 1's last one included, the EFB pass's last one left
  to ``stats/reduced``);
* the reduce's share of the modelled pass, a ring all-reduce moving ``2 (W-1)/W`` of the
  payload over each worker's link at ``--link-gbit`` (default 10 Gbit/s).

Throughput (**assumption**, ``infra/README.md``'s cost model): ResNet-50 at ``r_fb / rho_1``
images/s per A100 in pass 1 (938 / 4.56 = 206) and ``r_fb / rho_2`` in pass 2 (938 / 4.31 =
218); other models scaled by torchvision's forward GFLOPS (``_ops`` in the weights' metadata):
``206 x 4.089 / GFLOPS``. Payloads are exact (layer shapes of the
torchvision model built on the meta device; nothing is downloaded).

    python benchmarks/comm.py
    python benchmarks/comm.py --workers 32 --interval 300 --link-gbit 25
"""
from __future__ import annotations

import argparse
import math
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

MODELS = ("resnet18", "resnet50", "resnet152", "densenet121", "densenet161")
N_TR = 1_281_167
PARTITION_SIZE = 20_000
RESNET50_RATE = 938 / 4.56  # img/s per A100 in pass 1 (infra/README.md: r_fb / rho_1)
RESNET50_RATE2 = 938 / 4.31  # in pass 2 (r_fb / rho_2)


def layer_shapes(name: str) -> list[tuple[int, int]]:
    import torch
    import torchvision

    from laplace_core.curvature.layers import find_layers

    with torch.device("meta"):
        model = torchvision.models.get_model(name, weights=None)
    _, infos, _ = find_layers(model)
    return [tuple(i.shape) for i in infos.values()]


def gflops(name: str) -> float:
    import torchvision

    return float(torchvision.models.get_model_weights(name).IMAGENET1K_V1.meta["_ops"])


def traffic(shapes, *, images: int = N_TR, partition_size: int = PARTITION_SIZE, efb_fraction: float = 1.0,
            workers: int = 16, rate: float = RESNET50_RATE, rate2: float = RESNET50_RATE2, interval_s: float = 600.0,
            link_gbit: float = 10.0):
    """Per pass (``pass1``, ``pass2``): bytes all-reduced and written per pass before and after,
    the number of reduces after, seconds of compute and of the reduce, and the reduce's share."""
    full = sum(n * n + m * m + m * n for m, n in shapes)
    packed = sum(n * (n + 1) // 2 + m * (m + 1) // 2 + m * n for m, n in shapes)
    efb = sum(m * n for m, n in shapes)
    parts = math.ceil(images / partition_size)
    parts2 = max(1, min(parts, math.ceil(efb_fraction * parts - 1e-9)))
    link = link_gbit * 1e9 / 8
    out = {}
    for name, n_parts, n_images, before_numbers, after_numbers, final_written, r in (
            ("pass1", parts, images, full, packed, 1, rate),
            ("pass2", parts2, min(images, round(efb_fraction * images)), efb, efb, 0, rate2)):
        compute_s = n_images / (workers * r)
        reduces = 1 if interval_s <= 0 and n_parts == 1 else (
            n_parts if interval_s <= 0 else min(n_parts, math.floor(compute_s / interval_s) + 1))
        payload = 8 * after_numbers
        reduce_s = 2 * (workers - 1) / workers * payload / link
        out[name] = {
            "partitions": n_parts, "payload": payload,
            "before_allreduced": n_parts * 8 * before_numbers, "before_written": n_parts * 8 * before_numbers,
            "reduces": reduces, "after_allreduced": reduces * payload,
            "after_written": (reduces - 1 + final_written) * payload,
            "compute_s": compute_s, "reduce_s": reduces * reduce_s,
            "before_reduce_s": n_parts * 2 * (workers - 1) / workers * 8 * before_numbers / link,
            "share": reduces * reduce_s / (compute_s + reduces * reduce_s),
            "before_share": n_parts * 2 * (workers - 1) / workers * 8 * before_numbers / link
            / (compute_s + n_parts * 2 * (workers - 1) / workers * 8 * before_numbers / link),
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--interval", type=float, default=600.0, help="curvature.checkpoint_every_s")
    ap.add_argument("--link-gbit", type=float, default=10.0)
    ap.add_argument("--partition-size", type=int, default=PARTITION_SIZE)
    args = ap.parse_args(argv)
    print(f"{N_TR:,} images, {math.ceil(N_TR / args.partition_size)} partitions, {args.workers} workers, "
          f"interval {args.interval:g} s, {args.link_gbit:g} Gbit/s ring all-reduce")
    print("| model | pass | img/s/worker | pass compute s | all-reduced before | written before | reduce share before "
          "| reduces after | all-reduced after | written after | reduce share after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        scale = gflops("resnet50") / gflops(name)
        rates = {"pass1": RESNET50_RATE * scale, "pass2": RESNET50_RATE2 * scale}
        t = traffic(layer_shapes(name), partition_size=args.partition_size, workers=args.workers,
                    rate=rates["pass1"], rate2=rates["pass2"], interval_s=args.interval, link_gbit=args.link_gbit)
        for p, v in t.items():
            print(f"| {name} | {p} | {rates[p]:.0f} | {v['compute_s']:.0f} | {v['before_allreduced'] / 1e9:.1f} GB "
                  f"| {v['before_written'] / 1e9:.1f} GB | {100 * v['before_share']:.0f}% | {v['reduces']} "
                  f"| {v['after_allreduced'] / 1e9:.2f} GB | {v['after_written'] / 1e9:.2f} GB "
                  f"| {100 * v['share']:.2f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
