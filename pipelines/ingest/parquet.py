"""Offline conversion of an indexed dataset to Parquet shards (``convert_to_parquet``), and
the metadata that :func:`pipelines.ingest.scan.scan` reads back: ``dataset.json``
(:data:`PARQUET_META_FILE`) beside the shards and the class list in each shard's schema
metadata (:data:`PARQUET_CLASSES_KEY`).
"""
from __future__ import annotations

import json
import math

from pipelines.ingest.decode import read_files, read_parquet_rows
from pipelines.ingest.index import DataError, DatasetIndex
from pipelines.storage import uris as storage
from pipelines.storage.uris import StorageOptions

__all__ = ["PARQUET_META_FILE", "PARQUET_CLASSES_KEY", "convert_to_parquet"]

#: Name of the JSON written next to Parquet shards by ``convert_to_parquet``.
PARQUET_META_FILE = "dataset.json"
#: Schema-metadata key of the JSON class list in every shard written by ``convert_to_parquet``.
PARQUET_CLASSES_KEY = b"infoform.classes"


def convert_to_parquet(
    index: DatasetIndex,
    out_uri: str,
    rows_per_file: int = 1000,
    options: StorageOptions | None = None,
    out_options: StorageOptions | None = None,
    num_threads: int = 8,
) -> list[str]:
    """Copy the encoded bytes of ``index``'s files (unchanged, so decoding gives identical
    tensors and bad files stay bad) into ``out_uri/part-XXXXX.parquet`` with columns
    image (binary), label (int64), path (string), ``rows_per_file`` rows each, in index
    order, plus ``out_uri/dataset.json`` (classes, counts, shard list). Each file is
    written atomically. ``options`` (storage options) are for reading, ``out_options`` for
    writing (defaults to ``options``). Returns the shard URIs.
    Reads run on ``num_threads`` threads in this process (convert once, offline).
    """
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa

    if isinstance(rows_per_file, bool) or not isinstance(rows_per_file, int) or rows_per_file < 1:
        raise ValueError(f"rows_per_file must be a positive int, got {rows_per_file!r}")
    if len(index) == 0:
        raise DataError("cannot convert an empty index")
    out_ep = out_options if out_options is not None else options
    schema = pa.schema(
        [("image", pa.binary()), ("label", pa.int64()), ("path", pa.string())],
        metadata={PARQUET_CLASSES_KEY: json.dumps(list(index.classes)).encode()},
    )
    n_files = math.ceil(len(index) / rows_per_file)
    written, shard_meta = [], []

    with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
        for k in range(n_files):
            a, b = k * rows_per_file, min((k + 1) * rows_per_file, len(index))
            step = max(1, math.ceil((b - a) / max(1, num_threads)))
            chunks = pool.map(lambda s: _read_rows(index, s, min(s + step, b), options), range(a, b, step))
            data = [d for c in chunks for d in c]
            name = f"part-{k:05d}.parquet"
            uri = storage.join(out_uri, name)
            storage.write_bytes_atomic(uri, _shard_bytes(index, a, b, data, schema, rows_per_file), out_ep)
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


def _read_rows(index: DatasetIndex, a: int, b: int, options: StorageOptions | None) -> list[bytes]:
    """The encoded bytes of entries ``a:b`` of ``index`` (its files, or its Parquet rows)."""
    if index.format == "parquet":
        return read_parquet_rows(index.root, [index.shards[s] for s, _ in index.locations[a:b]],
                                 [r for _, r in index.locations[a:b]], options)
    return read_files(index.root, index.paths[a:b], options)


def _shard_bytes(index: DatasetIndex, a: int, b: int, data: list[bytes], schema, rows_per_file: int) -> bytes:
    """One Parquet shard of entries ``a:b``: their bytes, labels and paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"image": pa.array(data, pa.binary()), "label": pa.array(index.labels[a:b], pa.int64()),
                      "path": pa.array(list(index.paths[a:b]), pa.string())}, schema=schema)
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf, row_group_size=min(rows_per_file, 256))
    return buf.getvalue().to_pybytes()
