"""pipelines.storage.uris on local paths, file:// URIs and a real S3 API (moto over HTTP)."""
from __future__ import annotations

import json
import os

import pytest

from pipelines.storage import uris as storage


def test_join_and_schemes():
    assert storage.join("s3://b/pre/", "stats", "/p.json") == "s3://b/pre/stats/p.json"
    assert storage.join("/tmp/x", "a", "b") == "/tmp/x/a/b"
    assert storage.join("file:///tmp/x", "a") == "file:///tmp/x/a"
    assert storage.is_remote("s3://b/k") and not storage.is_remote("/tmp/x") and not storage.is_remote("file:///x")
    with pytest.raises(ValueError, match=r"unsupported URI scheme 'gopher'.*s3://"):
        storage.get_fs("gopher://x/y")
    with pytest.raises(ValueError, match="without a bucket"):
        storage.get_fs("s3:///key")


def test_local_roundtrip_and_atomic_replace(tmp_path, monkeypatch):
    uri = str(tmp_path / "a" / "b" / "x.json")  # parents created on write
    assert not storage.exists(uri)
    storage.write_json_atomic(uri, {"b": [1, 2], "a": 1.5})
    assert storage.read_json(uri) == {"a": 1.5, "b": [1, 2]}
    assert json.loads((tmp_path / "a" / "b" / "x.json").read_text()) == {"a": 1.5, "b": [1, 2]}
    assert storage.exists("file://" + uri) and storage.read_json("file://" + uri)["a"] == 1.5

    storage.write_bytes_atomic(uri, b"v1")
    # a failing write (crash between writing the temp file and the rename) leaves the old file intact
    def boom(src, dst):
        raise OSError("simulated crash")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="simulated crash"):
        storage.write_bytes_atomic(uri, b"v2-partial")
    monkeypatch.undo()
    assert storage.read_bytes(uri) == b"v1"
    assert os.listdir(tmp_path / "a" / "b") == ["x.json"]  # no temp file left behind

    storage.write_bytes_atomic(storage.join(str(tmp_path), "a", "c.bin"), b"\x00\x01")
    assert storage.listdir(str(tmp_path / "a")) == ["b", "c.bin"]
    assert storage.listdir(str(tmp_path / "missing")) == []
    with pytest.raises(FileNotFoundError, match="no such file"):
        storage.read_bytes(str(tmp_path / "nope.bin"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        storage.read_json(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="must be bytes"):
        storage.write_bytes_atomic(uri, "text")
    storage.remove(str(tmp_path / "a"), recursive=True)
    assert not storage.exists(str(tmp_path / "a"))
    storage.remove(str(tmp_path / "a"))  # missing -> no-op


@pytest.mark.s3
def test_s3_roundtrip(s3_bucket):
    bucket, ep = s3_bucket
    uri = storage.join(bucket, "run", "stats", "part-00000.json")
    assert not storage.exists(uri, ep)
    storage.write_json_atomic(uri, {"count": 3}, options=ep)
    assert storage.exists(uri, ep)
    assert storage.read_json(uri, ep) == {"count": 3}
    storage.write_json_atomic(uri, {"count": 4}, options=ep)  # overwrite seen at once (no stale cache)
    assert storage.read_json(uri, ep) == {"count": 4}
    storage.write_bytes_atomic(storage.join(bucket, "run", "stats", "part-00001.bin"), b"xyz", ep)
    assert storage.listdir(storage.join(bucket, "run", "stats"), ep) == ["part-00000.json", "part-00001.bin"]
    assert storage.listdir(storage.join(bucket, "run"), ep) == ["stats"]
    assert storage.listdir(storage.join(bucket, "nothing"), ep) == []
    with pytest.raises(FileNotFoundError, match="no such file"):
        storage.read_bytes(storage.join(bucket, "run", "missing"), ep)

    # the same objects, seen by an independent client (boto3), prove it went over the S3 API
    import boto3

    obj = boto3.client("s3", endpoint_url=ep).get_object(Bucket=bucket[5:], Key="run/stats/part-00001.bin")
    assert obj["Body"].read() == b"xyz"

    storage.remove(storage.join(bucket, "run"), recursive=True, options=ep)
    assert storage.listdir(storage.join(bucket, "run"), ep) == []


@pytest.mark.s3
def test_s3_endpoint_from_env(s3_bucket, monkeypatch):
    bucket, ep = s3_bucket
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", ep)
    assert storage.resolve_endpoint() == ep
    assert storage.resolve_endpoint("http://explicit:1") == "http://explicit:1"
    uri = storage.join(bucket, "env.json")
    storage.write_json_atomic(uri, [1, 2, 3])  # no endpoint argument
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", ep)
    assert storage.read_json(uri) == [1, 2, 3]


def test_local_remove_works_after_the_working_directory_is_gone(tmp_path):
    """A job's driver can outlive its cwd (a second Ray node on the same machine re-extracts the
    job's package at the same path): removing local trees must not need os.getcwd()."""
    import os

    from pipelines.storage import uris

    tree = tmp_path / "out" / "stats" / "passes"
    (tree / "pass1").mkdir(parents=True)
    (tree / "pass1" / "ckpt.bin").write_bytes(b"x")
    (tmp_path / "single.txt").write_text("y")
    gone = tmp_path / "cwd"
    gone.mkdir()
    here = os.getcwd()
    try:
        os.chdir(gone)
        os.rmdir(gone)
        uris.remove(str(tree), recursive=True)
        uris.remove(str(tmp_path / "single.txt"))
    finally:
        os.chdir(here)
    assert not tree.exists() and not (tmp_path / "single.txt").exists()
