"""Artifact I/O: bit-exact round trips, checksums, clear errors (docs/design.md §4)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from laplace_core.io import MANIFEST_FILE, TENSORS_FILE, load_tensors, save_tensors
from laplace_core.posteriors.structures.base import load_posterior
from laplace_core.posteriors.build import METHODS, build_posterior
from laplace_core.curvature.statistics import CurvatureStatistics, LayerInfo, LayerStatistics
from laplace_core.basis.eigenbasis import eigenbasis

F64 = torch.float64


def _stats(seed=0) -> CurvatureStatistics:
    gen = torch.Generator().manual_seed(seed)
    layers, infos, grads = {}, {}, {}
    for name, (m, n) in {"features.0": (4, 3), "head": (3, 5)}.items():
        a = torch.randn(20, n, generator=gen, dtype=F64)
        g = torch.randn(20, m, generator=gen, dtype=F64)
        d = g[:, :, None] * a[:, None, :]
        layers[name] = LayerStatistics(A=a.T @ a, G=g.T @ g, diag=(d * d).sum(0))
        infos[name] = LayerInfo(name, "linear", m, n, True, (m, n - 1))
        grads[name] = d
    stats = CurvatureStatistics(layers=layers, infos=infos, count=20, excluded={"bn": "BatchNorm2d: point estimate"})
    basis = eigenbasis(stats)
    efb = {k: ((basis[k].U_G.T @ grads[k] @ basis[k].U_A) ** 2).sum(0) for k in layers}
    return stats.with_efb(efb, 20)


def _assert_same_posterior(a, b):
    assert (a.method, a.n_data, a.prior_precision, a.rank, a.info) == (b.method, b.n_data, b.prior_precision, b.rank, b.info)
    assert list(a.layers) == list(b.layers)
    for k in a.layers:
        assert type(a.layers[k]) is type(b.layers[k])
        ta, tb = a.layers[k].tensors(), b.layers[k].tensors()
        assert set(ta) == set(tb)
        for f in ta:
            assert ta[f].dtype == tb[f].dtype and torch.equal(ta[f], tb[f]), (k, f)
        assert a.layers[k].meta() == b.layers[k].meta()


@pytest.mark.parametrize("method", list(METHODS))
def test_posterior_round_trip_bit_exact(tmp_path, method):
    post = build_posterior(_stats(), method, rank=2 if method == "inf" else None, n_data=33.0, prior_precision=0.4)
    uri = str(tmp_path / "posterior" / method)
    post.save(uri)
    back = load_posterior(uri)
    _assert_same_posterior(post, back)
    z = {k: torch.randn(2, *lp.shape, dtype=F64, generator=torch.Generator().manual_seed(0)) for k, lp in post.layers.items()}
    for k in z:
        assert torch.equal(post.scale_matvec(z)[k], back.scale_matvec(z)[k])
    # re-saving over an existing artifact works and stays loadable
    post.save(uri)
    _assert_same_posterior(post, load_posterior(uri))
    assert sorted(os.listdir(uri)) == [MANIFEST_FILE, TENSORS_FILE]  # no temporary files left


def test_statistics_round_trip_bit_exact(tmp_path):
    stats = _stats()
    uri = str(tmp_path / "stats")
    stats.save(uri)
    back = CurvatureStatistics.load(uri)
    assert back.meta() == stats.meta()
    for k, ls in stats.layers.items():
        for f, t in ls.tensors().items():
            assert torch.equal(t, back.layers[k].tensors()[f])


def test_file_url_and_dtypes(tmp_path):
    tensors = {"a/b.c": torch.arange(6, dtype=torch.float32).reshape(2, 3), "i": torch.tensor([1, 2], dtype=torch.int64),
               "h": torch.randn(4, dtype=torch.bfloat16), "e": torch.zeros(0, 3, dtype=F64)}
    base = torch.randn(5, 5, dtype=F64)
    tensors["view1"], tensors["view2"] = base[0], base[1:]  # shared storage is copied, not refused
    meta = {"format": "x", "nested": {"k": [1, 2.5, None]}}
    save_tensors("file://" + str(tmp_path / "t"), tensors, meta)
    back, meta_back = load_tensors(str(tmp_path / "t"))
    assert meta_back == meta
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t)


def _saved(tmp_path):
    uri = str(tmp_path / "p")
    build_posterior(_stats(), "inf", rank=3).save(uri)
    return uri


def test_flipped_byte_is_rejected(tmp_path):
    uri = _saved(tmp_path)
    path = os.path.join(uri, TENSORS_FILE)
    data = bytearray(open(path, "rb").read())
    data[len(data) - 17] ^= 0x01
    open(path, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=f"{uri}.*checksum mismatch"):
        load_posterior(uri)


def test_truncated_file_is_rejected(tmp_path):
    uri = _saved(tmp_path)
    path = os.path.join(uri, TENSORS_FILE)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{uri}.*truncated"):
        load_posterior(uri)


def test_missing_files_are_reported(tmp_path):
    uri = _saved(tmp_path)
    os.remove(os.path.join(uri, TENSORS_FILE))
    with pytest.raises(FileNotFoundError, match=f"{uri}: {TENSORS_FILE} not found"):
        load_tensors(uri)
    os.remove(os.path.join(uri, MANIFEST_FILE))
    with pytest.raises(FileNotFoundError, match=f"{uri}: {MANIFEST_FILE} not found"):
        load_tensors(uri)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_posterior(str(tmp_path / "never-written"))


@pytest.mark.parametrize("field,value,msg", [("format", "other", "not an infoform artifact"),
                                             ("version", 99, "unsupported artifact version")])
def test_wrong_format_or_version(tmp_path, field, value, msg):
    uri = _saved(tmp_path)
    mpath = os.path.join(uri, MANIFEST_FILE)
    man = json.load(open(mpath))
    man[field] = value
    json.dump(man, open(mpath, "w"))
    with pytest.raises(ValueError, match=msg):
        load_tensors(uri)


def test_broken_manifest_and_non_posterior(tmp_path):
    uri = _saved(tmp_path)
    open(os.path.join(uri, MANIFEST_FILE), "w").write("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_tensors(uri)
    suri = str(tmp_path / "s")
    _stats().save(suri)
    with pytest.raises(ValueError, match="not a posterior"):
        load_posterior(suri)


def test_bad_meta_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        save_tensors(str(tmp_path / "x"), {"a": torch.zeros(1)}, {"bad": object()})
    with pytest.raises(ValueError, match="not a torch.Tensor"):
        save_tensors(str(tmp_path / "x"), {"a": [1.0]}, {})


def test_s3_round_trip_over_http(monkeypatch):
    """Remote URIs go through fsspec (s3fs against a loopback moto server): round trip
    and the same clear errors."""
    moto_server = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    try:
        host, port = srv.get_host_and_port()
        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                     "AWS_ENDPOINT_URL_S3": f"http://{host}:{port}"}.items():
            monkeypatch.setenv(k, v)
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir("bkt")
        post = build_posterior(_stats(), "inf", rank=2)
        post.save("s3://bkt/run/posterior/inf")
        _assert_same_posterior(post, load_posterior("s3://bkt/run/posterior/inf"))
        with pytest.raises(FileNotFoundError, match="s3://bkt/missing: manifest.json not found"):
            load_posterior("s3://bkt/missing")
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        srv.stop()


@pytest.mark.parametrize("method", ["kfac", "efb"])
def test_posterior_shares_the_eigenvectors_with_the_eigenbasis(tmp_path, method):
    """kfac / efb store U_A, U_G once: in the eigenbasis artifact, referenced from the posterior
    (relative path); loading gives the same posterior bit for bit; a rewritten eigenbasis is
    refused in one line, not mixed in."""
    stats = _stats()
    basis = eigenbasis(stats)
    basis_uri = str(tmp_path / "stats" / "eigenbasis")
    save_tensors(basis_uri, basis.flat_tensors(), {"kind": "eigenbasis"})
    post = build_posterior(stats, method, basis=basis, n_data=33.0, prior_precision=0.4)
    uri = str(tmp_path / "posterior" / method)
    names = {f"{k}/{p}": f"{k}/{p}" for k in basis.layers for p in ("U_A", "U_G")}
    post.save(uri, refs={"uri": "../../stats/eigenbasis", "tensors": names})
    manifest = json.loads(open(os.path.join(uri, MANIFEST_FILE)).read())
    assert set(manifest["refs"]["tensors"]) == set(names) and not set(names) & set(manifest["tensors"])
    full = tmp_path / "full"
    post.save(str(full))
    assert os.path.getsize(os.path.join(uri, TENSORS_FILE)) < os.path.getsize(full / TENSORS_FILE)
    _assert_same_posterior(post, load_posterior(uri))
    other = eigenbasis(_stats(seed=1))
    save_tensors(basis_uri, other.flat_tensors(), {"kind": "eigenbasis"})
    with pytest.raises(ValueError, match="was rewritten since"):
        load_posterior(uri)
