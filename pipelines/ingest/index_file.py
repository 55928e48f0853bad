"""A dataset handed as an index: one Parquet file of image paths and labels (``--data
index.parquet``), the form large datasets often come in.

Columns: ``path`` (a local path or ``s3://`` URI, or a path relative to the Parquet file's
folder, or to the ``infoform.root`` of the file's schema metadata, which the run's own
persisted listing ``<output>/index/<split>.parquet`` carries) and ``label`` (int) or ``class``
(a class name); optional ``split`` (rows of the split asked for; without it the file is the
``train`` split). The class list: ``classes`` / ``classes_file`` when given, else the sorted
``class`` names of the whole file, else the ``infoform.classes`` schema metadata, else
``0 .. max(label)``. Rows whose path ends in ``/`` (folder markers) or whose class is empty
(files beside the class folders) are left out and counted as ignored.

A Parquet file with an ``image`` column is a data shard, not an index (:mod:`.parquet`).
"""
from __future__ import annotations

import io
import json
import os
import posixpath

from pipelines.ingest.index import DataConfig, DataError
from pipelines.ingest.parquet import PARQUET_CLASSES_KEY
from pipelines.storage import uris as storage

__all__ = ["ROOT_KEY", "is_index_file", "read_index_file"]

#: Schema-metadata key of the folder an index's relative paths are under.
ROOT_KEY = b"infoform.root"


def _read_table(cfg: DataConfig):
    import pyarrow.parquet as pq

    return pq.read_table(io.BytesIO(storage.read_bytes(cfg.root, cfg.storage_options)))


def is_index_file(cfg: DataConfig) -> bool:
    """``cfg.root`` is one ``.parquet`` file with a ``path`` column and no ``image`` column."""
    import pyarrow.parquet as pq

    root = cfg.root.rstrip("/")
    if not root.lower().endswith(".parquet") or storage.isdir(root, cfg.storage_options):
        return False
    if not storage.exists(root, cfg.storage_options):
        raise DataError(f"data index does not exist: {cfg.root}")
    fs, path = storage.get_fs(root, cfg.storage_options)
    with fs.open(path, "rb") as f:
        names = pq.ParquetFile(f).schema_arrow.names
    return "path" in names and "image" not in names


def _absolute(p: str) -> bool:
    return "://" in p or p.startswith("/")


def _common_root(paths: list[str]) -> str:
    if all(p.startswith("/") for p in paths):
        return os.path.commonpath([posixpath.dirname(p) for p in paths])
    first = paths[0]
    cut = len(os.path.commonprefix(paths))
    return first[: first.rfind("/", 0, cut + 1)] if "/" in first[:cut + 1] else ""


def _classes(cfg: DataConfig, table, meta: dict) -> tuple[str, ...]:
    if cfg.classes is not None:
        return tuple(sorted(set(cfg.classes)))
    if cfg.classes_file is not None:
        text = storage.read_bytes(cfg.classes_file, cfg.storage_options).decode("utf-8-sig")
        return tuple(sorted({ln.split()[0] for ln in text.splitlines() if ln.strip()}))
    if "class" in table.column_names:
        return tuple(sorted({c for c in table.column("class").to_pylist() if c}))
    if PARQUET_CLASSES_KEY in meta:
        return tuple(json.loads(meta[PARQUET_CLASSES_KEY].decode()))
    labels = [y for y in table.column("label").to_pylist() if y is not None]
    return tuple(str(i) for i in range(max(labels) + 1)) if labels else ()


def _rows_of_split(cfg: DataConfig, table):
    import pyarrow.compute as pc

    if "split" not in table.column_names:
        if cfg.split not in (None, "", "train"):
            raise DataError(f"{cfg.root} has no 'split' column, so it holds only the train split "
                            f"(asked for {cfg.split!r}); add a split column")
        return table
    if not cfg.split:
        return table
    rows = table.filter(pc.equal(table.column("split"), cfg.split))
    if rows.num_rows == 0:
        found = sorted({s for s in table.column("split").to_pylist() if s})
        raise DataError(f"{cfg.root} has no rows of split {cfg.split!r} (splits: {', '.join(found) or 'none'})")
    return rows


def read_index_file(cfg: DataConfig) -> tuple[str, tuple[str, ...], list[str], list[int], list[str]]:
    """``(root, classes, paths relative to root, labels, ignored rows' paths)`` of the index file
    ``cfg.root`` (see module doc); raises DataError in one line for a bad file."""
    whole = _read_table(cfg)
    names = whole.column_names
    if "label" not in names and "class" not in names and not cfg.unlabeled:
        raise DataError(f"data index {cfg.root} needs a 'label' or 'class' column (columns: {names})")
    meta = whole.schema.metadata or {}
    classes = () if cfg.unlabeled else _classes(cfg, whole, meta)
    table = _rows_of_split(cfg, whole)
    paths = table.column("path").to_pylist()
    by_class = table.column("class").to_pylist() if "class" in names else None
    keep = [i for i, p in enumerate(paths) if p and not p.endswith("/") and (by_class is None or by_class[i])]
    kept = set(keep)
    ignored = [str(p or f"<row {i}: no path>") for i, p in enumerate(paths) if i not in kept]
    if not keep:
        raise DataError(f"data index {cfg.root} has no image rows" + (f" for split {cfg.split!r}" if cfg.split else ""))
    base = meta[ROOT_KEY].decode() if ROOT_KEY in meta else posixpath.dirname(cfg.root.rstrip("/"))
    if not storage.is_remote(base) and not _absolute(base):
        base = os.path.abspath(base)
    full = [paths[i] if _absolute(paths[i]) else storage.join(base, paths[i]) for i in keep]
    root = _common_root(full)
    rel = [p[len(root):].lstrip("/") for p in full]
    if len(set(rel)) != len(rel):
        raise DataError(f"data index {cfg.root} lists {len(rel) - len(set(rel))} path(s) twice")
    if cfg.unlabeled:
        return root, (), rel, [-1] * len(rel), ignored
    lookup = {c: i for i, c in enumerate(classes)}
    if by_class is not None:
        unknown = sorted({by_class[i] for i in keep if by_class[i] not in lookup})
        if unknown:
            raise DataError(f"data index {cfg.root} names {len(unknown)} class(es) not in the class list: {unknown[:3]}")
        labels = [lookup[by_class[i]] for i in keep]
    else:
        raw = table.column("label").to_pylist()
        labels = [raw[i] for i in keep]
        bad = sorted({y for y in labels if y is None or not 0 <= int(y) < len(classes)}, key=str)
        if bad:
            raise DataError(f"data index {cfg.root}: labels out of range [0, {len(classes)}): e.g. {bad[:3]}")
        labels = [int(y) for y in labels]
    return root, classes, rel, labels, ignored
