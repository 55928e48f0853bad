"""The compact forms an index of 1.28M files is held and sent in (issue 29): PathList pickles
compressed, LabelList is one small-integer array whose slices are views, the column-wise scan
filters a Parquet-read column (chunks of up to 1M rows) a bounded piece at a time, and a reused
listing is checked and handed over without the sizes and ETags."""
from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pytest

from pipelines.ingest.pathlist import LabelList, PackedPathList, PathList


def _imagenet_paths(classes: int, per_class: int) -> list[str]:
    return [f"n{c:08d}/n{c:08d}_{i}.JPEG" for c in range(classes) for i in range(per_class)]


def test_pathlist_pickles_compressed_and_round_trips():
    paths = PathList.of(_imagenet_paths(20, 500))
    raw = len(paths._compact()[0]) + 8 * len(paths)  # what the former pickle held: the UTF-8 and int64 offsets
    blob = pickle.dumps(paths)
    assert len(blob) < raw / 5  # ~4 bytes a file here against ~37
    assert pickle.loads(blob) == paths
    share = paths[1::2]  # a rank's share: every other file
    assert pickle.loads(pickle.dumps(share)) == share == tuple(paths)[1::2]
    part = paths[10:20]  # a slice pickles as its own entries only
    assert pickle.loads(pickle.dumps(part)) == tuple(paths)[10:20]
    odd = PathList.of(["é/ü.jpg", "x" * 300 + "/long.jpg", "", "a/b.png"])  # non-ASCII, a length above 255
    assert list(pickle.loads(pickle.dumps(odd))) == list(odd)
    assert len(pickle.loads(pickle.dumps(PathList.of([])))) == 0


def test_packed_pathlist_reads_as_the_tuple_it_packs():
    """Blocks of 7 entries (1,024 in use) so that every read crosses block edges: ints, negative
    ints, contiguous slices of slices (views), stepped slices and take (PathLists), iteration,
    equality both ways with PathList / tuple / list, hash, pickling, concatenation, sizes."""
    ref = tuple(_imagenet_paths(5, 11)) + ("é/ü.jpg", "x" * 300 + "/long.jpg", "", "a/b.png")
    packed = PackedPathList.pack(PathList.of(ref), block=7)
    assert len(packed) == len(ref) and tuple(packed) == ref and packed == ref and list(ref) == packed
    assert [packed[i] for i in range(-len(ref), len(ref))] == list(ref + ref)
    with pytest.raises(IndexError):
        packed[len(ref)]
    view = packed[5:40][3:30]  # a view of a view: blocks shared, not copied
    assert isinstance(view, PackedPathList) and view._blocks is packed._blocks and view == ref[8:35]
    assert view[-1] == ref[34] and tuple(view[::4]) == ref[8:35:4] and isinstance(view[::4], PathList)
    assert packed.take([50, 3, 3, 17]) == (ref[50], ref[3], ref[3], ref[17]) and packed[1::2] == ref[1::2]
    assert packed == PathList.of(ref) and PathList.of(ref) == packed and packed != ref[:-1] and view != ref[8:34]
    assert hash(packed) == hash(PathList.of(ref)) and hash(view) == hash(PathList.of(ref[8:35]))
    assert pickle.loads(pickle.dumps(view)) == ref[8:35] and view.unpacked_nbytes == view.unpack().nbytes
    assert view.unpack() == ref[8:35] and packed[10:10] == () and len(packed[40:5]) == 0
    assert packed[:2] + ("z",) == ref[:2] + ("z",) and PackedPathList.pack(packed) is packed
    big = PackedPathList.pack(_imagenet_paths(100, 100))
    assert big.nbytes < PathList.of(_imagenet_paths(100, 100)).nbytes / 5  # ~3.5 bytes a file against ~30
    assert len(PackedPathList.pack([])) == 0 and list(PackedPathList.pack([])) == []


def test_labellist_is_a_small_shared_tuple():
    values = np.array([3, 0, -1, 2, 2, 999] * 1000)
    labels = LabelList.of(values)
    assert labels.nbytes == 2 * len(values)  # int16 below 32,767 classes
    assert labels == tuple(values.tolist()) and tuple(values.tolist()) == labels and labels == list(values.tolist())
    assert labels != tuple(values.tolist())[:-1]
    assert isinstance(labels[2], int) and labels[2] == -1 and labels[-1] == 999
    part = labels[100:200]
    assert isinstance(part, LabelList) and np.shares_memory(np.asarray(part), np.asarray(labels))  # a view
    assert part == tuple(values[100:200].tolist()) and labels[1::2] == tuple(values[1::2].tolist())
    back = pickle.loads(pickle.dumps(labels[1::2]))
    assert back == labels[1::2] and hash(back) == hash(labels[1::2])
    assert LabelList.of(np.array([70000, -1])).nbytes == 8  # int32 beyond int16
    assert list(LabelList.of([])) == [] and LabelList.of((1, 2)) + (3,) == (1, 2, 3)
    assert pa.array(labels[:5], pa.int64()).to_pylist() == values[:5].tolist()


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
    assert listed == walked == reused and isinstance(reused.labels, LabelList)
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
