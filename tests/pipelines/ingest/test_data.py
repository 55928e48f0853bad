"""pipelines.ingest: scanning, partitions, decoding, bad inputs, Parquet, S3, Ray Data and Ray Train.

Real JPEG/PNG files (tests/pipelines/imagegen.py), real local Ray (``ray_session``), real S3
API over HTTP (``moto_s3``). Reference tensors come from torchvision's classic
``transforms.Compose([Resize, CenterCrop, ToTensor, Normalize])`` on ``Image.open(f).convert("RGB")``.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from imagegen import ALL_CLASSES, BAD_CASES, EMPTY_WNID, WNIDS, make_imagenet_tree, write_loc_csv
from pipelines.storage import uris as storage
from pipelines.ingest.batches import (
    SkipReport,
    build_dataset,
    decode_batch,
    exact_split_data_config,
    iter_local_batches,
    iter_valid_batches,
)
from pipelines.ingest.index import IMAGE_EXTENSIONS, IMAGENET_MEAN, IMAGENET_STD, DataConfig, DataError, partition
from pipelines.ingest.parquet import convert_to_parquet
from pipelines.ingest.scan import scan

SMALL = dict(image_size=20, resize_size=24)  # 40x30 images -> 32x24 -> crop 20x20


def reference(path: Path, image_size: int, resize_size: int) -> torch.Tensor:
    from torchvision import transforms as T

    t = T.Compose([T.Resize(resize_size), T.CenterCrop(image_size), T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    with Image.open(path) as im:
        return t(im.convert("RGB"))


def decode_all(rows) -> dict[str, tuple[np.ndarray, int, bool]]:
    """path -> (image, label, valid) from an iterable of column batches."""
    out = {}
    for b in rows:
        for img, y, p, v in zip(b["image"], b["label"], b["path"], b["valid"]):
            assert str(p) not in out, f"duplicate row {p}"
            out[str(p)] = (np.asarray(img), int(y), bool(v))
    return out


@pytest.fixture(scope="module")
def bad_tree(tmp_path_factory):
    return make_imagenet_tree(tmp_path_factory.mktemp("bad"), bad=True)


@pytest.fixture(scope="module")
def clean_tree(tmp_path_factory):
    return make_imagenet_tree(tmp_path_factory.mktemp("clean"), bad=False)


# ----------------------------------------------------------------------------- scanning


def test_scan_imagefolder_class_order_and_counts(clean_tree):
    idx = scan(DataConfig(root=str(clean_tree.root), split="train"))
    assert idx.classes == ALL_CLASSES == tuple(sorted(ALL_CLASSES))
    assert idx.classes.index(EMPTY_WNID) == 1  # the empty folder keeps its index (labels stay aligned)
    assert idx.empty_classes == (EMPTY_WNID,)
    assert idx.paths == clean_tree.train_good == tuple(sorted(idx.paths))
    assert idx.labels == tuple(ALL_CLASSES.index(p.split("/")[0]) for p in idx.paths)
    assert idx.class_counts == (3, 0, 3, 3) and idx.num_scanned == 9
    assert idx.format == "imagefolder" and idx.root == str(clean_tree.root / "train")
    # root that already is the split dir; file:// URI; a second scan -> identical index
    for cfg in (
        DataConfig(root=str(clean_tree.root / "train"), split=None),
        DataConfig(root="file://" + str(clean_tree.root), split="train"),
    ):
        other = scan(cfg)
        assert (other.paths, other.labels, other.classes, other.fingerprint) == (
            idx.paths, idx.labels, idx.classes, idx.fingerprint,
        )
    # explicit class list (e.g. the model's 1000 wnids): extra classes are reserved and reported empty
    more = scan(DataConfig(root=str(clean_tree.root), classes=ALL_CLASSES + ("n00000001",)))
    assert more.classes[0] == "n00000001" and more.labels == tuple(y + 1 for y in idx.labels)
    assert set(more.empty_classes) == {"n00000001", EMPTY_WNID}


def test_scan_flat_val_with_csv(clean_tree, tmp_path):
    idx = scan(DataConfig(root=str(clean_tree.root), split="val"))  # CSV found in root, classes from train/
    assert idx.classes == ALL_CLASSES
    assert idx.paths == tuple(sorted(clean_tree.val_labels))
    assert idx.labels == tuple(ALL_CLASSES.index(clean_tree.val_labels[p]) for p in idx.paths)
    assert idx.unmatched_label_rows == 0 and EMPTY_WNID in idx.empty_classes
    # explicit CSV with extra rows (a partial val copy): allowed, counted
    csv2 = tmp_path / "labels.csv"
    ids = {n.rsplit(".", 1)[0]: w for n, w in clean_tree.val_labels.items()}
    write_loc_csv(csv2, ids, extra_rows={"ILSVRC2012_val_00049999": WNIDS[0]})
    idx2 = scan(DataConfig(root=str(clean_tree.root), split="val", labels_csv=str(csv2), classes=ALL_CLASSES))
    assert (idx2.paths, idx2.labels) == (idx.paths, idx.labels) and idx2.unmatched_label_rows == 1


def _one_line_error(cfg, match):
    with pytest.raises(DataError, match=match) as e:
        scan(cfg)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_scan_errors(clean_tree, tmp_path):
    root = str(clean_tree.root)
    _one_line_error(DataConfig(root=str(tmp_path / "nope")), "data root does not exist")
    _one_line_error(DataConfig(root=root, split="test"), r"no split 'test' .*found: LOC_val_solution.csv, train, val")
    empty = tmp_path / "empty"
    for w in WNIDS:
        (empty / "train" / w).mkdir(parents=True)
    _one_line_error(DataConfig(root=str(empty)), "no image files found")
    # CSV that misses a file
    ids = {n.rsplit(".", 1)[0]: w for n, w in clean_tree.val_labels.items()}
    first = sorted(ids)[0]
    short = tmp_path / "short.csv"
    write_loc_csv(short, {k: v for k, v in ids.items() if k != first})
    _one_line_error(DataConfig(root=root, split="val", labels_csv=str(short)), rf"1 file\(s\) .* no row .*{first}")
    # CSV naming a wnid the class list does not have
    unk = tmp_path / "unknown.csv"
    write_loc_csv(unk, dict(ids, **{first: "n99999999"}))
    _one_line_error(DataConfig(root=root, split="val", labels_csv=str(unk)), "1 wnid.* not in the class list: n99999999")
    bad_header = tmp_path / "hdr.csv"
    bad_header.write_text("id,label\nx,n01440764\n")
    _one_line_error(DataConfig(root=root, split="val", labels_csv=str(bad_header)), "needs columns ImageId,PredictionString")
    # flat dir without CSV; flat dir without class list
    flat = tmp_path / "flat"
    (flat / "val").mkdir(parents=True)
    (flat / "val" / "a.JPEG").write_bytes(b"x")
    _one_line_error(DataConfig(root=str(flat), split="val"), "has no class folders; pass labels_csv")
    _one_line_error(DataConfig(root=str(flat), split="val", labels_csv=str(short)), "needs the class list")
    # a class folder outside an explicit class list
    _one_line_error(DataConfig(root=root, classes=ALL_CLASSES[:3]), r"1 class folder\(s\) .* not in the class list: n01484850")
    with pytest.raises(ValueError, match="unknown data format 'tfrecord'; valid: auto, imagefolder, parquet"):
        DataConfig(root=root, format="tfrecord")


def test_unlabeled_flat_dir(clean_tree):
    idx = scan(DataConfig(root=str(clean_tree.root / "val"), split=None, unlabeled=True))
    assert idx.classes == () and set(idx.labels) == {-1} and len(idx) == len(clean_tree.val_labels)


# ----------------------------------------------------------------------------- subsets and partitions


def _h(p: str) -> str:
    return hashlib.sha1(p.encode()).hexdigest()


def test_subsets_are_deterministic_hash_rules(bad_tree):
    full = scan(DataConfig(root=str(bad_tree.root)))
    sub = scan(DataConfig(root=str(bad_tree.root), per_class=2))
    expect = []
    for c in range(len(full.classes)):
        members = [p for p, y in zip(full.paths, full.labels) if y == c]
        expect += sorted(members, key=_h)[:2]
    assert sub.paths == tuple(sorted(expect))
    assert sub.class_counts == (2, 0, 2, 2) and sub.num_scanned == len(full)
    lim = scan(DataConfig(root=str(bad_tree.root), limit=5))
    assert lim.paths == tuple(sorted(sorted(full.paths, key=_h)[:5]))
    both = scan(DataConfig(root=str(bad_tree.root), per_class=2, limit=4))
    assert both.paths == tuple(sorted(sorted(sub.paths, key=_h)[:4]))
    assert scan(DataConfig(root=str(bad_tree.root), per_class=2, limit=4)).fingerprint == both.fingerprint


def test_partitions_fixed_and_stable(bad_tree):
    idx = scan(DataConfig(root=str(bad_tree.root)))
    n = len(idx)  # 17
    parts = partition(idx, num_partitions=3)
    assert [len(p) for p in parts] == [6, 6, 5] and [p.id for p in parts] == [0, 1, 2]
    assert [p.name for p in parts] == ["part-00000-of-00003", "part-00001-of-00003", "part-00002-of-00003"]
    assert sum((p.paths for p in parts), ()) == idx.paths and sum((p.labels for p in parts), ()) == idx.labels
    again = partition(scan(DataConfig(root=str(bad_tree.root))), num_partitions=3)
    assert [(p.paths, p.fingerprint) for p in again] == [(p.paths, p.fingerprint) for p in parts]
    assert len({p.fingerprint for p in parts}) == 3
    by_size = partition(idx, partition_size=4)
    assert [len(p) for p in by_size] == [4, 4, 4, 4, 1] and by_size[-1].num_partitions == 5
    assert len(partition(idx)) == 1 and partition(idx)[0].paths == idx.paths
    with pytest.raises(ValueError, match="not both"):
        partition(idx, num_partitions=2, partition_size=3)
    with pytest.raises(ValueError, match="exceeds the number of files"):
        partition(idx, num_partitions=n + 1)


def test_rank_shares_are_disjoint_and_cover_the_partition(bad_tree):
    """What each of ``world`` Train workers reads of a partition (``rank_share``): entries
    ``rank::world``, disjoint, together the partition; ``None`` for a rank with nothing to read."""
    from pipelines.ingest.index import rank_share

    part = partition(scan(DataConfig(root=str(bad_tree.root))), num_partitions=3)[2]  # 5 entries
    for world in (1, 2, 3, 5, 7):
        shares = [rank_share(part, r, world) for r in range(world)]
        got = [s for s in shares if s is not None]
        assert len(got) == min(world, len(part)) and all(shares[r] is None for r in range(len(part), world))
        assert sorted(p for s in got for p in s.paths) == sorted(part.paths)
        assert sum(len(s) for s in got) == len(part) and all(type(s) is type(part) and s.id == part.id for s in got)
        pairs = {(p, y) for s in got for p, y in zip(s.paths, s.labels)}
        assert pairs == set(zip(part.paths, part.labels))
    with pytest.raises(ValueError, match="rank must be in"):
        rank_share(part, 2, 2)


def test_index_partitions_reach_the_workers_as_indexes_not_datasets(bad_tree, ray_session):
    """The curvature and subnet passes give the trainer no dataset for index partitions (no
    split coordinator per partition up front): one small object with the decode settings and
    one object ref per partition and rank, each holding only that rank's share (a worker never
    fetches the whole index); only ready-made Ray Datasets go to the trainer."""
    from pipelines.distributed import put_sources
    from pipelines.distributed.workers import fetch_share, share_bytes
    from pipelines.ingest.index import rank_share

    cfg = DataConfig(root=str(bad_tree.root))
    parts = partition(scan(cfg), num_partitions=3)
    by_id = {p.id: p for p in parts}
    ref, ready = put_sources(by_id, list(by_id), cfg, world=2)
    assert ready == {}
    got = ray_session.get(ref)
    assert got["data_config"] == cfg and got["world"] == 2 and list(got["shares"]) == [p.id for p in parts]
    for p in parts:
        mine = ray_session.get(list(got["shares"][p.id]))
        assert [s.paths for s in mine] == [rank_share(p, r, 2).paths for r in range(2)]
        assert [fetch_share(got, p.id, r, 2)[0].paths for r in range(2)] == [s.paths for s in mine]
        # a job that runs with another number of workers still gets the right shares
        assert [fetch_share(got, p.id, r, 3)[0].paths for r in range(3)] == [rank_share(p, r, 3).paths for r in range(3)]
    assert sum(got["bytes"]) == sum(share_bytes(rank_share(p, r, 2)) for p in parts for r in range(2)) > 0
    assert share_bytes(rank_share(parts[0], 0, 2)) < share_bytes(parts[0])  # a share, not the whole partition
    ds = build_dataset(parts[0], cfg)
    ref, ready = put_sources({0: ds, 1: parts[1]}, [0, 1], cfg)
    assert list(ready) == [0] and ready[0] is ds and list(ray_session.get(ref)["shares"]) == [1]


# ----------------------------------------------------------------------------- decoding (no Ray)


def test_transform_matches_torchvision_reference(clean_tree):
    cfg = DataConfig(root=str(clean_tree.root))  # defaults: 256 -> 224, ImageNet mean/std
    idx = scan(cfg)
    got = decode_all(iter_local_batches(idx, cfg, batch_size=4))
    assert set(got) == set(idx.paths)
    for p, y in zip(idx.paths, idx.labels):
        img, label, valid = got[p]
        ref = reference(clean_tree.root / "train" / p, 224, 256)
        assert valid and label == y and img.dtype == np.float32 and img.shape == (3, 224, 224)
        assert torch.equal(torch.from_numpy(img), ref), p


@pytest.mark.parametrize(
    "wh, image_size, resize_size",
    [((41, 30), 20, 25), ((30, 41), 20, 25), ((33, 33), 33, 33), ((45, 31), 40, 24), ((31, 45), 29, 29)],
)
def test_eval_transform_edge_cases(tmp_path, wh, image_size, resize_size):
    """Landscape / portrait, no-op resize, crop larger than the resized image (zero padding),
    odd margins (round-half-even crop offsets): bit-identical to torchvision."""
    from imagegen import jpeg_bytes, random_rgb

    from pipelines.ingest.decode import decode_image

    f = tmp_path / "x.JPEG"
    f.write_bytes(jpeg_bytes(random_rgb(f"edge{wh}", wh)))
    x, err = decode_image(f.read_bytes(), image_size, resize_size)
    assert err == "" and x.shape == (3, image_size, image_size)
    assert torch.equal(torch.from_numpy(x), reference(f, image_size, resize_size))


def test_bad_inputs_local(bad_tree, clean_tree):
    cfg = DataConfig(root=str(bad_tree.root), **SMALL)
    idx = scan(cfg)
    assert len(idx) == len(bad_tree.train_good) + len(BAD_CASES)
    assert (idx.ignored, idx.ignored_examples) == (1, ("n01443537/notes.txt",))  # not an image suffix
    got = decode_all(iter_local_batches(idx, cfg, batch_size=5))
    invalid = {p for p, (_, _, v) in got.items() if not v}
    assert invalid == set(bad_tree.train_invalid) and len(invalid) == 4
    for p in invalid:
        assert not got[p][0].any()  # zero image keeps the batch shape
    clean = decode_all(iter_local_batches(scan(DataConfig(root=str(clean_tree.root), **SMALL)), cfg))
    for p in bad_tree.train_good:
        assert np.array_equal(got[p][0], clean[p][0]) and got[p][1] == clean[p][1], p
    for p in bad_tree.train_converted:  # gray, CMYK, RGBA-as-.JPEG, palette PNG -> RGB
        assert torch.equal(torch.from_numpy(got[p][0]), reference(bad_tree.root / "train" / p, **SMALL)), p

    batches = list(iter_valid_batches(iter_local_batches(idx, cfg, batch_size=5)))
    ys = torch.cat([b.y for b in batches])
    skipped, num_valid = SkipReport(), 0
    for b in batches:
        skipped, num_valid = skipped.merge(b.skipped), num_valid + int(b.x.shape[0])
    assert num_valid == len(ys) == len(idx) - 4 and skipped.count == 4
    assert set(skipped.paths) == invalid
    reasons = dict(skipped.examples)
    assert reasons["n01443537/zero.JPEG"] == "empty file" and "truncated" in reasons["n01440764/truncated.JPEG"]


def test_files_are_indexed_by_image_suffix(bad_tree, tmp_path):
    """Image suffixes in any case are indexed; other files are ignored, counted and named (first
    three); ``extensions`` widens or narrows the set; a folder with no image says what it holds."""
    val = scan(DataConfig(root=str(bad_tree.root), split="val", classes=tuple(ALL_CLASSES), **SMALL))
    assert len(val) == len(bad_tree.val_labels) and (val.ignored, val.ignored_examples) == (1, ("README.md",))
    d = tmp_path / "mixed" / "a"
    d.mkdir(parents=True)
    for name in ("x.JPG", "y.Png", "z.tiff", "w.webp", "n1.txt", "n2.json", "n3.md", "n4.heic"):
        (d / name).write_bytes(b"")
    idx = scan(DataConfig(root=str(tmp_path / "mixed"), split=None))
    assert idx.paths == ("a/w.webp", "a/x.JPG", "a/y.Png", "a/z.tiff")
    assert idx.ignored == 4 and idx.ignored_examples == ("a/n1.txt", "a/n2.json", "a/n3.md")
    assert idx.summary()["ignored_examples"] == ["a/n1.txt", "a/n2.json", "a/n3.md"]
    wide = scan(DataConfig(root=str(tmp_path / "mixed"), split=None, extensions=IMAGE_EXTENSIONS + (".heic",)))
    assert "a/n4.heic" in wide.paths and wide.ignored == 3
    (tmp_path / "text" / "a").mkdir(parents=True)
    (tmp_path / "text" / "a" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=r"no image files found .*1 other file\(s\), e.g. a/notes.txt"):
        scan(DataConfig(root=str(tmp_path / "text"), split=None))


def test_skip_report_merge_is_order_free():
    a = SkipReport.from_rows([(f"a{i}", "x") for i in range(7)])
    b = SkipReport.from_rows([(f"b{i}", "y") for i in range(7)])
    c = SkipReport.from_rows([("0c", "z")])
    m1, m2 = a.merge(b).merge(c), c.merge(b.merge(a))
    assert m1 == m2 and m1.count == 15 and len(m1.examples) == 10 and m1.paths[0] == "0c"
    assert SkipReport.from_dict(m1.to_dict()) == m1 and SkipReport().merge(a) == a


def test_parquet_round_trip(bad_tree, tmp_path):
    cfg = DataConfig(root=str(bad_tree.root), **SMALL)
    idx = scan(cfg)
    shards = convert_to_parquet(idx, str(tmp_path / "pq" / "train"), rows_per_file=5)
    assert len(shards) == 4
    pcfg = DataConfig(root=str(tmp_path / "pq"), split="train", **SMALL)
    pidx = scan(pcfg)
    assert pidx.format == "parquet"
    assert (pidx.classes, pidx.paths, pidx.labels, pidx.empty_classes) == (
        idx.classes, idx.paths, idx.labels, idx.empty_classes,
    )
    assert pidx.fingerprint == idx.fingerprint
    ref = decode_all(iter_local_batches(idx, cfg, batch_size=4))
    # partitions that cut across shard boundaries read the right rows
    got = decode_all(b for part in partition(pidx, partition_size=3) for b in iter_local_batches(part, pcfg, 2))
    assert got.keys() == ref.keys()
    for p in ref:
        assert np.array_equal(got[p][0], ref[p][0]) and got[p][1:] == ref[p][1:], p
    # a single shard file as root, class list from the schema metadata
    one = scan(DataConfig(root=shards[0], split=None, format="parquet", **SMALL))
    assert one.classes == idx.classes and one.paths == idx.paths[:5]


# ----------------------------------------------------------------------------- Ray Data, S3, Ray Train


def _ray_decode(ds) -> tuple[dict, SkipReport]:
    out, skipped = {}, SkipReport()
    for b in iter_valid_batches(ds, batch_size=4):
        skipped = skipped.merge(b.skipped)
        assert b.x.dtype == torch.float32 and b.y.dtype == torch.int64
        for p, x, y in zip(b.paths, b.x, b.y):
            assert p not in out
            out[p] = (x.numpy(), int(y))
    return out, skipped


@pytest.mark.ray
def test_ray_dataset_matches_local(ray_session, bad_tree, tmp_path):
    cfg = DataConfig(root=str(bad_tree.root), decode_batch_size=4, **SMALL)
    idx = scan(cfg)
    local = decode_all(iter_local_batches(idx, cfg))
    part = partition(idx, num_partitions=2)[1]  # a partition (the second half) ...
    got, skipped = _ray_decode(build_dataset(part, cfg))
    assert set(got) | {p for p in part.paths if not local[p][2]} == set(part.paths)
    rest = partition(idx, num_partitions=2)[0]  # ... and the other one, decoded in-process
    got.update({p: (v[0], v[1]) for p, v in decode_all(iter_local_batches(rest, cfg)).items() if v[2]})
    skipped = skipped.merge(SkipReport.from_rows([(p, "") for p in rest.paths if not local[p][2]]))
    assert skipped.count == 4 and set(skipped.paths) == set(bad_tree.train_invalid)
    assert set(got) == {p for p, v in local.items() if v[2]}
    for p, (x, y) in got.items():
        assert np.array_equal(x, local[p][0]) and y == local[p][1], p
    # Parquet through Ray too
    convert_to_parquet(idx, str(tmp_path / "pq" / "train"), rows_per_file=6)
    pcfg = DataConfig(root=str(tmp_path / "pq"), decode_batch_size=4, **SMALL)
    pgot, pskip = _ray_decode(build_dataset(scan(pcfg), pcfg))
    assert pskip.count == 4 and pgot.keys() == got.keys()
    assert all(np.array_equal(pgot[p][0], got[p][0]) for p in got)


def _upload(local_root: Path, bucket_uri: str, prefix: str, ep: str, markers=()) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=ep)
    bucket = bucket_uri[len("s3://"):]
    for f in sorted(local_root.rglob("*")):
        if f.is_file():
            client.put_object(Bucket=bucket, Key=f"{prefix}/{f.relative_to(local_root).as_posix()}", Body=f.read_bytes())
    for m in markers:  # S3 has no empty folders; a "dir/" marker object stands for one
        client.put_object(Bucket=bucket, Key=f"{prefix}/{m}/", Body=b"")


@pytest.mark.ray
@pytest.mark.s3
def test_s3_matches_local(ray_session, moto_s3, s3_bucket, bad_tree):
    bucket, ep = s3_bucket
    _upload(bad_tree.root, bucket, "imagenet", ep, markers=[f"train/{EMPTY_WNID}"])
    root = storage.join(bucket, "imagenet")
    opts = storage.StorageOptions(ep)
    lcfg = DataConfig(root=str(bad_tree.root), decode_batch_size=4, **SMALL)
    scfg = DataConfig(root=root, storage_options=opts, decode_batch_size=4, **SMALL)
    lidx, sidx = scan(lcfg), scan(scfg)
    assert sidx.root == f"{root}/train"
    assert (sidx.classes, sidx.paths, sidx.labels, sidx.empty_classes, sidx.fingerprint) == (
        lidx.classes, lidx.paths, lidx.labels, lidx.empty_classes, lidx.fingerprint,
    )
    local = {p: v for p, v in decode_all(iter_local_batches(lidx, lcfg)).items() if v[2]}
    remote, skipped = _ray_decode(build_dataset(sidx, scfg))  # Ray tasks read s3:// with the endpoint
    assert skipped.count == 4 and remote.keys() == local.keys()
    for p in local:
        assert np.array_equal(remote[p][0], local[p][0]) and remote[p][1] == local[p][1], p
    in_process = decode_all(iter_local_batches(sidx, scfg, batch_size=8))  # the no-Ray path reads S3 too
    assert {p for p, v in in_process.items() if v[2]} == local.keys()
    # Parquet shards written to and read back from S3
    convert_to_parquet(lidx, f"{root}/pq/train", rows_per_file=6, out_options=opts)
    pcfg = DataConfig(root=f"{root}/pq", storage_options=opts, **SMALL)
    pidx = scan(pcfg)
    assert pidx.format == "parquet" and pidx.fingerprint == lidx.fingerprint
    from_pq = decode_all(iter_local_batches(pidx, pcfg, batch_size=5))
    assert {p for p, v in from_pq.items() if not v[2]} == set(bad_tree.train_invalid)
    assert all(np.array_equal(from_pq[p][0], local[p][0]) for p in local)
    # flat val + CSV on S3 (CSV found beside the split, classes from train/ incl. the marker)
    vidx = scan(DataConfig(root=root, split="val", storage_options=opts))
    lv = scan(DataConfig(root=str(bad_tree.root), split="val"))
    assert (vidx.classes, vidx.paths, vidx.labels) == (lv.classes, lv.paths, lv.labels)
    # without the marker the empty class is unknown on S3: an explicit class list keeps labels aligned
    _upload(bad_tree.root / "train", bucket, "nomarker", ep)
    assert scan(DataConfig(root=storage.join(bucket, "nomarker"), split=None, storage_options=opts)).classes == WNIDS
    aligned = scan(DataConfig(root=storage.join(bucket, "nomarker"), split=None, storage_options=opts,
                               classes=ALL_CLASSES))
    assert aligned.labels == lidx.labels


def _train_loop(config):
    import ray.train

    from pipelines.storage import uris as st
    from pipelines.ingest.batches import SkipReport as SR
    from pipelines.ingest.batches import iter_valid_batches as ivb

    rank = ray.train.get_context().get_world_rank()
    rows, skipped = [], SR()
    for b in ivb(ray.train.get_dataset_shard("train"), batch_size=3, device="cpu"):
        skipped = skipped.merge(b.skipped)
        rows += [[p, int(y), float(x.double().sum())] for p, x, y in zip(b.paths, b.x, b.y)]
    st.write_json_atomic(st.join(config["out"], f"rank{rank}.json"), {"rows": rows, "skipped": skipped.to_dict()})


@pytest.mark.ray
@pytest.mark.slow
def test_ray_train_workers_share_the_dataset(ray_session, bad_tree, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cfg = DataConfig(root=str(bad_tree.root), decode_batch_size=4, **SMALL)
    idx = scan(cfg)
    out = str(tmp_path / "out")
    TorchTrainer(
        _train_loop,
        train_loop_config={"out": out},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(storage_path=str(tmp_path / "ray"), name="shards"),
        datasets={"train": build_dataset(idx, cfg)},
        dataset_config=exact_split_data_config(),  # the default split drops rows (17 -> 2 x 8)
    ).fit()
    per_rank = [storage.read_json(storage.join(out, f"rank{r}.json")) for r in range(2)]
    rows = [r for d in per_rank for r in d["rows"]]
    skipped = SkipReport.from_dict(per_rank[0]["skipped"]).merge(SkipReport.from_dict(per_rank[1]["skipped"]))
    assert all(d["rows"] or d["skipped"]["count"] for d in per_rank)  # both workers got a shard
    assert sorted(r[0] for r in rows) == sorted(set(idx.paths) - set(bad_tree.train_invalid))  # each once
    assert skipped.count == 4 and set(skipped.paths) == set(bad_tree.train_invalid)
    local = decode_all(iter_local_batches(idx, cfg))
    for p, y, s in rows:
        assert y == local[p][1] and s == pytest.approx(float(local[p][0].astype(np.float64).sum()), abs=1e-9)


def test_decode_batch_keeps_small_sources_spread():
    assert decode_batch(1_281_167, 128) == 128  # ImageNet train: the configured batch
    assert decode_batch(400, 128) == 50  # a demo partition: 8 decode batches, not 4
    assert decode_batch(256, 128) == 32
    assert decode_batch(20, 128) == 3 and decode_batch(5, 4) == 1 and decode_batch(0, 128) == 1
    assert decode_batch(1000, 2) == 2  # an explicit small batch is kept
    assert DataConfig(root="/x").decode_batch_size == 128
