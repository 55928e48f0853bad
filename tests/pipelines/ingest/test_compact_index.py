"""The memory of an index of 1.28M files on the driver (issue 29): the column-wise scan filters a
Parquet-read column (chunks of up to 1M rows) a bounded piece at a time, and a reused listing
is checked and handed over without the sizes and ETags."""
from __future__ import annotations

import pyarrow as pa
import pytest


def _imagenet_paths(classes: int, per_class: int) -> list[str]:
    return [f"n{c:08d}/n{c:08d}_{i}.JPEG" for c in range(classes) for i in range(per_class)]


def test_column_scan_of_large_chunks_equals_the_walk(tmp_path, monkeypatch):
    """The scan filters a column a piece at a time (pieces smaller than its chunks here, as a
    Parquet-read column's 1M-row chunks are at ImageNet's size): the same index as the walk."""
    from pipelines.ingest import table_scan
    from pipelines.ingest.index import DataConfig
    from pipelines.ingest.index_store import IndexedListing
    from pipelines.ingest.scan import scan

    for c in range(3):
        for i in range(5):
            (tmp_path / "train" / f"n{c:04d}").mkdir(parents=True, exist_ok=True)
            (tmp_path / "train" / f"n{c:04d}" / f"img{i}.JPEG").write_bytes(b"x")
    (tmp_path / "train" / "n0001" / "notes.txt").write_bytes(b"x")
    dc = DataConfig(root=str(tmp_path), split="train")
    walked = scan(dc)
    monkeypatch.setattr(table_scan, "_FILTER_ROWS", 4)
    out = str(tmp_path / "out")
    listed = scan(dc, IndexedListing(out).lister("train"))
    reused_listing = IndexedListing(out)
    table = reused_listing.records("train", str(tmp_path / "train"))
    assert "reused" in reused_listing.lines[0] and table.column_names == ["path", "class"]
    reused = scan(dc, lambda _uri: pa.Table.from_batches(table.to_batches(max_chunksize=7)))  # chunks of 7 rows
    assert listed == walked == reused
    assert reused.labels[5:10] == walked.labels[5:10] and reused.ignored == 1


@pytest.mark.parametrize("total,count", [(None, None), (True, None), (None, True), (True, True)])
def test_pathlist_of_fills_in_place(total, count):
    from pipelines.ingest.table_scan import pathlist_of

    strings = _imagenet_paths(2, 7)
    chunks = [pa.array(strings[:5]), pa.array(strings[5:5]), pa.array(strings[5:]).slice(0)]
    n_bytes = sum(len(s.encode()) for s in strings)
    got = pathlist_of(chunks, n_bytes if total else None, len(strings) if count else None)
    assert got == tuple(strings)
    with pytest.raises(ValueError, match="announced"):
        pathlist_of([pa.array(strings)], None, len(strings) + 1)
