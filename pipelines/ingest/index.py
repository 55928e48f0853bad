"""What the data is: where it lives and how it becomes tensors (:class:`DataConfig`), the
frozen file list listed once on the driver (:class:`DatasetIndex`, made by
:func:`pipelines.ingest.scan.scan`) and its fixed, contiguous slices (:class:`Partition`,
:func:`partition`; one worker's share of one: :func:`rank_share`)::

    index = scan(cfg)                       # DatasetIndex: classes, sorted files, labels, counts
    parts = partition(index, partition_size=cfg.partition_size)   # stable Partition list
    share = rank_share(parts[i], rank, world)                      # entries rank, rank + world, ...

Same index -> same partitions (ids, files, fingerprints) on every run; a fingerprint is the
SHA-256 of the class list and the (path, label) list, so a re-run detects a changed partition.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, replace
from typing import Any, Sequence

from pipelines.config.schema import DataSpec
from pipelines.config.settings import same_as
from pipelines.ingest.pathlist import PathList
from pipelines.storage import uris as storage

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "FORMATS",
    "IMAGE_EXTENSIONS",
    "DataError",
    "DataConfig",
    "DatasetIndex",
    "Partition",
    "fingerprint",
    "partition",
    "rank_share",
    "merge_shares",
    "PathList",
]

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

#: ``DataConfig.format`` values.
FORMATS: dict[str, str] = {
    "auto": "parquet if the split dir holds *.parquet files, else imagefolder",
    "imagefolder": "<split>/<class>/**/file, or flat <split>/file + labels CSV",
    "parquet": "<split>/*.parquet with columns image (bytes), label (int), optional path",
}

#: The file suffixes indexed as images by default (case-insensitive); any other file is counted
#: as ignored (``DatasetIndex.ignored``) and named in the log and the report. ``data.extensions``
#: adds suffixes to these.
IMAGE_EXTENSIONS: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")


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
    e.g. (".jpeg", ".jpg")), by default :data:`IMAGE_EXTENSIONS`; None keeps every non-hidden
    file. unlabeled: no
    labels (-1). storage_options: how to reach an S3 root (the run's resolved
    :class:`~pipelines.storage.uris.StorageOptions`; None: the environment's). num_partitions /
    partition_size: default partitioning for ``partition`` (at most one).
    decode_batch_size: most images per decode task batch (fewer when the source has
    fewer than ``MIN_DECODE_TASKS`` batches' worth, so that small partitions still
    spread over the workers; :func:`pipelines.ingest.batches.decode_batch`; the measured
    throughput per size is in benchmarks/RESULTS.md). decode_num_cpus: CPUs per Ray
    decode task.
    """

    root: str
    split: str | None = "train"
    image_size: int = same_as(DataSpec, "image_size")
    resize_size: int = same_as(DataSpec, "resize_size")
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    limit: int | None = same_as(DataSpec, "limit")
    per_class: int | None = same_as(DataSpec, "per_class")
    labels_csv: str | None = same_as(DataSpec, "labels_csv")
    classes: tuple[str, ...] | None = None
    classes_file: str | None = None
    extensions: tuple[str, ...] | None = IMAGE_EXTENSIONS
    unlabeled: bool = False
    format: str = "auto"
    storage_options: storage.StorageOptions | None = None
    num_partitions: int | None = None
    partition_size: int | None = None
    decode_batch_size: int = same_as(DataSpec, "decode_batch_size")
    decode_num_cpus: float = same_as(DataSpec, "decode_num_cpus")

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
    suffixes not in ``extensions``); ignored_examples: the first three of them (sorted).
    unmatched_label_rows: CSV rows with no file.
    fingerprint: SHA-256 over classes + (path, label) list.
    """

    class_counts: tuple[int, ...] = ()
    empty_classes: tuple[str, ...] = ()
    num_scanned: int = 0
    ignored: int = 0
    ignored_examples: tuple[str, ...] = ()
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
            "ignored_examples": list(self.ignored_examples),
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


def merge_shares(shares: Sequence[Any]):
    """The source whose :func:`rank_share` for ``len(shares)`` ranks gave ``shares`` (in rank
    order; ``None`` for a rank without entries): entry ``i`` of rank ``r``'s share is entry
    ``r + i * world`` of the source."""
    world = len(shares)
    first = next((s for s in shares if s is not None), None)
    if first is None:
        raise ValueError("merge_shares: every share is empty")
    n = sum(len(s) for s in shares if s is not None)
    order = [(r, i) for j in range(n) for r, i in [(j % world, j // world)]]
    paths = [shares[r].paths[i] for r, i in order]
    kw: dict[str, Any] = {"paths": PathList.of(paths), "labels": tuple(shares[r].labels[i] for r, i in order)}
    if first.locations:
        kw["locations"] = tuple(shares[r].locations[i] for r, i in order)
    return replace(first, **kw)


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

