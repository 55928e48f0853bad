"""Tiny ImageNet-layout trees for tests (no downloads; PIL writes real JPEG/PNG files).

``make_imagenet_tree(root, bad=True)`` writes::

    root/train/n01440764/n01440764_{0..k-1}.JPEG    random RGB JPEGs, 40x30 (W x H) by default
    root/train/n01443500/                           EMPTY class folder (sorts 2nd: index 1 reserved)
    root/train/n01443537/...
    root/train/n01484850/...
    root/val/ILSVRC2012_val_0000000{1..}.JPEG       flat val files
    root/LOC_val_solution.csv                       ImageId,PredictionString (wnid first token)

and with ``bad=True`` also, under train/ (see ``BAD_CASES``): a corrupt JPEG,
a truncated JPEG, a zero-byte file, a text file named .JPEG (all four INVALID), and a
grayscale JPEG, a CMYK JPEG, an RGBA PNG named .JPEG and a palette PNG (all four
VALID after RGB conversion). The good files are byte-identical whether or not
``bad`` is set (each is seeded by its name), so a clean tree and a bad tree
can be compared file by file. A bad tree also holds ``IGNORED_FILES`` (a ``notes.txt`` in a class
folder, a ``README.md`` in val/): not image suffixes, so never indexed (counted as ignored).
"""
from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

WNIDS = ("n01440764", "n01443537", "n01484850")
EMPTY_WNID = "n01443500"
ALL_CLASSES = tuple(sorted(WNIDS + (EMPTY_WNID,)))

#: rel path (under train/) -> (kind, valid after decoding)
BAD_CASES: dict[str, tuple[str, bool]] = {
    "n01440764/corrupt.JPEG": ("random bytes", False),
    "n01440764/truncated.JPEG": ("truncated jpeg", False),
    "n01443537/zero.JPEG": ("zero bytes", False),
    "n01443537/fake.JPEG": ("text file", False),
    "n01443537/gray.JPEG": ("grayscale L jpeg", True),
    "n01484850/cmyk.JPEG": ("CMYK jpeg", True),
    "n01484850/rgba_png.JPEG": ("RGBA png named .JPEG", True),
    "n01484850/palette.png": ("palette P png", True),
}


#: files a bad tree also holds that are not images by their suffix: rel path under root -> text
IGNORED_FILES: dict[str, str] = {"train/n01443537/notes.txt": "notes about this class\n",
                                 "val/README.md": "# validation images\n"}


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))


def random_rgb(name: str, size: tuple[int, int] = (40, 30)) -> Image.Image:
    """Deterministic random RGB image (size = (W, H)) seeded by ``name``; smooth-ish so JPEG is not all noise."""
    w, h = size
    rng = _rng(name)
    coarse = rng.integers(0, 256, size=(max(2, h // 4), max(2, w // 4), 3), dtype=np.uint8)
    img = Image.fromarray(coarse, "RGB").resize((w, h), Image.BILINEAR)
    noise = rng.integers(-20, 21, size=(h, w, 3))
    return Image.fromarray(np.clip(np.asarray(img, dtype=np.int64) + noise, 0, 255).astype(np.uint8), "RGB")


def jpeg_bytes(img: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@dataclass(frozen=True)
class Tree:
    root: Path
    classes: tuple[str, ...]          # sorted, incl. the empty class
    train_good: tuple[str, ...]       # rel paths under train/ of the plain RGB JPEGs
    train_bad: tuple[str, ...]        # rel paths under train/ of BAD_CASES (empty if bad=False)
    val_labels: dict                  # val file name -> wnid
    csv_path: Path

    @property
    def train_invalid(self) -> tuple[str, ...]:
        return tuple(p for p in self.train_bad if not BAD_CASES[p][1])

    @property
    def train_converted(self) -> tuple[str, ...]:
        return tuple(p for p in self.train_bad if BAD_CASES[p][1])


def _bad_bytes(rel: str) -> bytes:
    base = random_rgb(rel)
    kind = BAD_CASES[rel][0]
    if kind == "random bytes":
        return _rng(rel).integers(0, 256, size=2000, dtype=np.uint8).tobytes()
    if kind == "truncated jpeg":
        full = jpeg_bytes(random_rgb(rel, (64, 48)))
        return full[: len(full) // 2]
    if kind == "zero bytes":
        return b""
    if kind == "text file":
        return b"this is not an image\n"
    if kind == "grayscale L jpeg":
        return jpeg_bytes(base.convert("L"))
    if kind == "CMYK jpeg":
        return jpeg_bytes(base.convert("CMYK"))
    if kind == "RGBA png named .JPEG":
        rgba = base.convert("RGBA")
        a = _rng(rel + "a").integers(0, 256, size=(base.height, base.width), dtype=np.uint8)
        rgba.putalpha(Image.fromarray(a, "L"))
        return png_bytes(rgba)
    if kind == "palette P png":
        return png_bytes(base.convert("P", palette=Image.ADAPTIVE, colors=16))
    raise AssertionError(kind)


def make_imagenet_tree(
    root: Path | str,
    per_class: int = 3,
    n_val: int = 6,
    bad: bool = False,
    size: tuple[int, int] = (40, 30),
    empty_class: bool = True,
    val_csv: bool = True,
) -> Tree:
    """Write the tree described in the module docstring; returns what was written."""
    root = Path(root)
    train = root / "train"
    good = []
    for wnid in WNIDS:
        (train / wnid).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            rel = f"{wnid}/{wnid}_{i}.JPEG"
            (train / rel).write_bytes(jpeg_bytes(random_rgb(rel, size)))
            good.append(rel)
    if empty_class:
        (train / EMPTY_WNID).mkdir(parents=True, exist_ok=True)
    bad_rel = []
    if bad:
        for rel in BAD_CASES:
            (train / rel).write_bytes(_bad_bytes(rel))
            bad_rel.append(rel)
        for rel, text in IGNORED_FILES.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
    val = root / "val"
    val.mkdir(parents=True, exist_ok=True)
    val_labels = {}
    for i in range(1, n_val + 1):
        name = f"ILSVRC2012_val_{i:08d}.JPEG"
        wnid = WNIDS[(i * 7) % len(WNIDS)]
        (val / name).write_bytes(jpeg_bytes(random_rgb("val/" + name, size)))
        val_labels[name] = wnid
    csv_path = root / "LOC_val_solution.csv"
    if val_csv:
        write_loc_csv(csv_path, {n.rsplit(".", 1)[0]: w for n, w in val_labels.items()})
    classes = tuple(sorted(WNIDS + ((EMPTY_WNID,) if empty_class else ())))
    return Tree(root, classes, tuple(sorted(good)), tuple(sorted(bad_rel)), val_labels, csv_path)


def write_loc_csv(path: Path | str, id_to_wnid: dict, extra_rows: dict | None = None) -> None:
    """ImageNet-style ``LOC_val_solution.csv``: ``ImageId,PredictionString`` with boxes after the wnid."""
    rows = dict(id_to_wnid, **(extra_rows or {}))
    lines = ["ImageId,PredictionString"]
    for image_id in sorted(rows, reverse=True):  # unsorted on purpose: order must not matter
        w = rows[image_id]
        lines.append(f"{image_id},{w} 10 12 30 28 {w} 1 2 20 20 ")
    Path(path).write_text("\n".join(lines) + "\n")
