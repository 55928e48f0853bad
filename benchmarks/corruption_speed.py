"""Images per second of each ImageNet-C corruption at 224 x 224 on one core (issue 39).

Each corruption of :data:`pipelines.ingest.corruptions.CORRUPTIONS` is timed on a real photo
(scikit-image's ``astronaut``, 512 x 512, resized to 256 and centre-cropped to 224 as the eval
transform does) at every severity, ``--reps`` times each (each call with a fresh per-image
generator, as a decode task does), and, for the corruptions computed here or ported, the
reference's function on the same image (``imagecorruptions`` 1.1.2; glass_blur / fog patched at
their two broken calls). Pin it to one core with ``taskset -c 0`` and one thread per library::

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 taskset -c 0 \\
        .venv/bin/python benchmarks/corruption_speed.py --reps 3

Prints one markdown row per corruption: images/s (mean over severities 1..5 of the time per
image), seconds per image at severity 1 and 5, the reference's images/s where compared.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import time
import types
import warnings

import numpy as np
from PIL import Image


def _photo() -> np.ndarray:
    from skimage.data import astronaut

    im = Image.fromarray(astronaut()).resize((256, 256), Image.BILINEAR)
    return np.asarray(im.crop((16, 16, 240, 240)))


def _patched_reference():
    src = open(importlib.util.find_spec("imagecorruptions.corruptions").origin).read()
    src = src.replace("multichannel=True", "channel_axis=-1").replace("np.float_)", "np.float64)")
    mod = types.ModuleType("imagecorruptions.corruptions")
    mod.__dict__["__package__"] = "imagecorruptions"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(src, "imagecorruptions/corruptions.py (patched)", "exec"), mod.__dict__)
    return mod


def _time(fn, reps: int) -> list[float]:
    """Mean seconds per image at each severity 1..5, after one warm-up call."""
    fn(1, 0)  # warm-up: imports, the reference's module, frost's files
    out = []
    for severity in range(1, 6):
        t0 = time.perf_counter()
        for r in range(reps):
            fn(severity, r)
        out.append((time.perf_counter() - t0) / reps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="images per severity (default 3)")
    args = ap.parse_args()
    try:
        import cv2

        cv2.setNumThreads(1)
    except ImportError:
        pass
    from pipelines.ingest.corruptions import CORRUPTIONS, corrupt, corruption_rng

    img, ref = _photo(), _patched_reference()
    print(f"# cpus allowed: {sorted(os.sched_getaffinity(0))}, image {img.shape}, reps {args.reps}")
    print("| corruption | family | computed by | images/s | s/image sev 1 | s/image sev 5 | reference images/s |")
    print("|---|---|---|---|---|---|---|")
    for name, c in CORRUPTIONS.items():
        ours = _time(lambda s, r: corrupt(img, name, s, corruption_rng(0, name, f"img{r}")), args.reps)
        ref_col = ""
        if c.source != "reference" and hasattr(ref, name):
            fn = getattr(ref, name)
            theirs = _time(lambda s, r: np.uint8(fn(Image.fromarray(img), s)), args.reps)
            ref_col = f"{1 / np.mean(theirs):.1f}"
        print(f"| {name} | {c.family} | {c.source} | {1 / np.mean(ours):.1f} | {ours[0]:.4f} | {ours[4]:.4f} "
              f"| {ref_col} |", flush=True)


if __name__ == "__main__":
    main()
