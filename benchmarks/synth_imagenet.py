"""Write a synthetic ImageNet-layout tree of real JPEGs, for throughput runs of the job.

    python benchmarks/synth_imagenet.py /tmp/inet --classes 10 --per-class 800 --val-per-class 40

``<root>/train/<wnid>/<wnid>_<i>.JPEG`` and ``<root>/val/<wnid>/...``: 500 x 375 RGB
(ImageNet's most common size), smooth random colour fields plus noise at JPEG quality 90
(about ImageNet's bytes per image), so decoding costs what it costs on ImageNet. Written
with one process per CPU; the content is a function of (class, index), so reruns agree.
"""
from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image


def _one(args: tuple[str, int, int]) -> int:
    path, cls, i = args
    rng = np.random.default_rng(cls * 1_000_003 + i)
    coarse = rng.uniform(0, 255, size=(6, 8, 3)).astype(np.uint8)
    img = np.asarray(Image.fromarray(coarse).resize((500, 375), Image.BICUBIC), dtype=np.float32)
    img += rng.normal(0, 12, size=img.shape)
    Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(path, quality=90)
    return os.path.getsize(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--per-class", type=int, default=800)
    ap.add_argument("--val-per-class", type=int, default=40)
    args = ap.parse_args(argv)
    jobs = []
    for split, n in (("train", args.per_class), ("val", args.val_per_class)):
        for c in range(args.classes):
            wnid = f"n{c:08d}"
            d = Path(args.root) / split / wnid
            d.mkdir(parents=True, exist_ok=True)
            off = 0 if split == "train" else 10**6
            jobs += [(str(d / f"{wnid}_{i}.JPEG"), c, off + i) for i in range(n)]
    t0 = time.perf_counter()
    with ProcessPoolExecutor() as ex:
        sizes = list(ex.map(_one, jobs, chunksize=32))
    print(f"{len(jobs)} JPEGs, {sum(sizes) / len(sizes) / 1024:.0f} KiB each on average, "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
