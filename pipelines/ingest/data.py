"""Images -> fixed partitions -> Ray Data -> (x, y) batches on Ray Train workers.

Flow (all listing happens on the driver, before any cluster work)::

    index = scan(cfg)                       # DatasetIndex: classes, sorted files, labels, counts
    parts = partition(index, partition_size=cfg.partition_size)   # stable Partition list
    ds    = build_dataset(parts[i], cfg)    # ray.data.Dataset: image f32[3,H,W], label i64, path, valid
    TorchTrainer(loop, datasets={"train": ds}, dataset_config=exact_split_data_config(), ...)
    # (Ray Train's default split DROPS rows to equalise shards; this one does not)
    # inside a Ray Train worker (loop):
    vb = ValidBatches(ray.train.get_dataset_shard("train"), batch_size=32, device=dev)
    for x, y in vb: ...                     # invalid images dropped; vb.skipped is a SkipReport

Layouts (``cfg.root`` + ``cfg.split``; ``split=None`` means root is the split dir):

- ImageFolder / ImageNet: ``<split>/<wnid>/**/<file>``. Class index = position in
  the sorted class list (torchvision's ``ImageFolder`` order). The class list is
  the sorted folder names, or ``cfg.classes`` / ``cfg.classes_file`` when given
  (then every folder must be in it). Classes without files are kept (their index
  stays reserved, so labels align with the model's outputs) and reported in
  ``DatasetIndex.empty_classes``. Every non-hidden file under a class folder is
  an entry (a ``.txt`` there becomes an invalid image, counted, never silently
  dropped), unless ``cfg.extensions`` restricts the suffixes.
- Flat validation dir: ``<split>/*.JPEG`` plus an ImageNet ``LOC_val_solution.csv``
  style CSV (``ImageId,PredictionString``; the first token of PredictionString
  is the wnid; ImageId = file name without extension). The class list is
  ``cfg.classes``/``classes_file`` or the folder names of the sibling ``train/``.
  The CSV is ``cfg.labels_csv`` or ``LOC_val_solution.csv`` found in the split
  dir, its parent or grandparent.
- Parquet shards (``<split>/*.parquet``, or one ``.parquet`` file as root): columns
  ``image`` (encoded bytes), ``label`` (int), optional ``path``; the class list
  comes from ``dataset.json`` beside the shards (written by ``convert_to_parquet``),
  the shards' schema metadata, or ``cfg.classes``.
- ``cfg.unlabeled=True`` (OOD sets): every file under the split dir, label -1, no classes.

Determinism: files are sorted by their path relative to the split dir; the
``per_class`` and ``limit`` subsets keep the files with the smallest
SHA-1(relative path), so a local copy and an ``s3://`` copy give the same subset,
independent of any random state.

Decoding (``decode_image``): PIL, ``convert("RGB")`` (grayscale, CMYK, RGBA,
palette, PNG bytes in a ``.JPEG`` name all work), then the torchvision eval
transform: resize shorter side to ``resize_size`` (bilinear, antialias), center
crop ``image_size``, ToTensor (/255), Normalize(mean, std) -> float32 [3, H, W],
bit-identical to ``transforms.Compose([Resize, CenterCrop, ToTensor, Normalize])``
but written with PIL + numpy (``eval_transform``), so Ray decode workers import
neither torch nor torchvision (~170 MB per worker instead of ~800 MB).
Undecodable bytes (corrupt / truncated JPEG, empty file, non-image) give
``valid=False`` and a zero image so batches keep their shape. A file that cannot
be *read* (missing, permissions, network) raises: that is not a bad image.
"""
from __future__ import annotations

import csv
import hashlib
import io
import math
import os
import posixpath
import re
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from pipelines.storage import uris as storage

if TYPE_CHECKING:  # pragma: no cover
    import ray.data
    import torch

__all__ = [
    "MIN_DECODE_TASKS",
    "rank_share",
    "decode_batch",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "FORMATS",
    "DataError",
    "DataConfig",
    "DatasetIndex",
    "Partition",
    "SkipReport",
    "Batch",
    "ValidBatches",
    "scan",
    "partition",
    "decode_image",
    "eval_transform",
    "read_decode_batch",
    "build_dataset",
    "iter_local_batches",
    "iter_valid_batches",
    "convert_to_parquet",
    "exact_split_data_config",
    "PARQUET_META_FILE",
]

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

#: ``DataConfig.format`` values.
FORMATS: dict[str, str] = {
    "auto": "parquet if the split dir holds *.parquet files, else imagefolder",
    "imagefolder": "<split>/<class>/**/file, or flat <split>/file + labels CSV",
    "parquet": "<split>/*.parquet with columns image (bytes), label (int), optional path",
}

#: Name of the JSON written next to Parquet shards by ``convert_to_parquet``.
PARQUET_META_FILE = "dataset.json"
_PARQUET_CLASSES_KEY = b"infoform.classes"
_LOC_CSV = "LOC_val_solution.csv"
#: How many example paths a SkipReport keeps.
MAX_SKIP_EXAMPLES = 10


class DataError(ValueError):
    """Bad dataset location, layout or labels (one line saying what is wrong)."""


# --------------------------------------------------------------------------- config


def _opt_pos_int(name: str, v: Any) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"DataConfig.{name} must be a positive int or None, got {v!r}")


@dataclass(frozen=True)
class DataConfig:
    """Where the images are and how they are turned into tensors.

    root: local path, ``file://`` or ``s3://`` URI. split: sub-directory of root
    (None/"" = root is the split dir). image_size / resize_size: center crop and
    shorter-side resize (pixels). mean/std: per-channel Normalize. limit: keep at
    most this many files; per_class: at most this many per class (both
    deterministic, see module doc). labels_csv: flat-val label CSV.
    classes / classes_file: explicit class list (wnids; a text file takes the
    first token of each non-empty line, e.g. ``LOC_synset_mapping.txt``); always
    used in sorted order. extensions: keep only these suffixes (case-insensitive,
    e.g. (".jpeg", ".jpg")); None keeps every non-hidden file. unlabeled: no
    labels (-1). endpoint_url: S3-compatible endpoint. num_partitions /
    partition_size: default partitioning for ``partition`` (at most one).
    decode_batch_size: most images per decode task batch (fewer when the source has
    fewer than ``MIN_DECODE_TASKS`` batches' worth, so that small partitions still
    spread over the workers); 128 decoded 1.35x faster than 32 (Ray Data's cost per
    block; 500x375 JPEGs to 224, 2 CPUs: 295-312 vs 210-230 images/s; 64: 272,
    256: 277-285). decode_num_cpus: CPUs per Ray decode task.
    """

    root: str
    split: str | None = "train"
    image_size: int = 224
    resize_size: int = 256
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    limit: int | None = None
    per_class: int | None = None
    labels_csv: str | None = None
    classes: tuple[str, ...] | None = None
    classes_file: str | None = None
    extensions: tuple[str, ...] | None = None
    unlabeled: bool = False
    format: str = "auto"
    endpoint_url: str | None = None
    num_partitions: int | None = None
    partition_size: int | None = None
    decode_batch_size: int = 128
    decode_num_cpus: float = 1.0

    def __post_init__(self) -> None:
        if not self.root or not isinstance(self.root, (str, os.PathLike)):
            raise ValueError(f"DataConfig.root must be a non-empty path or URI, got {self.root!r}")
        object.__setattr__(self, "root", os.fspath(self.root))
        if self.format not in FORMATS:
            raise ValueError(f"unknown data format {self.format!r}; valid: {', '.join(FORMATS)}")
        for name in ("image_size", "resize_size", "decode_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DataConfig.{name} must be a positive int, got {v!r}")
        for name in ("limit", "per_class", "num_partitions", "partition_size"):
            _opt_pos_int(name, getattr(self, name))
        if self.num_partitions is not None and self.partition_size is not None:
            raise ValueError("DataConfig: give num_partitions or partition_size, not both")
        for name in ("mean", "std"):
            v = tuple(float(t) for t in getattr(self, name))
            if len(v) != 3 or not all(math.isfinite(t) for t in v):
                raise ValueError(f"DataConfig.{name} must be 3 finite floats, got {getattr(self, name)!r}")
            object.__setattr__(self, name, v)
        if any(s <= 0 for s in self.std):
            raise ValueError(f"DataConfig.std must be positive, got {self.std!r}")
        if self.classes is not None:
            object.__setattr__(self, "classes", tuple(str(c) for c in self.classes))
        if self.extensions is not None:
            exts = tuple(e.lower() if e.startswith(".") else "." + e.lower() for e in self.extensions)
            object.__setattr__(self, "extensions", exts)
        if not (self.decode_num_cpus > 0):
            raise ValueError(f"DataConfig.decode_num_cpus must be > 0, got {self.decode_num_cpus!r}")

    @property
    def split_uri(self) -> str:
        """The URI the split is expected at (before existence checks)."""
        return storage.join(self.root, self.split) if self.split else self.root


# --------------------------------------------------------------------------- index / partitions


def fingerprint(classes: Sequence[str], paths: Sequence[str], labels: Sequence[int]) -> str:
    h = hashlib.sha256()
    h.update(("\x1f".join(classes) + "\x1e").encode())
    for p, y in zip(paths, labels):
        h.update(f"{p}\t{int(y)}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True, repr=False)
class _Entries:
    """Shared reading fields of DatasetIndex and Partition.

    root: split-dir URI (or the parquet dir). paths: relative to root, sorted.
    labels: class indices (-1 unlabeled). shards / locations: parquet only:
    shard file names (relative to root) and (shard index, row) per entry.
    """

    root: str
    format: str
    classes: tuple[str, ...]
    paths: tuple[str, ...]
    labels: tuple[int, ...]
    shards: tuple[str, ...] = ()
    locations: tuple[tuple[int, int], ...] = ()

    def __len__(self) -> int:
        return len(self.paths)

    def items(self) -> list[dict[str, Any]]:
        """Rows for ``ray.data.from_items``: path, label, shard ("" unless parquet), row (-1)."""
        if self.format == "parquet":
            return [
                {"path": p, "label": int(y), "shard": self.shards[s], "row": int(r)}
                for p, y, (s, r) in zip(self.paths, self.labels, self.locations)
            ]
        return [{"path": p, "label": int(y), "shard": "", "row": -1} for p, y in zip(self.paths, self.labels)]

    def uri(self, path: str) -> str:
        """Full URI of an entry (imagefolder)."""
        return storage.join(self.root, path)

    def __repr__(self) -> str:  # short: an index may hold 1.28M paths
        extra = f" id={self.id}/{self.num_partitions}" if isinstance(self, Partition) else ""
        return (
            f"{type(self).__name__}(root={self.root!r}, format={self.format!r}, "
            f"classes={len(self.classes)}, files={len(self.paths)}{extra})"
        )


@dataclass(frozen=True, repr=False)
class DatasetIndex(_Entries):
    """Result of ``scan``: what the data is, listed once on the driver.

    classes: sorted class names (wnids), index = label. class_counts[c]: entries
    with label c in this index (after subsets). empty_classes: classes with no
    file on storage. num_scanned: entries before ``limit``/``per_class``.
    ignored: files skipped by the layout (top-level files next to class folders,
    suffixes not in ``extensions``). unmatched_label_rows: CSV rows with no file.
    fingerprint: SHA-256 over classes + (path, label) list.
    """

    class_counts: tuple[int, ...] = ()
    empty_classes: tuple[str, ...] = ()
    num_scanned: int = 0
    ignored: int = 0
    unmatched_label_rows: int = 0
    fingerprint: str = ""

    def summary(self) -> dict[str, Any]:
        """JSON-able summary (no file list) for run.json."""
        return {
            "root": self.root,
            "format": self.format,
            "num_classes": len(self.classes),
            "num_files": len(self.paths),
            "num_scanned": self.num_scanned,
            "empty_classes": list(self.empty_classes),
            "ignored_files": self.ignored,
            "unmatched_label_rows": self.unmatched_label_rows,
            "fingerprint": self.fingerprint,
        }


@dataclass(frozen=True, repr=False)
class Partition(_Entries):
    """A fixed slice of a DatasetIndex: ``id`` in [0, num_partitions), a contiguous
    run of the index's sorted entries; ``fingerprint`` (SHA-256 of its
    classes + (path, label) list) lets a re-run detect a changed partition;
    ``name`` is ``part-<id:05d>-of-<n:05d>``."""

    id: int = 0
    num_partitions: int = 1
    fingerprint: str = ""

    @property
    def name(self) -> str:
        return f"part-{self.id:05d}-of-{self.num_partitions:05d}"


def rank_share(source: "DatasetIndex | Partition", rank: int, world: int):
    """Entries ``rank, rank + world, ...`` of ``source`` (the same type), or ``None`` when there
    are none: the deterministic share of one of ``world`` workers that read ``source`` side by
    side (the shares are disjoint and together are ``source``)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    if rank >= len(source):
        return None
    kw: dict[str, Any] = {"paths": source.paths[rank::world], "labels": source.labels[rank::world]}
    if source.locations:
        kw["locations"] = tuple(source.locations[rank::world])
    return replace(source, **kw)


def partition(
    index: DatasetIndex, num_partitions: int | None = None, partition_size: int | None = None
) -> list[Partition]:
    """Split ``index`` into fixed, contiguous partitions of its sorted entries.

    ``num_partitions=k``: sizes differ by at most one (the first ``len % k`` get one
    more, as ``numpy.array_split``). ``partition_size=s``: ``ceil(len/s)`` partitions
    of ``s`` (the last one shorter). Neither: one partition. Same index -> same
    partitions (ids, files, fingerprints) on every run.
    """
    if num_partitions is not None and partition_size is not None:
        raise ValueError("partition: give num_partitions or partition_size, not both")
    _opt_pos_int("num_partitions", num_partitions)
    _opt_pos_int("partition_size", partition_size)
    n = len(index)
    if n == 0:
        raise DataError("cannot partition an empty index")
    if partition_size is not None:
        bounds = [(s, min(s + partition_size, n)) for s in range(0, n, partition_size)]
    else:
        k = num_partitions or 1
        if k > n:
            raise ValueError(f"num_partitions={k} exceeds the number of files ({n})")
        q, r = divmod(n, k)
        bounds, start = [], 0
        for i in range(k):
            end = start + q + (1 if i < r else 0)
            bounds.append((start, end))
            start = end
    out = []
    for i, (a, b) in enumerate(bounds):
        paths, labels = index.paths[a:b], index.labels[a:b]
        out.append(
            Partition(
                root=index.root,
                format=index.format,
                classes=index.classes,
                paths=paths,
                labels=labels,
                shards=index.shards,
                locations=index.locations[a:b] if index.locations else (),
                id=i,
                num_partitions=len(bounds),
                fingerprint=fingerprint(index.classes, paths, labels),
            )
        )
    return out


# --------------------------------------------------------------------------- scanning


def _hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/"))


def _walk(uri: str, endpoint_url: str | None) -> tuple[set[str], list[str]]:
    """(relative dirs, relative files) under ``uri``, recursively, hidden entries dropped."""
    fs, base = storage.get_fs(uri, endpoint_url)
    dirs: set[str] = set()
    files: list[str] = []
    if not storage.is_remote(uri):
        for cur, dnames, fnames in os.walk(base, followlinks=True):
            rel_dir = os.path.relpath(cur, base).replace(os.sep, "/")
            rel_dir = "" if rel_dir == "." else rel_dir
            dnames[:] = [d for d in dnames if not d.startswith(".")]
            for d in dnames:
                dirs.add(posixpath.join(rel_dir, d) if rel_dir else d)
            for f in fnames:
                if not f.startswith("."):
                    files.append(posixpath.join(rel_dir, f) if rel_dir else f)
        return dirs, files
    # object store: one recursive listing of keys (no per-entry detail dicts: 1.28M keys stay cheap);
    # folders are the key prefixes, plus "dir/" marker objects (how empty folders exist on S3)
    prefix = base.rstrip("/") + "/"
    for name in fs.find(base, withdirs=False, detail=False):
        if not name.startswith(prefix):
            continue
        rel = name[len(prefix):]
        is_marker = rel.endswith("/")
        rel = rel.rstrip("/")
        if not rel or _hidden(rel):
            continue
        parts = rel.split("/")
        for i in range(1, len(parts) if not is_marker else len(parts) + 1):
            dirs.add("/".join(parts[:i]))
        if not is_marker:
            files.append(rel)
    return dirs, files


def _split_dir(cfg: DataConfig) -> str:
    ep = cfg.endpoint_url
    if not storage.exists(cfg.root, ep):
        raise DataError(f"data root does not exist: {cfg.root}")
    if not cfg.split:
        return cfg.root.rstrip("/") or cfg.root
    cand = storage.join(cfg.root, cfg.split)
    if storage.exists(cand, ep):
        return cand
    if posixpath.basename(cfg.root.rstrip("/")) == cfg.split:
        return cfg.root.rstrip("/")
    found = storage.listdir(cfg.root, ep) if storage.isdir(cfg.root, ep) else []
    shown = ", ".join(found[:8]) + (", ..." if len(found) > 8 else "")
    raise DataError(f"no split {cfg.split!r} under {cfg.root} (found: {shown or 'nothing'})")


def _explicit_classes(cfg: DataConfig) -> tuple[str, ...] | None:
    names: list[str] | None = None
    if cfg.classes is not None:
        names = list(cfg.classes)
    if cfg.classes_file is not None:
        try:
            text = storage.read_bytes(cfg.classes_file, cfg.endpoint_url).decode("utf-8-sig")
        except FileNotFoundError:
            raise DataError(f"classes_file does not exist: {cfg.classes_file}") from None
        from_file = [ln.split()[0] for ln in text.splitlines() if ln.strip()]
        if names is not None and sorted(set(names)) != sorted(set(from_file)):
            raise DataError("classes and classes_file disagree; give one of them")
        names = from_file
    if names is None:
        return None
    if not names:
        raise DataError("the explicit class list is empty")
    uniq = sorted(set(names))
    if len(uniq) != len(names):
        raise DataError(f"the class list has {len(names) - len(uniq)} duplicate name(s)")
    return tuple(uniq)


def _ext_ok(rel: str, cfg: DataConfig) -> bool:
    return cfg.extensions is None or posixpath.splitext(rel)[1].lower() in cfg.extensions


def _stem(rel: str) -> str:
    return posixpath.splitext(posixpath.basename(rel))[0]


def _find_labels_csv(split_uri: str, cfg: DataConfig) -> str | None:
    if cfg.labels_csv:
        if not storage.exists(cfg.labels_csv, cfg.endpoint_url):
            raise DataError(f"labels_csv does not exist: {cfg.labels_csv}")
        return cfg.labels_csv
    cand = split_uri.rstrip("/")
    for _ in range(3):
        uri = storage.join(cand, _LOC_CSV)
        if storage.exists(uri, cfg.endpoint_url):
            return uri
        parent = posixpath.dirname(cand)
        if not parent or parent == cand or parent.endswith(":/"):
            break
        cand = parent
    return None


def _read_label_csv(uri: str, endpoint_url: str | None) -> dict[str, str]:
    """ImageId -> wnid (first token of PredictionString)."""
    text = storage.read_bytes(uri, endpoint_url).decode("utf-8-sig")
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None:
        raise DataError(f"labels CSV is empty: {uri}")
    cols = {h.strip().lower(): i for i, h in enumerate(header)}
    if "imageid" not in cols or "predictionstring" not in cols:
        raise DataError(f"labels CSV {uri} needs columns ImageId,PredictionString; header is {header!r}")
    i_id, i_pred = cols["imageid"], cols["predictionstring"]
    out: dict[str, str] = {}
    for lineno, row in enumerate(reader, start=2):
        if not row or not any(c.strip() for c in row):
            continue
        if len(row) <= max(i_id, i_pred):
            raise DataError(f"labels CSV {uri} line {lineno}: expected {len(header)} columns, got {len(row)}")
        image_id, tokens = row[i_id].strip(), row[i_pred].split()
        if not image_id or not tokens:
            raise DataError(f"labels CSV {uri} line {lineno}: empty ImageId or PredictionString")
        if image_id in out and out[image_id] != tokens[0]:
            raise DataError(f"labels CSV {uri}: ImageId {image_id!r} has two labels ({out[image_id]}, {tokens[0]})")
        out[image_id] = tokens[0]
    if not out:
        raise DataError(f"labels CSV has no rows: {uri}")
    return out


def _sibling_train_classes(split_uri: str, endpoint_url: str | None) -> tuple[str, ...] | None:
    parent = posixpath.dirname(split_uri.rstrip("/"))
    if not parent:
        return None
    train = storage.join(parent, "train")
    if train.rstrip("/") == split_uri.rstrip("/") or not storage.isdir(train, endpoint_url):
        return None
    fs, path = storage.get_fs(train, endpoint_url)
    names = [
        posixpath.basename(e["name"].rstrip("/"))
        for e in fs.ls(path, detail=True)
        if e.get("type") == "directory"
    ]
    names = sorted(n for n in names if n and not n.startswith("."))
    return tuple(names) or None


def _examples(items: Iterable[str], k: int = 3) -> str:
    items = sorted(items)
    return ", ".join(items[:k]) + (", ..." if len(items) > k else "")


def _scan_folders(split_uri: str, cfg: DataConfig):
    """(classes, rel files, labels, num ignored, num unmatched CSV rows) for folder / flat layouts."""
    dirs, files = _walk(split_uri, cfg.endpoint_url)
    top_dirs = sorted(d for d in dirs if "/" not in d)
    nested = [f for f in files if "/" in f]
    top_files = [f for f in files if "/" not in f]
    ignored = 0
    unmatched = 0
    if cfg.unlabeled:
        keep = [f for f in files if _ext_ok(f, cfg)]
        ignored = len(files) - len(keep)
        return (), keep, [-1] * len(keep), ignored, 0
    explicit = _explicit_classes(cfg)
    if top_dirs:  # ImageFolder
        classes = explicit if explicit is not None else tuple(top_dirs)
        if explicit is not None:
            unknown = [d for d in top_dirs if d not in set(explicit)]
            if unknown:
                raise DataError(
                    f"{len(unknown)} class folder(s) under {split_uri} are not in the class list: {_examples(unknown)}"
                )
        lookup = {c: i for i, c in enumerate(classes)}
        keep = [f for f in nested if _ext_ok(f, cfg)]
        ignored = len(top_files) + len(nested) - len(keep)
        labels = [lookup[f.split("/", 1)[0]] for f in keep]
        return classes, keep, labels, ignored, unmatched
    # flat directory of files + labels CSV
    if not top_files:
        raise DataError(f"no files under {split_uri}")
    csv_uri = _find_labels_csv(split_uri, cfg)
    if csv_uri is None:
        raise DataError(
            f"{split_uri} has no class folders; pass labels_csv ({_LOC_CSV} style) or unlabeled=True"
        )
    classes = explicit if explicit is not None else _sibling_train_classes(split_uri, cfg.endpoint_url)
    if classes is None:
        raise DataError(
            f"flat split {split_uri} needs the class list: pass classes/classes_file or keep a sibling train/ dir"
        )
    id_to_wnid = _read_label_csv(csv_uri, cfg.endpoint_url)
    csv_name = posixpath.basename(csv_uri.rstrip("/"))
    keep = [f for f in top_files if _ext_ok(f, cfg) and f != csv_name and not f.lower().endswith(".csv")]
    ignored = len(top_files) - len(keep)
    stems: dict[str, str] = {}
    for f in keep:
        s = _stem(f)
        if s in stems:
            raise DataError(f"two files share the image id {s!r}: {stems[s]}, {f}")
        stems[s] = f
    missing = [f for f in keep if _stem(f) not in id_to_wnid]
    if missing:
        raise DataError(f"{len(missing)} file(s) in {split_uri} have no row in {csv_uri}: {_examples(missing)}")
    lookup = {c: i for i, c in enumerate(classes)}
    unknown = sorted({w for w in id_to_wnid.values() if w not in lookup})
    if unknown:
        raise DataError(f"labels CSV {csv_uri} names {len(unknown)} wnid(s) not in the class list: {_examples(unknown)}")
    labels = [lookup[id_to_wnid[_stem(f)]] for f in keep]
    unmatched = len(set(id_to_wnid) - set(stems))
    return classes, keep, labels, ignored, unmatched


def _parquet_files(split_uri: str, endpoint_url: str | None) -> tuple[str, list[str]]:
    """(parquet dir URI, shard names relative to it)."""
    if split_uri.rstrip("/").lower().endswith(".parquet") and not storage.isdir(split_uri, endpoint_url):
        base = posixpath.dirname(split_uri.rstrip("/"))
        return base, [posixpath.basename(split_uri.rstrip("/"))]
    names = [n for n in storage.listdir(split_uri, endpoint_url) if n.lower().endswith(".parquet") and not n.startswith(".")]
    return split_uri, names


def _scan_parquet(split_uri: str, cfg: DataConfig):
    import pyarrow.parquet as pq

    base, shards = _parquet_files(split_uri, cfg.endpoint_url)
    if not shards:
        raise DataError(f"no .parquet files under {split_uri}")
    classes = _explicit_classes(cfg)
    meta_uri = storage.join(base, PARQUET_META_FILE)
    if classes is None and storage.exists(meta_uri, cfg.endpoint_url):
        meta = storage.read_json(meta_uri, cfg.endpoint_url)
        classes = tuple(meta.get("classes") or ()) or None
    fs, fs_base = storage.get_fs(base, cfg.endpoint_url)
    paths: list[str] = []
    labels: list[int] = []
    locations: list[tuple[int, int]] = []
    for si, shard in enumerate(shards):
        with fs.open(fs_base + "/" + shard, "rb") as f:
            pf = pq.ParquetFile(f)
            names = pf.schema_arrow.names
            for col in ("image", "label"):
                if col not in names:
                    raise DataError(f"parquet shard {shard} has no {col!r} column (columns: {names})")
            if classes is None and not cfg.unlabeled:
                md = pf.schema_arrow.metadata or {}
                if _PARQUET_CLASSES_KEY in md:
                    import json

                    classes = tuple(json.loads(md[_PARQUET_CLASSES_KEY].decode()))
            cols = ["label"] + (["path"] if "path" in names else [])
            table = pf.read(columns=cols)
        lab = table.column("label").to_pylist()
        pth = table.column("path").to_pylist() if "path" in cols else [f"{shard}#{r}" for r in range(len(lab))]
        for r, (p, y) in enumerate(zip(pth, lab)):
            if p is None or y is None:
                raise DataError(f"parquet shard {shard} row {r} has a null path or label")
            paths.append(str(p))
            labels.append(int(y))
            locations.append((si, r))
    if cfg.unlabeled:
        classes, labels = (), [-1] * len(labels)
    elif classes is None:
        raise DataError(f"parquet data at {base} has no class list ({PARQUET_META_FILE} or schema metadata); pass classes")
    else:
        bad = [y for y in labels if not 0 <= y < len(classes)]
        if bad:
            raise DataError(f"parquet labels out of range [0, {len(classes)}): e.g. {sorted(set(bad))[:3]}")
    if len(set(paths)) != len(paths):
        raise DataError(f"parquet data at {base} has duplicate path values")
    return base, tuple(classes), paths, labels, tuple(shards), locations


def _subset_order(path: str) -> str:
    return hashlib.sha1(path.encode()).hexdigest()


def scan(cfg: DataConfig) -> DatasetIndex:
    """List the dataset on the driver and return its frozen DatasetIndex (see module doc).

    Raises DataError (one line) for: a missing root or split, no files, a labels
    CSV that misses files or names unknown wnids, class folders outside an
    explicit class list, parquet shards without the needed columns / classes.
    """
    split_uri = _split_dir(cfg)
    if not storage.is_remote(split_uri):
        split_uri = storage.get_fs(split_uri)[1]  # absolute local path: Ray workers may run elsewhere
    fmt = cfg.format
    if fmt == "auto":
        _, pq_files = _parquet_files(split_uri, cfg.endpoint_url)
        fmt = "parquet" if pq_files else "imagefolder"
    shards: tuple[str, ...] = ()
    if fmt == "parquet":
        split_uri, classes, paths, labels, shards, locations = _scan_parquet(split_uri, cfg)
        ignored = unmatched = 0
    else:
        classes, paths, labels, ignored, unmatched = _scan_folders(split_uri, cfg)
        locations = []
    if not paths:
        raise DataError(f"no image files found under {split_uri}")
    scanned_counts = [0] * len(classes)
    for y in labels:
        if y >= 0:
            scanned_counts[y] += 1
    empty = tuple(c for c, n in zip(classes, scanned_counts) if n == 0)
    num_scanned = len(paths)
    order = list(range(len(paths)))
    if cfg.per_class is not None:
        groups: dict[int, list[int]] = {}
        for i in order:
            groups.setdefault(labels[i], []).append(i)
        order = [i for g in groups.values() for i in sorted(g, key=lambda j: _subset_order(paths[j]))[: cfg.per_class]]
    if cfg.limit is not None and len(order) > cfg.limit:
        order = sorted(order, key=lambda j: _subset_order(paths[j]))[: cfg.limit]
    order.sort(key=lambda j: paths[j])
    sel_paths = tuple(paths[i] for i in order)
    sel_labels = tuple(int(labels[i]) for i in order)
    counts = [0] * len(classes)
    for y in sel_labels:
        if y >= 0:
            counts[y] += 1
    return DatasetIndex(
        root=split_uri.rstrip("/") or split_uri,
        format=fmt,
        classes=tuple(classes),
        paths=sel_paths,
        labels=sel_labels,
        shards=shards,
        locations=tuple(locations[i] for i in order) if locations else (),
        class_counts=tuple(counts),
        empty_classes=empty,
        num_scanned=num_scanned,
        ignored=ignored,
        unmatched_label_rows=unmatched,
        fingerprint=fingerprint(classes, sel_paths, sel_labels),
    )


# --------------------------------------------------------------------------- decoding


def eval_transform(
    img, image_size: int = 224, resize_size: int = 256, mean=IMAGENET_MEAN, std=IMAGENET_STD
) -> np.ndarray:
    """RGB PIL image -> float32 [3, image_size, image_size], numerically identical to
    ``transforms.Compose([Resize(resize_size), CenterCrop(image_size), ToTensor(), Normalize(mean, std)])``
    on a PIL image (torchvision 0.2x semantics, re-stated here so decode workers need no torch):

    Resize: shorter side -> resize_size, longer -> int(resize_size * long / short), PIL
    bilinear (antialiased), skipped when the size already matches. CenterCrop: zero-pad to
    the crop size if smaller, then top = round((H - c) / 2) (Python rounding), same for left.
    ToTensor: HWC uint8 -> CHW float32 / 255. Normalize: (x - mean) / std in float32.
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
    x = a[top : top + c, left : left + c].transpose(2, 0, 1).astype(np.float32) / np.float32(255)
    m = np.asarray(mean, dtype=np.float32).reshape(3, 1, 1)
    sd = np.asarray(std, dtype=np.float32).reshape(3, 1, 1)
    return np.ascontiguousarray((x - m) / sd, dtype=np.float32)


def decode_image(
    data: bytes, image_size: int = 224, resize_size: int = 256, mean=IMAGENET_MEAN, std=IMAGENET_STD
) -> tuple[np.ndarray | None, str]:
    """Encoded bytes -> (float32 [3, image_size, image_size] array, "") or (None, reason)."""
    from PIL import Image

    if not data:
        return None, "empty file"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as im:
                im.load()
                rgb = im.convert("RGB")
        x = eval_transform(rgb, image_size, resize_size, mean, std)
    except Exception as e:  # any decoder failure = a bad image, counted by the consumer
        msg = str(e).splitlines()[0] if str(e) else ""
        msg = re.sub(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "<bytes>", msg)
        return None, f"{type(e).__name__}: {msg}"[:200]
    return x, ""


def _read_imagefolder(root: str, paths: Sequence[str], endpoint_url: str | None) -> list[bytes]:
    fs, base = storage.get_fs(root, endpoint_url)
    full = [base + "/" + p for p in paths]
    got = fs.cat(full, on_error="return") if full else {}  # list in -> dict out (s3fs: concurrent GETs)
    out = []
    for p, f in zip(paths, full):
        v = got.get(f)
        if isinstance(v, BaseException) or v is None:
            raise DataError(f"cannot read {storage.join(root, p)}: {v!r}")
        out.append(bytes(v))
    return out


def _read_parquet_rows(root: str, shards: Sequence[str], rows: Sequence[int], endpoint_url: str | None) -> list[bytes]:
    import pyarrow.parquet as pq

    fs, base = storage.get_fs(root, endpoint_url)
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


def read_decode_batch(
    batch: dict[str, np.ndarray],
    *,
    root: str,
    format: str,
    endpoint_url: str | None = None,
    image_size: int = 224,
    resize_size: int = 256,
    mean=IMAGENET_MEAN,
    std=IMAGENET_STD,
) -> dict[str, np.ndarray]:
    """One batch of index rows (path, label, shard, row) -> decoded columns.

    Output: image float32 [B, 3, image_size, image_size] (zeros where invalid),
    label int64 [B], path str [B] (relative to root), valid bool [B], error str [B]
    ("" when valid). Used by ``build_dataset`` (Ray ``map_batches``) and
    ``iter_local_batches`` alike.
    """
    paths = [str(p) for p in batch["path"]]
    n = len(paths)
    if format == "parquet":
        raw = _read_parquet_rows(root, [str(s) for s in batch["shard"]], [int(r) for r in batch["row"]], endpoint_url)
    else:
        raw = _read_imagefolder(root, paths, endpoint_url) if n else []
    images = np.zeros((n, 3, image_size, image_size), dtype=np.float32)
    valid = np.zeros(n, dtype=bool)
    errors = []
    for i, data in enumerate(raw):
        x, err = decode_image(data, image_size, resize_size, mean, std)
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


def _decode_kwargs(source: _Entries, cfg: DataConfig) -> dict[str, Any]:
    return {
        "root": source.root,
        "format": source.format,
        "endpoint_url": storage.resolve_options(cfg.endpoint_url) if storage.is_remote(source.root) else None,
        "image_size": cfg.image_size,
        "resize_size": cfg.resize_size,
        "mean": tuple(cfg.mean),
        "std": tuple(cfg.std),
    }


MIN_DECODE_TASKS = 8  # a source is cut into at least this many decode batches when it has the images


def decode_batch(n: int, decode_batch_size: int) -> int:
    """Images per decode batch for a source of ``n`` images: ``decode_batch_size``, or fewer
    so that there are at least ``MIN_DECODE_TASKS`` batches (never below 1).

    >>> decode_batch(100_000, 128), decode_batch(256, 128), decode_batch(20, 128), decode_batch(5, 4)
    (128, 32, 3, 1)
    """
    return max(1, min(int(decode_batch_size), math.ceil(n / MIN_DECODE_TASKS)))


def build_dataset(source: DatasetIndex | Partition, cfg: DataConfig) -> "ray.data.Dataset":
    """Lazy Ray Dataset over ``source``'s entries: read bytes + decode + eval transform in
    ``map_batches`` tasks (CPU, ``cfg.decode_num_cpus`` each, at most
    ``cfg.decode_batch_size`` images per call, see :func:`decode_batch`). Columns as
    ``read_decode_batch``. Nothing is materialised; pass it to
    ``TorchTrainer(datasets={...})`` and read it with ``ValidBatches``. The S3 endpoint
    is resolved on the driver and shipped to the tasks; credentials are not (each node
    uses its own AWS credential chain).
    """
    import ray.data

    if len(source) == 0:
        raise DataError("cannot build a dataset from an empty index/partition")
    items = source.items()
    bs = decode_batch(len(items), cfg.decode_batch_size)
    blocks = max(1, min(1024, math.ceil(len(items) / bs)))
    ds = ray.data.from_items(items, override_num_blocks=blocks)
    return ds.map_batches(
        read_decode_batch,
        batch_size=bs,
        batch_format="numpy",
        fn_kwargs=_decode_kwargs(source, cfg),
        num_cpus=cfg.decode_num_cpus,
    )


def iter_local_batches(
    source: DatasetIndex | Partition, cfg: DataConfig, batch_size: int | None = None
) -> Iterator[dict[str, np.ndarray]]:
    """Same columns as ``build_dataset``, decoded in this process (no Ray), in index order."""
    bs = batch_size or cfg.decode_batch_size
    if bs < 1:
        raise ValueError(f"batch_size must be >= 1, got {bs}")
    kw = _decode_kwargs(source, cfg)
    items = source.items()
    for s in range(0, len(items), bs):
        chunk = items[s : s + bs]
        batch = {k: np.asarray([it[k] for it in chunk], dtype=object) for k in ("path", "label", "shard", "row")}
        yield read_decode_batch(batch, **kw)


# --------------------------------------------------------------------------- consuming


@dataclass(frozen=True)
class SkipReport:
    """Images dropped as undecodable: ``count`` and up to MAX_SKIP_EXAMPLES ``(path, reason)``
    examples, kept sorted by path so ``merge`` is associative and commutative."""

    count: int = 0
    examples: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.count < 0 or len(self.examples) > self.count:
            raise ValueError(f"SkipReport: count={self.count} with {len(self.examples)} examples")

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.examples)

    def merge(self, other: "SkipReport") -> "SkipReport":
        ex = tuple(sorted(set(self.examples) | set(other.examples))[:MAX_SKIP_EXAMPLES])
        return SkipReport(self.count + other.count, ex)

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[str, str]]) -> "SkipReport":
        return cls(len(rows), tuple(sorted(set((str(p), str(e)) for p, e in rows))[:MAX_SKIP_EXAMPLES]))

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "examples": [{"path": p, "reason": r} for p, r in self.examples]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SkipReport":
        return cls(int(d["count"]), tuple((e["path"], e["reason"]) for e in d.get("examples", ())))


class Batch(NamedTuple):
    """x: float32 [B, 3, H, W] (valid rows only, on ``device``); y: int64 [B]; paths: the B
    relative paths; skipped: the rows of this batch dropped as invalid."""

    x: torch.Tensor
    y: torch.Tensor
    paths: tuple[str, ...]
    skipped: SkipReport


def iter_valid_batches(
    source: Any, batch_size: int = 32, device: torch.device | str | None = None, prefetch_batches: int = 1
) -> Iterator[Batch]:
    """Batches with invalid rows removed.

    ``source``: a Ray ``DataIterator`` (``ray.train.get_dataset_shard(name)``), a
    ``ray.data.Dataset``, or an iterable of column dicts (``iter_local_batches``).
    One Batch per underlying batch, also when it has 0 valid rows (so no skip is
    lost); ``x.shape[0]`` may therefore be 0 and is at most ``batch_size``.
    """
    import torch

    if hasattr(source, "iter_batches"):
        it = source.iter_batches(batch_size=batch_size, batch_format="numpy", prefetch_batches=prefetch_batches)
    else:
        it = iter(source)
    dev = torch.device(device) if device is not None else None
    for b in it:
        valid = np.asarray(b["valid"], dtype=bool)
        paths = [str(p) for p in b["path"]]
        errors = [str(e) for e in b["error"]] if "error" in b else ["invalid image"] * len(paths)
        bad = np.flatnonzero(~valid)
        good = np.flatnonzero(valid)
        skipped = SkipReport.from_rows([(paths[i], errors[i]) for i in bad])
        images = np.asarray(b["image"])
        x = torch.from_numpy(np.ascontiguousarray(images[good], dtype=np.float32))
        y = torch.from_numpy(np.asarray(b["label"], dtype=np.int64)[good])
        if dev is not None:
            x = x.to(dev, non_blocking=True)
            y = y.to(dev, non_blocking=True)
        yield Batch(x, y, tuple(paths[i] for i in good), skipped)


class ValidBatches:
    """Iterable of ``(x, y)`` for a worker loop; empty batches are not yielded.

    After (or during) iteration: ``skipped`` (SkipReport of this pass) and
    ``num_valid``. Iterating again restarts both counts.
    """

    def __init__(
        self, source: Any, batch_size: int = 32, device: torch.device | str | None = None, prefetch_batches: int = 1
    ) -> None:
        self.source, self.batch_size, self.device, self.prefetch_batches = source, batch_size, device, prefetch_batches
        self.skipped = SkipReport()
        self.num_valid = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.skipped = SkipReport()
        self.num_valid = 0
        for b in iter_valid_batches(self.source, self.batch_size, self.device, self.prefetch_batches):
            self.skipped = self.skipped.merge(b.skipped)
            self.num_valid += int(b.y.shape[0])
            if b.y.shape[0]:
                yield b.x, b.y


# --------------------------------------------------------------------------- Ray Train ingest


def exact_split_data_config(datasets_to_split: str | list[str] = "all") -> Any:
    """A ``ray.train.DataConfig`` that shards datasets across workers WITHOUT dropping rows.

    Ray Train's default ``DataConfig`` calls ``Dataset.streaming_split(n, equal=True)``,
    which silently drops up to ``n - 1`` rows per dataset to give every worker the same
    count; summed statistics must see every image once, so this one splits with
    ``equal=False`` (workers may then get different numbers of rows; every row goes to
    exactly one worker). Pass it as ``TorchTrainer(..., dataset_config=exact_split_data_config())``.
    Workers must not call ``ray.train.report`` per batch (it is a barrier): report once
    after the loop.
    """
    return _exact_split_class()(datasets_to_split=datasets_to_split)


_EXACT_SPLIT_CLS: Any = None


def _exact_split_class() -> type:
    global _EXACT_SPLIT_CLS
    if _EXACT_SPLIT_CLS is not None:
        return _EXACT_SPLIT_CLS
    import ray.train

    class ExactSplitDataConfig(ray.train.DataConfig):
        """ray.train.DataConfig with ``streaming_split(equal=False)`` (no dropped rows)."""

        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            output: list[dict[str, Any]] = [{} for _ in range(world_size)]
            to_split = set(datasets) if self._datasets_to_split == "all" else set(self._datasets_to_split)
            hints = worker_node_ids if getattr(self, "_enable_shard_locality", True) else None
            for name, ds in datasets.items():
                if ds.name is None:
                    ds.set_name(name)
                ds = ds.copy(ds)
                resolve = getattr(self, "_resolve_execution_options", None)
                ds.context.execution_options = resolve(name) if resolve else self.default_ingest_options()
                if name in to_split:
                    for i, split in enumerate(ds.streaming_split(world_size, equal=False, locality_hints=hints)):
                        output[i][name] = split
                else:
                    for i in range(world_size):
                        output[i][name] = ds.iterator()
            return output

    _EXACT_SPLIT_CLS = ExactSplitDataConfig
    return ExactSplitDataConfig


# --------------------------------------------------------------------------- parquet conversion


def convert_to_parquet(
    index: DatasetIndex,
    out_uri: str,
    rows_per_file: int = 1000,
    endpoint_url: str | None = None,
    out_endpoint_url: str | None = None,
    num_threads: int = 8,
) -> list[str]:
    """Copy the encoded bytes of ``index``'s files (unchanged, so decoding gives identical
    tensors and bad files stay bad) into ``out_uri/part-XXXXX.parquet`` with columns
    image (binary), label (int64), path (string), ``rows_per_file`` rows each, in index
    order, plus ``out_uri/dataset.json`` (classes, counts, shard list). Each file is
    written atomically. ``endpoint_url`` is for reading, ``out_endpoint_url`` for
    writing (defaults to ``endpoint_url``). Returns the shard URIs.
    Reads run on ``num_threads`` threads in this process (convert once, offline).
    """
    import json
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa
    import pyarrow.parquet as pq

    _opt_pos_int("rows_per_file", rows_per_file)
    if len(index) == 0:
        raise DataError("cannot convert an empty index")
    out_ep = out_endpoint_url if out_endpoint_url is not None else endpoint_url
    schema = pa.schema(
        [("image", pa.binary()), ("label", pa.int64()), ("path", pa.string())],
        metadata={_PARQUET_CLASSES_KEY: json.dumps(list(index.classes)).encode()},
    )
    n_files = math.ceil(len(index) / rows_per_file)
    written, shard_meta = [], []

    def read_chunk(a: int, b: int) -> list[bytes]:
        if index.format == "parquet":
            return _read_parquet_rows(
                index.root, [index.shards[s] for s, _ in index.locations[a:b]],
                [r for _, r in index.locations[a:b]], endpoint_url,
            )
        return _read_imagefolder(index.root, index.paths[a:b], endpoint_url)

    with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
        for k in range(n_files):
            a, b = k * rows_per_file, min((k + 1) * rows_per_file, len(index))
            step = max(1, math.ceil((b - a) / max(1, num_threads)))
            chunks = list(pool.map(lambda s: read_chunk(s, min(s + step, b)), range(a, b, step)))
            data = [d for c in chunks for d in c]
            table = pa.table(
                {
                    "image": pa.array(data, pa.binary()),
                    "label": pa.array(index.labels[a:b], pa.int64()),
                    "path": pa.array(index.paths[a:b], pa.string()),
                },
                schema=schema,
            )
            buf = pa.BufferOutputStream()
            pq.write_table(table, buf, row_group_size=min(rows_per_file, 256))
            name = f"part-{k:05d}.parquet"
            uri = storage.join(out_uri, name)
            storage.write_bytes_atomic(uri, buf.getvalue().to_pybytes(), out_ep)
            written.append(uri)
            shard_meta.append({"name": name, "rows": b - a})
    storage.write_json_atomic(
        storage.join(out_uri, PARQUET_META_FILE),
        {
            "format": "infoform-parquet",
            "version": 1,
            "classes": list(index.classes),
            "class_counts": list(index.class_counts),
            "empty_classes": list(index.empty_classes),
            "num_rows": len(index),
            "source_fingerprint": index.fingerprint,
            "shards": shard_meta,
        },
        out_ep,
    )
    return written
