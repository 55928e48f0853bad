"""Encoded image bytes -> float32 tensors, with PIL + numpy only.

Decoding (:func:`decode_image`): PIL, ``convert("RGB")`` (grayscale, CMYK, RGBA,
palette, PNG bytes in a ``.JPEG`` name all work), then the torchvision eval
transform: resize shorter side to ``resize_size`` (bilinear, antialias), center
crop ``image_size``, ToTensor (/255), Normalize(mean, std) -> float32 [3, H, W],
bit-identical to ``transforms.Compose([Resize, CenterCrop, ToTensor, Normalize])``
but written with PIL + numpy (:func:`eval_transform`), so Ray decode workers import
neither torch nor torchvision (~170 MB per worker instead of ~800 MB).
Undecodable bytes (corrupt / truncated JPEG, empty file, non-image) give
``valid=False`` and a zero image so batches keep their shape. A file that cannot
be *read* (missing, permissions, network) raises: that is not a bad image.

Distribution shift (``corruption=(name, severity, seed)``): the ImageNet-C-style corruption of
:mod:`pipelines.ingest.corruptions` is applied to the uint8 crop, before ToTensor and
Normalize, with the image's own generator (keyed by its path).

:func:`read_decode_batch` turns one batch of index rows (path, label, shard, row) into the
decoded columns; :mod:`pipelines.ingest.batches` runs it in Ray Data tasks or in-process.
"""
from __future__ import annotations

import io
import re
import warnings
from typing import Sequence

import numpy as np

from pipelines.ingest.index import IMAGENET_MEAN, IMAGENET_STD, DataError
from pipelines.storage import uris as storage

__all__ = ["eval_transform", "decode_image", "read_files", "read_parquet_rows", "read_decode_batch"]


def eval_transform(
    img, image_size: int = 224, resize_size: int = 256, mean=IMAGENET_MEAN, std=IMAGENET_STD, corrupt=None
) -> np.ndarray:
    """RGB PIL image -> float32 [3, image_size, image_size], numerically identical to
    ``transforms.Compose([Resize(resize_size), CenterCrop(image_size), ToTensor(), Normalize(mean, std)])``
    on a PIL image (torchvision 0.2x semantics, re-stated here so decode workers need no torch):

    Resize: shorter side -> resize_size, longer -> int(resize_size * long / short), PIL
    bilinear (antialiased), skipped when the size already matches. CenterCrop: zero-pad to
    the crop size if smaller, then top = round((H - c) / 2) (Python rounding), same for left.
    ToTensor: HWC uint8 -> CHW float32 / 255. Normalize: (x - mean) / std in float32.
    ``corrupt``: optional uint8 HWC -> uint8 HWC function applied to the crop before ToTensor.
    """
    from PIL import Image

    w, h = img.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = resize_size, int(resize_size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    if (new_w, new_h) != (w, h):
        img = img.resize((new_w, new_h), Image.BILINEAR)
    a = np.asarray(img, dtype=np.uint8)  # [H, W, 3]
    c = image_size
    H, W = a.shape[:2]
    if c > W or c > H:
        pad_w, pad_h = max(c - W, 0), max(c - H, 0)
        a = np.pad(a, ((pad_h // 2, (pad_h + 1) // 2), (pad_w // 2, (pad_w + 1) // 2), (0, 0)))
        H, W = a.shape[:2]
    top, left = int(round((H - c) / 2.0)), int(round((W - c) / 2.0))
    a = a[top : top + c, left : left + c]
    if corrupt is not None:
        a = corrupt(np.ascontiguousarray(a))
    x = a.transpose(2, 0, 1).astype(np.float32) / np.float32(255)
    m = np.asarray(mean, dtype=np.float32).reshape(3, 1, 1)
    sd = np.asarray(std, dtype=np.float32).reshape(3, 1, 1)
    return np.ascontiguousarray((x - m) / sd, dtype=np.float32)


def decode_image(
    data: bytes, image_size: int = 224, resize_size: int = 256, mean=IMAGENET_MEAN, std=IMAGENET_STD, corrupt=None
) -> tuple[np.ndarray | None, str]:
    """Encoded bytes -> (float32 [3, image_size, image_size] array, "") or (None, reason);
    ``corrupt``: see :func:`eval_transform`."""
    from PIL import Image

    if not data:
        return None, "empty file"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as im:
                im.load()
                rgb = im.convert("RGB")
        x = eval_transform(rgb, image_size, resize_size, mean, std, corrupt)
    except Exception as e:  # any decoder failure = a bad image, counted by the consumer
        msg = str(e).splitlines()[0] if str(e) else ""
        msg = re.sub(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "<bytes>", msg)
        return None, f"{type(e).__name__}: {msg}"[:200]
    return x, ""


def read_files(root: str, paths: Sequence[str], options: storage.Store) -> list[bytes]:
    """The bytes of ``root/<path>`` for each of ``paths``, in order (one concurrent ``cat``);
    a file that cannot be read raises DataError (that is not a bad image)."""
    fs, base = storage.get_fs(root, options)
    full = [base + "/" + p for p in paths]
    got = fs.cat(full, on_error="return") if full else {}  # list in -> dict out (s3fs: concurrent GETs)
    out = []
    for p, f in zip(paths, full):
        v = got.get(f)
        if isinstance(v, BaseException) or v is None:
            raise DataError(f"cannot read {storage.join(root, p)}: {v!r}")
        out.append(bytes(v))
    return out


def read_parquet_rows(root: str, shards: Sequence[str], rows: Sequence[int], options: storage.Store) -> list[bytes]:
    """The ``image`` bytes of row ``rows[i]`` of shard ``root/shards[i]``, in order (b"" for a
    null); each shard is opened once and only the row groups holding wanted rows are read."""
    import pyarrow.parquet as pq

    fs, base = storage.get_fs(root, options)
    out: list[bytes | None] = [None] * len(rows)
    by_shard: dict[str, list[int]] = {}
    for i, s in enumerate(shards):
        by_shard.setdefault(s, []).append(i)
    for shard, idx in by_shard.items():
        with fs.open(base + "/" + shard, "rb") as f:
            pf = pq.ParquetFile(f)
            md = pf.metadata
            starts = np.cumsum([0] + [md.row_group(g).num_rows for g in range(md.num_row_groups)])
            want = sorted({int(rows[i]) for i in idx})
            groups = sorted({int(np.searchsorted(starts, r, side="right") - 1) for r in want})
            table = pf.read_row_groups(groups, columns=["image"])
            offset, pos = {}, 0
            for g in groups:
                offset[g] = pos
                pos += md.row_group(g).num_rows
            col = table.column("image")
            for i in idx:
                r = int(rows[i])
                g = int(np.searchsorted(starts, r, side="right") - 1)
                v = col[offset[g] + r - int(starts[g])].as_py()
                out[i] = b"" if v is None else bytes(v)
    return out  # type: ignore[return-value]


def _corrupter(corruption: tuple[str, int, int] | None, path: str):
    """The uint8 -> uint8 corruption of the image at ``path`` (None: no corruption)."""
    if corruption is None:
        return None
    from pipelines.ingest.corruptions import corrupt, corruption_rng

    name, severity, seed = corruption
    rng = corruption_rng(seed, name, path)
    return lambda a: corrupt(a, name, severity, rng)


def read_decode_batch(
    batch: dict[str, np.ndarray],
    *,
    root: str,
    format: str,
    options: storage.Store = None,
    image_size: int = 224,
    resize_size: int = 256,
    mean=IMAGENET_MEAN,
    std=IMAGENET_STD,
    corruption: tuple[str, int, int] | None = None,
) -> dict[str, np.ndarray]:
    """One batch of index rows (path, label, shard, row) -> decoded columns.

    Output: image float32 [B, 3, image_size, image_size] (zeros where invalid),
    label int64 [B], path str [B] (relative to root), valid bool [B], error str [B]
    ("" when valid). Used by ``build_dataset`` (Ray ``map_batches``) and
    ``iter_local_batches`` alike. ``corruption=(name, severity, seed)``: every image is
    corrupted (:mod:`pipelines.ingest.corruptions`, its generator keyed by its path).
    """
    paths = [str(p) for p in batch["path"]]
    n = len(paths)
    if format == "parquet":
        raw = read_parquet_rows(root, [str(s) for s in batch["shard"]], [int(r) for r in batch["row"]], options)
    else:
        raw = read_files(root, paths, options) if n else []
    images = np.zeros((n, 3, image_size, image_size), dtype=np.float32)
    valid = np.zeros(n, dtype=bool)
    errors = []
    for i, data in enumerate(raw):
        x, err = decode_image(data, image_size, resize_size, mean, std, _corrupter(corruption, paths[i]))
        if x is not None:
            images[i] = x
            valid[i] = True
        errors.append(err)
    return {
        "image": images,
        "label": np.asarray(batch["label"], dtype=np.int64),
        "path": np.asarray(paths, dtype=object),
        "valid": valid,
        "error": np.asarray(errors, dtype=object),
    }

