"""Listing as compact records (pipelines.ingest.listing) and the persisted index
(pipelines.ingest.index_store), against moto's S3 server in its own process with a
request-counting middleware (benchmarks/s3server.py) and against local folders."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(_REPO, "benchmarks"))

import listing_bench as lb  # noqa: E402

#: Most driver heap per listed key (Python heap + Arrow pool), issue 29's budget.
HEAP_PER_KEY_BUDGET = 300


@pytest.fixture(scope="module")
def counting_s3():
    lb.fake_aws_env()
    proc, ep = lb.start_server()
    try:
        yield ep
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _serial_listing(ep: str, bucket: str, prefix: str) -> dict[str, tuple[int, str]]:
    """Ground truth: one plain serial ListObjectsV2 walk, key -> (size, etag)."""
    from pipelines.ingest.listing import s3_client

    out = {}
    for page in s3_client(ep).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for c in page.get("Contents", ()):
            out[c["Key"][len(prefix) + 1:]] = (int(c["Size"]), c["ETag"].strip('"'))
    return out


def test_local_listing_matches_the_tree(tmp_path):
    from pipelines.ingest.listing import count_objects, list_records, top_level

    (tmp_path / "b" / "deep").mkdir(parents=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "empty").mkdir()
    files = {"a/1.jpg": b"xx", "a/2.jpg": b"yyy", "b/deep/3.jpg": b"z", "top.txt": b"t"}
    for rel, data in files.items():
        (tmp_path / rel).write_bytes(data)
    t = list_records(str(tmp_path)).to_pydict()
    assert t["path"] == sorted(list(files) + ["a/", "b/", "b/deep/", "empty/"])
    sizes = dict(zip(t["path"], t["size"]))
    assert all(sizes[rel] == len(data) for rel, data in files.items())
    assert dict(zip(t["path"], t["etag"]))["a/1.jpg"] == str(os.stat(tmp_path / "a/1.jpg").st_mtime_ns)
    assert top_level(str(tmp_path)) == (["a/", "b/", "empty/"], 1)
    assert count_objects(str(tmp_path), ["a/", "b/", "empty/"]) == {"a/": 3, "b/": 3, "empty/": 1}


def test_s3_listing_holds_every_key_once(counting_s3):
    from pipelines.ingest.listing import list_records, s3_client

    ep = counting_s3
    lb.put_tree(ep, "listing-small", "ds/train", classes=24, per_class=5)
    client = s3_client(ep)
    client.put_object(Bucket="listing-small", Key="ds/train/README.txt", Body=b"hello")
    client.put_object(Bucket="listing-small", Key="ds/train/n99999999/", Body=b"")  # an empty class folder
    client.put_object(Bucket="listing-small", Key="ds/trainer/x.JPEG", Body=b"x")  # a sibling prefix: not listed
    truth = _serial_listing(ep, "listing-small", "ds/train")
    lb.counts(ep, reset=True)
    t = list_records("s3://listing-small/ds/train", ep).to_pydict()
    seen = lb.counts(ep)
    assert t["path"] == sorted(truth) and len(set(t["path"])) == len(t["path"]) == 24 * 5 + 2
    assert {p: (s, e) for p, s, e in zip(t["path"], t["size"], t["etag"])} == truth
    assert seen["list"] == 1 + 25  # the top level, then one page per class prefix
    assert seen["max_in_flight"] >= 2  # class prefixes listed side by side (a serial walk has 1)


def _measure(uri: str, ep: str) -> dict:
    out = subprocess.run([sys.executable, os.path.join(_REPO, "benchmarks", "listing_bench.py"), "measure", uri,
                          "--endpoint", ep], capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_s3_listing_parallel_and_small_heap(counting_s3):
    """5,000 keys in 100 class prefixes: >= 8 requests in flight at the server, every key once,
    and the heap the listing adds per key (between 1,000 and 5,000 keys in the same 100
    prefixes, so the per-thread constant cancels) within the budget."""
    ep = counting_s3
    lb.put_tree(ep, "listing-1k", "train", classes=100, per_class=10)
    lb.put_tree(ep, "listing-5k", "train", classes=100, per_class=50)
    small = _measure("s3://listing-1k/train", ep)
    big = _measure("s3://listing-5k/train", ep)
    assert small["keys"] == small["unique_keys"] == 1000
    assert big["keys"] == big["unique_keys"] == 5000
    assert big["server"]["list"] == 101
    assert big["server"]["max_in_flight"] >= 8, big
    heap = lambda m: m["python_heap_peak"] + m["arrow_peak"]  # noqa: E731
    slope = (heap(big) - heap(small)) / (5000 - 1000)
    assert slope <= HEAP_PER_KEY_BUDGET, (slope, small, big)


def _tree(tmp_path, classes=6, per_class=5):
    from imagegen import jpeg_bytes, random_rgb

    root = tmp_path / "data" / "train"
    for c in range(classes):
        (root / f"n{c:04d}").mkdir(parents=True)
        for i in range(per_class):
            (root / f"n{c:04d}" / f"img{i}.JPEG").write_bytes(jpeg_bytes(random_rgb(f"{c}-{i}")))
    return root


def test_index_is_persisted_and_reused_on_s3(counting_s3):
    from pipelines.ingest.index import DataConfig
    from pipelines.ingest.index_store import IndexedListing, index_uris
    from pipelines.ingest.listing import s3_client
    from pipelines.ingest.scan import scan
    from pipelines.storage.uris import StorageOptions

    ep = counting_s3
    lb.put_tree(ep, "index-reuse", "data/train", classes=6, per_class=5)
    uri, out = "s3://index-reuse/data/train", "s3://index-reuse/runs/r1"
    dc = DataConfig(root="s3://index-reuse/data", split="train", storage_options=StorageOptions(ep))
    lb.counts(ep, reset=True)
    first = IndexedListing(out, ep)
    direct = scan(dc)
    listed = scan(dc, first.lister("train"))
    assert listed.paths == direct.paths and listed.fingerprint == direct.fingerprint
    assert first.lines[0].startswith("index train: listed 30 objects") and "no stored index" in first.lines[0]
    pq_uri, fp_uri = index_uris(out, "train")
    import io

    import pyarrow.parquet as pq

    from pipelines.storage import uris as storage

    stored = pq.read_table(io.BytesIO(storage.read_bytes(pq_uri, ep)))
    assert stored.column_names == ["path", "class", "size", "etag"]
    assert sorted(stored.column("path").to_pylist()) == sorted(set(stored.column("path").to_pylist()))
    assert stored.num_rows == 30 and set(stored.column("class").to_pylist()) == {f"n{c:08d}" for c in range(6)}
    assert storage.read_json(fp_uri, ep)["count"] == 30

    lb.counts(ep, reset=True)
    again = IndexedListing(out, ep, check_classes=2)
    reused = again.records("train", uri)
    seen = lb.counts(ep)
    assert again.lines[0].startswith("index train: reused") and "2 of 6 class counts" in again.lines[0]
    assert seen["list"] == 1 + 2  # the top level and two class counts, not the 1 + 6 of a listing
    assert seen["head"] >= 16  # the sampled keys (and the existence checks of the stored files)
    assert scan(dc, lambda _uri: reused).fingerprint == direct.fingerprint

    s3_client(ep).put_object(Bucket="index-reuse", Key="data/train/n00000003/extra.JPEG", Body=b"x")
    changed = IndexedListing(out, ep, check_classes=6)
    assert len(scan(dc, changed.lister("train"))) == 31
    assert "object count changed under n00000003/ (5 -> 6)" in changed.lines[0]
    forced = IndexedListing(out, ep, relist=True)
    forced.records("train", uri)
    assert "(--relist)" in forced.lines[0]


def test_index_reuse_local_detects_a_changed_file(tmp_path):
    from pipelines.ingest.index import DataConfig
    from pipelines.ingest.index_store import IndexedListing
    from pipelines.ingest.scan import scan

    root = _tree(tmp_path, classes=3, per_class=4)
    dc = DataConfig(root=str(root.parent), split="train")
    out = str(tmp_path / "out")
    a = scan(dc, IndexedListing(out).lister("train"))
    assert a.fingerprint == scan(dc).fingerprint
    b_list = IndexedListing(out, check_keys=100)
    assert scan(dc, b_list.lister("train")).fingerprint == a.fingerprint and "reused" in b_list.lines[0]
    (root / "n0001" / "img2.JPEG").write_bytes(b"not the same bytes any more")
    c_list = IndexedListing(out, check_keys=100)
    scan(dc, c_list.lister("train"))
    assert "listed" in c_list.lines[0] and "n0001/img2.JPEG changed" in c_list.lines[0]


def test_data_index_parquet_gives_the_folder_scan(tmp_path):
    """--data index.parquet: a Parquet of paths (absolute here) with class names and a split
    column gives each split exactly what scanning its folder gives; the run's own persisted
    listing is such a file too (its paths relative to the listed prefix)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipelines.ingest.index import DataConfig, DataError
    from pipelines.ingest.index_store import IndexedListing, index_uris
    from pipelines.ingest.scan import scan

    root = _tree(tmp_path, classes=3, per_class=4)
    val = tmp_path / "data" / "val"
    for c in range(3):
        (val / f"n{c:04d}").mkdir(parents=True)
        (val / f"n{c:04d}" / "v.JPEG").write_bytes((root / f"n{c:04d}" / "img0.JPEG").read_bytes())
    want = {s: scan(DataConfig(root=str(tmp_path / "data"), split=s)) for s in ("train", "val")}
    rows = [(str(tmp_path / "data" / s / p), want[s].classes[y], s) for s in want for p, y in
            zip(want[s].paths, want[s].labels)]
    idx = tmp_path / "index.parquet"
    pq.write_table(pa.table({"path": [r[0] for r in rows], "class": [r[1] for r in rows],
                             "split": [r[2] for r in rows]}), idx)
    for s, w in want.items():
        got = scan(DataConfig(root=str(idx), split=s))
        assert (got.root, got.classes, got.fingerprint) == (w.root, w.classes, w.fingerprint)
    with pytest.raises(DataError, match="no rows of split 'test'"):
        scan(DataConfig(root=str(idx), split="test"))
    out = str(tmp_path / "out")
    IndexedListing(out).records("train", str(root))
    again = scan(DataConfig(root=index_uris(out, "train")[0], split="train"))
    assert (again.root, again.fingerprint) == (want["train"].root, want["train"].fingerprint)


def test_column_scan_equals_the_walk_on_an_odd_tree(tmp_path):
    """The listing table's column-wise ImageFolder scan (no Python object per file) gives the
    index the folder walk gives: hidden parts, folder markers, nested and empty folders,
    top-level files, suffix case and multi-dot names, an explicit class list, sorted order."""
    from pipelines.ingest.index import DataConfig
    from pipelines.ingest.index_store import IndexedListing
    from pipelines.ingest.pathlist import PackedPathList
    from pipelines.ingest.scan import scan

    files = ["b/x.JPG", "b/y.tar.jpeg", "b/deep/z.png", "b/.hid.jpg", "b/.git/k.jpg", "b/notes.txt", "b/x.",
             "a-b/q.jpg", "a/r.jpg", "a/s..jpg", "top.jpg", ".hidden/t.jpg", "e/.keep"]
    for f in files:
        (tmp_path / "train" / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "train" / f).write_bytes(b"x")
    (tmp_path / "train" / "empty").mkdir()
    for kw in ({}, {"classes": ("a", "a-b", "b", "e", "empty", "zz")}, {"extensions": None}):
        dc = DataConfig(root=str(tmp_path), split="train", **kw)
        walked = scan(dc)
        listing = IndexedListing(str(tmp_path / f"out{len(kw)}{'classes' in kw}"))
        col = scan(dc, listing.lister("train"))
        assert isinstance(col.paths, PackedPathList) and list(col.paths) == sorted(col.paths)
        assert col == walked, kw
    part = col.paths[1:3]  # a slice shares the blocks; it pickles as its own entries only
    import pickle
    back = pickle.loads(pickle.dumps(part))
    assert back == part == tuple(col.paths)[1:3] and back.nbytes == part.unpacked_nbytes < col.paths.unpacked_nbytes
