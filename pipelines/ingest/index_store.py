"""The listing of a split, persisted with the run: ``<output>/index/<name>.parquet`` (columns
``path``, ``class``, ``size``, ``etag``; one row per object under the split folder) and
``<name>.json``, its fingerprint (the listed prefix, the object count, a SHA-256 of every
``(path, size, etag)``, the top-level entries and each class prefix's object count).

A re-submitted job (a resume after a failure, a scheduled run) reuses the stored listing after
a cheap check, instead of listing the bucket again:

1. the fingerprint names the same prefix;
2. the top level (one delimiter listing: the class prefixes and the loose objects) is the same;
3. the object counts of ``check_classes`` class prefixes (drawn at random on each check; every
   class when there are no more than that) equal the stored counts;
4. ``check_keys`` stored keys, drawn at random, still have the stored size and ETag (HEAD).

Any difference, a missing or unreadable index, or ``relist=True`` (``--relist``) lists the split
again (:func:`pipelines.ingest.listing.list_records`) and rewrites both files. Either way one
line says which happened. The check is a sample: an object changed in a class that is not drawn
is only noticed by a later check or ``--relist``.
"""
from __future__ import annotations

import hashlib
import io
import random
import time
from typing import Callable

from pipelines.ingest.listing import count_objects, head_records, list_records, top_level
from pipelines.ingest.table_scan import first_part, release_unused
from pipelines.storage import uris as storage

__all__ = ["CHECK_CLASSES", "CHECK_KEYS", "IndexedListing", "index_uris", "records_digest"]

#: Class prefixes whose object count a reuse check compares (drawn at random each time).
CHECK_CLASSES = 8
#: Stored keys a reuse check HEADs (drawn at random each time).
CHECK_KEYS = 16
_FORMAT = "infoform.index"


def index_uris(output: str, name: str) -> tuple[str, str]:
    """``(parquet URI, fingerprint JSON URI)`` of the persisted listing ``name`` under ``output``."""
    base = storage.join(output, "index", name)
    return base + ".parquet", base + ".json"


def records_digest(table) -> str:
    """SHA-256 over every ``path \\t size \\t etag`` line of a listing table, in its order."""
    h = hashlib.sha256()
    for batch in table.select(["path", "size", "etag"]).to_batches(max_chunksize=8192):  # ~1 MB of str at a time
        cols = batch.to_pydict()
        h.update("".join(f"{p}\t{s}\t{e}\n" for p, s, e in zip(cols["path"], cols["size"], cols["etag"])).encode())
    return h.hexdigest()


def _rows(table, rows) -> list[dict]:
    """Rows ``rows`` of ``table`` as dicts, each a one-row slice (``take`` would first join the
    table's chunks: a copy of every column)."""
    return [table.slice(r, 1).to_pylist()[0] for r in rows]


#: Rows per Parquet row group of a stored index, and per batch when it is read back: the
#: encoder's and the decoder's buffers are one group's or batch's (pyarrow's default group is
#: 1M rows: ~130 MiB of temporaries at ImageNet's size)
_GROUP_ROWS = 65536


def _read(parquet_file, columns: list[str]):
    """``columns`` of a stored index, decoded a batch of :data:`_GROUP_ROWS` rows at a time."""
    import pyarrow as pa

    schema = parquet_file.schema_arrow
    return pa.Table.from_batches(parquet_file.iter_batches(batch_size=_GROUP_ROWS, columns=columns),
                                 schema=pa.schema([schema.field(c) for c in columns]))


def _class_column(table):
    return first_part(table.column("path"))


def _class_counts(table) -> dict[str, int]:
    import pyarrow.compute as pc

    vc = pc.value_counts(table.column("class"))
    return {str(v["values"]) + "/": int(v["counts"]) for v in vc.to_pylist() if v["values"]}


def _top(table) -> tuple[list[str], int]:
    counts = _class_counts(table)
    return sorted(counts), table.num_rows - sum(counts.values())


class IndexedListing:
    """The listing of split folders for one run, persisted under ``output`` (see module doc).

    ``lister(name)`` is the callable :func:`pipelines.ingest.scan.scan` takes: given the split
    URI it returns the listing table, reused or new. ``lines`` collects what each did."""

    def __init__(self, output: str, options: storage.Store = None, relist: bool = False,
                 check_classes: int = CHECK_CLASSES, check_keys: int = CHECK_KEYS,
                 log: Callable[[str], None] | None = None):
        self.output, self.options, self.relist = output, options, relist
        self.check_classes, self.check_keys = check_classes, check_keys
        self.log = log or (lambda _msg: None)
        self.lines: list[str] = []

    def lister(self, name: str) -> Callable[[str], object]:
        return lambda split_uri: self.records(name, split_uri)

    def _say(self, line: str) -> None:
        self.lines.append(line)
        self.log(line)

    def records(self, name: str, split_uri: str):
        """The listing table of ``split_uri``, reused or new: its columns path and class (what the
        scan reads; the sizes and ETags are only in the stored index)."""
        pq_uri, fp_uri = index_uris(self.output, name)
        why = "--relist" if self.relist else None
        if why is None:
            table, why = self._reuse(split_uri, pq_uri, fp_uri)
            if table is not None:
                release_unused()
                return table
        t0 = time.perf_counter()
        table = list_records(split_uri, self.options)
        table = table.append_column("class", _class_column(table)).select(["path", "class", "size", "etag"])
        dt = time.perf_counter() - t0
        self._write(table, split_uri, pq_uri, fp_uri)
        self._say(f"index {name}: listed {table.num_rows} objects under {split_uri} in {dt:.1f} s ({why}); "
                  f"written to {pq_uri}")
        table = table.select(["path", "class"])  # the sizes and ETags are in the stored index
        release_unused()
        return table

    def _write(self, table, split_uri: str, pq_uri: str, fp_uri: str) -> None:
        import pyarrow.parquet as pq

        from pipelines.ingest.index_file import ROOT_KEY

        buf = io.BytesIO()  # the listed prefix travels in the file: --data <this file> reads the same images
        pq.write_table(table.replace_schema_metadata({ROOT_KEY: split_uri.encode()}), buf)
        storage.write_bytes_atomic(pq_uri, buf.getvalue(), self.options)
        tops, loose = _top(table)
        storage.write_json_atomic(fp_uri, {
            "format": _FORMAT, "version": 1, "prefix": split_uri, "count": table.num_rows,
            "digest": records_digest(table), "top_level": tops, "top_level_objects": loose,
            "class_counts": _class_counts(table), "written_at": time.time()}, self.options)

    def _reuse(self, split_uri: str, pq_uri: str, fp_uri: str):
        """``(table, None)`` when the stored listing passes the cheap check, else ``(None, why)``."""
        import pyarrow.parquet as pq

        if not storage.exists(fp_uri, self.options) or not storage.exists(pq_uri, self.options):
            return None, "no stored index"
        try:
            fp = storage.read_json(fp_uri, self.options)
        except (ValueError, OSError) as e:
            return None, f"stored fingerprint unreadable: {e}"
        if fp.get("format") != _FORMAT or fp.get("prefix") != split_uri:
            return None, "the stored index lists another prefix"
        tops, loose = top_level(split_uri, self.options)
        if tops != fp["top_level"] or loose != fp["top_level_objects"]:
            return None, "the top level changed"
        rng = random.Random()  # a new draw on every check, so repeated checks cover every class
        stored = fp["class_counts"]
        classes = sorted(stored)
        drawn = classes if len(classes) <= self.check_classes else rng.sample(classes, self.check_classes)
        now = count_objects(split_uri, drawn, self.options)
        changed = [c for c in drawn if now[c] != stored[c]]
        if changed:
            return None, f"object count changed under {changed[0]} ({stored[changed[0]]} -> {now[changed[0]]})"
        fs, path = storage.get_fs(pq_uri, self.options)
        with fs.open(path, "rb") as f:  # read as it streams in: no copy of the file's bytes
            stored_file = pq.ParquetFile(f)
            n = stored_file.metadata.num_rows
            if n != fp["count"]:
                return None, "the stored index does not match its fingerprint"
            rows = rng.sample(range(n), min(self.check_keys, n))
            stamps = _rows(_read(stored_file, ["size", "etag"]), rows)  # only the drawn rows kept
            table = _read(stored_file, ["path", "class"])
        paths = [r["path"] for r in _rows(table, rows)]
        heads = head_records(split_uri, paths, self.options)
        for p, st, h in zip(paths, stamps, heads):
            if not p.endswith("/") and h != (st["size"], st["etag"]):
                return None, f"{p} changed"
        self._say(f"index {self._name(pq_uri)}: reused {pq_uri} ({fp['count']} objects; checked the top level, "
                  f"{len(drawn)} of {len(classes)} class counts and {len(rows)} keys; --relist to list again)")
        return table, None

    @staticmethod
    def _name(pq_uri: str) -> str:
        return pq_uri.rstrip("/").rsplit("/", 1)[-1][: -len(".parquet")]
