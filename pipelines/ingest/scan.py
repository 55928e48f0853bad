"""Listing a dataset on the driver: ``scan(cfg) -> DatasetIndex`` (all listing happens here,
before any cluster work).

Layouts (``cfg.root`` + ``cfg.split``; ``split=None`` means root is the split dir):

- ImageFolder / ImageNet: ``<split>/<wnid>/**/<file>``. Class index = position in
  the sorted class list (torchvision's ``ImageFolder`` order). The class list is
  the sorted folder names, or ``cfg.classes`` / ``cfg.classes_file`` when given
  (then every folder must be in it). Classes without files are kept (their index
  stays reserved, so labels align with the model's outputs) and reported in
  ``DatasetIndex.empty_classes``. A non-hidden file under a class folder is an
  entry when :func:`is_image` accepts its suffix (``cfg.extensions``, by default
  the image suffixes); every other file is counted as ignored and the first three
  are named (``DatasetIndex.ignored`` / ``ignored_examples``), never silently dropped.
- Flat validation dir: ``<split>/*.JPEG`` plus an ImageNet ``LOC_val_solution.csv``
  style CSV (``ImageId,PredictionString``; the first token of PredictionString
  is the wnid; ImageId = file name without extension). The class list is
  ``cfg.classes``/``classes_file`` or the folder names of the sibling ``train/``.
  The CSV is ``cfg.labels_csv`` or ``LOC_val_solution.csv`` found in the split
  dir, its parent or grandparent.
- Parquet shards (``<split>/*.parquet``, or one ``.parquet`` file as root): columns
  ``image`` (encoded bytes), ``label`` (int), optional ``path``; the class list
  comes from ``dataset.json`` beside the shards (written by
  :func:`pipelines.ingest.parquet.convert_to_parquet`), the shards' schema metadata,
  or ``cfg.classes``.
- ``cfg.unlabeled=True`` (OOD sets): every file under the split dir, label -1, no classes.

Determinism: files are sorted by their path relative to the split dir; the
``per_class`` and ``limit`` subsets keep the files with the smallest
SHA-1(relative path), so a local copy and an ``s3://`` copy give the same subset,
independent of any random state.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import posixpath
from typing import Iterable

import numpy as np

from pipelines.ingest.index import DataConfig, DataError, DatasetIndex, fingerprint
from pipelines.ingest.pathlist import LabelList, PackedPathList, PathList
from pipelines.ingest.parquet import PARQUET_CLASSES_KEY, PARQUET_META_FILE
from pipelines.ingest.table_scan import imagefolder, release_unused
from pipelines.storage import uris as storage

__all__ = ["scan", "is_image"]

_LOC_CSV = "LOC_val_solution.csv"


def _hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/"))


def _listing(uri: str, options: storage.Store, lister=None):
    """The listing table of ``uri`` (``lister(uri)``, :mod:`pipelines.ingest.index_store`; S3
    without one is listed in parallel, :func:`pipelines.ingest.listing.list_records`), or
    ``None`` for a local folder without a lister (walked)."""
    if lister is None and not storage.is_remote(uri):
        return None
    from pipelines.ingest.listing import list_records

    return lister(uri) if lister is not None else list_records(uri, options)


def _walk(uri: str, options: storage.Store, table=None) -> tuple[set[str], list[str]]:
    """(relative dirs, relative files) under ``uri``, recursively, hidden entries dropped:
    from the listing ``table`` when there is one, else walked."""
    fs, base = storage.get_fs(uri, options)
    dirs: set[str] = set()
    files: list[str] = []
    if table is None:
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
    # listing records (paths relative to uri); folders are the key prefixes, plus "dir/" marker
    # objects (how empty folders exist on S3)
    for rel in (r for b in table.select(["path"]).to_batches(max_chunksize=65536) for r in b.column(0).to_pylist()):
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
    ep = cfg.storage_options
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
            text = storage.read_bytes(cfg.classes_file, cfg.storage_options).decode("utf-8-sig")
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


def is_image(path: str, extensions: Iterable[str] | None) -> bool:
    """Whether a listed file is indexed: its suffix (case-insensitive) is one of ``extensions``
    (lower-case, with the dot; None accepts every file)."""
    return extensions is None or posixpath.splitext(path)[1].lower() in extensions


def _ext_ok(rel: str, cfg: DataConfig) -> bool:
    return is_image(rel, cfg.extensions)


def _stem(rel: str) -> str:
    return posixpath.splitext(posixpath.basename(rel))[0]


def _find_labels_csv(split_uri: str, cfg: DataConfig) -> str | None:
    if cfg.labels_csv:
        if not storage.exists(cfg.labels_csv, cfg.storage_options):
            raise DataError(f"labels_csv does not exist: {cfg.labels_csv}")
        return cfg.labels_csv
    cand = split_uri.rstrip("/")
    for _ in range(3):
        uri = storage.join(cand, _LOC_CSV)
        if storage.exists(uri, cfg.storage_options):
            return uri
        parent = posixpath.dirname(cand)
        if not parent or parent == cand or parent.endswith(":/"):
            break
        cand = parent
    return None


def _read_label_csv(uri: str, options: storage.Store) -> dict[str, str]:
    """ImageId -> wnid (first token of PredictionString)."""
    text = storage.read_bytes(uri, options).decode("utf-8-sig")
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


def _sibling_train_classes(split_uri: str, options: storage.Store) -> tuple[str, ...] | None:
    parent = posixpath.dirname(split_uri.rstrip("/"))
    if not parent:
        return None
    train = storage.join(parent, "train")
    if train.rstrip("/") == split_uri.rstrip("/") or not storage.isdir(train, options):
        return None
    fs, path = storage.get_fs(train, options)
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


def _scan_table(split_uri: str, cfg: DataConfig, lister=None):
    """``(found, table)``: the ImageFolder scan of the split's listing done column-wise (no Python
    object per file) when the listing is an ImageFolder, else ``(None, listing or None)``."""
    table = _listing(split_uri, cfg.storage_options, lister)
    if table is None or cfg.unlabeled:
        return None, table
    table = table.select([c for c in ("path", "class") if c in table.column_names])  # sizes, ETags freed
    found = imagefolder(table, split_uri, _explicit_classes(cfg), cfg.extensions)
    if found is None:
        return None, table
    del table
    release_unused()
    return (*found, 0), None


def _scan_folders(split_uri: str, cfg: DataConfig, lister=None):
    """(classes, rel files, labels, ignored rel files, num unmatched CSV rows) for folder / flat layouts."""
    found, table = _scan_table(split_uri, cfg, lister)
    if found is not None:
        return found
    dirs, files = _walk(split_uri, cfg.storage_options, table)
    del table
    top_dirs = sorted(d for d in dirs if "/" not in d)
    nested = [f for f in files if "/" in f]
    top_files = [f for f in files if "/" not in f]
    unmatched = 0
    if cfg.unlabeled:
        keep = [f for f in files if _ext_ok(f, cfg)]
        return (), keep, [-1] * len(keep), [f for f in files if not _ext_ok(f, cfg)], 0
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
        ignored = top_files + [f for f in nested if not _ext_ok(f, cfg)]
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
    classes = explicit if explicit is not None else _sibling_train_classes(split_uri, cfg.storage_options)
    if classes is None:
        raise DataError(
            f"flat split {split_uri} needs the class list: pass classes/classes_file or keep a sibling train/ dir"
        )
    id_to_wnid = _read_label_csv(csv_uri, cfg.storage_options)
    csv_name = posixpath.basename(csv_uri.rstrip("/"))
    keep = [f for f in top_files if _ext_ok(f, cfg) and f != csv_name and not f.lower().endswith(".csv")]
    kept = set(keep)
    ignored = [f for f in top_files if f not in kept]
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


def _parquet_files(split_uri: str, options: storage.Store) -> tuple[str, list[str]]:
    """(parquet dir URI, shard names relative to it)."""
    if split_uri.rstrip("/").lower().endswith(".parquet") and not storage.isdir(split_uri, options):
        base = posixpath.dirname(split_uri.rstrip("/"))
        return base, [posixpath.basename(split_uri.rstrip("/"))]
    names = [n for n in storage.listdir(split_uri, options) if n.lower().endswith(".parquet") and not n.startswith(".")]
    return split_uri, names


def _scan_parquet(split_uri: str, cfg: DataConfig):
    import pyarrow.parquet as pq

    base, shards = _parquet_files(split_uri, cfg.storage_options)
    if not shards:
        raise DataError(f"no .parquet files under {split_uri}")
    classes = _explicit_classes(cfg)
    meta_uri = storage.join(base, PARQUET_META_FILE)
    if classes is None and storage.exists(meta_uri, cfg.storage_options):
        meta = storage.read_json(meta_uri, cfg.storage_options)
        classes = tuple(meta.get("classes") or ()) or None
    fs, fs_base = storage.get_fs(base, cfg.storage_options)
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
                if PARQUET_CLASSES_KEY in md:
                    classes = tuple(json.loads(md[PARQUET_CLASSES_KEY].decode()))
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


def scan(cfg: DataConfig, lister=None) -> DatasetIndex:
    """List the dataset on the driver and return its frozen DatasetIndex (see module doc).
    ``lister(split_uri)``: the split's listing table (path, size, etag; e.g. a persisted one,
    :class:`pipelines.ingest.index_store.IndexedListing`); default: list it now.

    Raises DataError (one line) for: a missing root or split, no files, a labels
    CSV that misses files or names unknown wnids, class folders outside an
    explicit class list, parquet shards without the needed columns / classes.
    """
    from pipelines.ingest.index_file import is_index_file, read_index_file

    fmt, shards = cfg.format, ()
    if fmt != "parquet" and is_index_file(cfg):  # --data index.parquet: a file of paths and labels
        split_uri, classes, paths, labels, ignored = read_index_file(cfg)
        fmt, locations, unmatched = "imagefolder", [], 0
    else:
        split_uri = _split_dir(cfg)
        if not storage.is_remote(split_uri):
            split_uri = storage.get_fs(split_uri)[1]  # absolute local path: Ray workers may run elsewhere
        if fmt == "auto":
            _, pq_files = _parquet_files(split_uri, cfg.storage_options)
            fmt = "parquet" if pq_files else "imagefolder"
        if fmt == "parquet":
            split_uri, classes, paths, labels, shards, locations = _scan_parquet(split_uri, cfg)
            ignored, unmatched = [], 0
        else:
            classes, paths, labels, ignored, unmatched = _scan_folders(split_uri, cfg, lister)
            locations = []
    if not paths:
        other = f" ({len(ignored)} other file(s), e.g. {_examples(ignored)}; data.extensions adds suffixes)" if ignored else ""
        raise DataError(f"no image files found under {split_uri}{other}")
    if isinstance(labels, np.ndarray):  # the column-wise ImageFolder scan: a sorted PathList, labels an array
        scanned_counts = np.bincount(labels[labels >= 0], minlength=len(classes)).tolist()
    else:
        scanned_counts = [0] * len(classes)
        for y in labels:
            if y >= 0:
                scanned_counts[y] += 1
    empty = tuple(c for c, n in zip(classes, scanned_counts) if n == 0)
    num_scanned = len(paths)
    if isinstance(labels, np.ndarray) and cfg.per_class is None and cfg.limit is None:
        return _index(cfg, split_uri, fmt, classes, paths, LabelList.of(labels), scanned_counts,
                      empty=empty, num_scanned=num_scanned, ignored=ignored, unmatched=unmatched)
    order = list(range(len(paths)))
    if cfg.per_class is not None:
        groups: dict[int, list[int]] = {}
        for i in order:
            groups.setdefault(labels[i], []).append(i)
        order = [i for g in groups.values() for i in sorted(g, key=lambda j: _subset_order(paths[j]))[: cfg.per_class]]
    if cfg.limit is not None and len(order) > cfg.limit:
        order = sorted(order, key=lambda j: _subset_order(paths[j]))[: cfg.limit]
    order.sort(key=lambda j: paths[j])
    sel_paths = PathList.of(paths[i] for i in order)  # one buffer, not a str object per file
    sel_labels = tuple(int(labels[i]) for i in order)
    counts = [0] * len(classes)
    for y in sel_labels:
        if y >= 0:
            counts[y] += 1
    return _index(cfg, split_uri, fmt, classes, sel_paths, sel_labels, counts, empty=empty,
                  num_scanned=num_scanned, ignored=ignored, unmatched=unmatched, shards=shards,
                  locations=tuple(locations[i] for i in order) if locations else ())


def _index(cfg: DataConfig, split_uri: str, fmt: str, classes, paths: PathList, labels: tuple, counts,
           *, empty, num_scanned: int, ignored, unmatched: int, shards=(), locations=()) -> DatasetIndex:
    return DatasetIndex(
        root=split_uri.rstrip("/") or split_uri,
        format=fmt,
        classes=tuple(classes),
        paths=PackedPathList.pack(paths),  # held compressed while the run's stages go on (issue 29)
        labels=labels,
        shards=shards,
        locations=locations,
        class_counts=tuple(counts),
        empty_classes=empty,
        num_scanned=num_scanned,
        ignored=len(ignored),
        ignored_examples=tuple(sorted(ignored)[:3]),
        unmatched_label_rows=unmatched,
        fingerprint=fingerprint(classes, paths, labels),
    )
