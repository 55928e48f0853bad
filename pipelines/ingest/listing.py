"""Listing the objects under a split folder as compact records ``(path, size, etag)``.

``list_records(uri, store)`` returns a ``pyarrow.Table`` with the columns ``path`` (relative to
``uri``, ``/``-separated, sorted), ``size`` (bytes) and ``etag`` (the S3 ETag, or the local
file's ``mtime_ns`` as text): one Arrow row per object, no Python object per key kept.

On S3 the top level is listed first with a delimiter (the class prefixes and the top-level
keys), then the class prefixes are listed in parallel on a bounded thread pool
(``workers``, default :data:`LIST_WORKERS`), each with botocore's ListObjectsV2 paginator; every
page becomes an Arrow record batch as it arrives (the page's parsed response is dropped right
after), so the driver holds ~``len(path) + len(etag) + 16`` bytes per key plus a constant per
thread (measured in benchmarks/RESULTS.md). Keys ending in ``/`` (folder markers) are kept:
:mod:`pipelines.ingest.scan` reads them as folders. Which files count as images is the
caller's decision (the scan's layout and suffix filters apply to these records).

:func:`count_objects` and :func:`head_records` are the cheap checks of a persisted index
(:mod:`pipelines.ingest.index_store`).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Iterator, Sequence

from pipelines.storage import uris as storage

__all__ = ["LIST_WORKERS", "list_records", "count_objects", "top_level", "head_records", "s3_client", "split_s3"]

#: Class prefixes listed at the same time (each an independent paginated stream).
LIST_WORKERS = 32


def _schema():
    import pyarrow as pa

    return pa.schema([("path", pa.string()), ("size", pa.int64()), ("etag", pa.string())])


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b/")`` (the key prefix ends with ``/``; ``""`` at the root)."""
    path = uri.split("://", 1)[1]
    bucket, _, key = path.partition("/")
    key = key.strip("/")
    return bucket, (key + "/") if key else ""


_CLIENTS: dict[tuple, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def s3_client(store: storage.Store = None, pool: int = LIST_WORKERS):
    """A botocore S3 client for ``store`` (its endpoint and the s3fs ``client_kwargs`` /
    ``config_kwargs`` options it understands), with ``pool`` connections; cached per process.
    Credentials come from the AWS chain."""
    import botocore.config
    import botocore.session

    opts = storage.resolve_options(store)
    o = dict(opts.options or {})
    key = (opts.endpoint_url, repr(sorted(o.items())), pool)
    with _CLIENTS_LOCK:
        if key not in _CLIENTS:
            cfg_kw = dict(o.get("config_kwargs") or {})
            cfg_kw["max_pool_connections"] = max(pool, int(cfg_kw.get("max_pool_connections", 10)))
            client_kw = dict(o.get("client_kwargs") or {})
            session = botocore.session.get_session()
            _CLIENTS[key] = session.create_client(
                "s3", endpoint_url=opts.endpoint_url, region_name=client_kw.pop("region_name", None),
                config=botocore.config.Config(**cfg_kw), **{k: v for k, v in client_kw.items() if k == "verify"})
        return _CLIENTS[key]


def _batch(paths: list, sizes: list, etags: list):
    import pyarrow as pa

    return pa.record_batch([pa.array(paths, pa.string()), pa.array(sizes, pa.int64()), pa.array(etags, pa.string())],
                           schema=_schema())


def _pages(client, bucket: str, prefix: str, delimiter: str | None = None) -> Iterator[dict]:
    kw = {"Bucket": bucket, "Prefix": prefix, "PaginationConfig": {"PageSize": 1000}}
    if delimiter:
        kw["Delimiter"] = delimiter
    yield from client.get_paginator("list_objects_v2").paginate(**kw)


def _page_batch(page: dict, strip: int):
    contents = page.get("Contents") or ()
    if not contents:
        return None
    return _batch([c["Key"][strip:] for c in contents], [int(c["Size"]) for c in contents],
                  [str(c.get("ETag", "")).strip('"') for c in contents])


def _list_prefix(client, bucket: str, prefix: str, strip: int) -> list:
    out = []
    for page in _pages(client, bucket, prefix):
        b = _page_batch(page, strip)
        del page
        if b is not None:
            out.append(b)
    return out


def _list_s3(uri: str, store, workers: int):
    import pyarrow as pa

    bucket, base = split_s3(uri)
    client = s3_client(store, workers)
    batches, prefixes = [], []
    for page in _pages(client, bucket, base, "/"):  # the top level: class prefixes and loose keys
        prefixes.extend(p["Prefix"] for p in page.get("CommonPrefixes") or ())
        b = _page_batch(page, len(base))
        if b is not None:
            batches.append(b)
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="s3-list") as pool:
        for part in pool.map(lambda p: _list_prefix(client, bucket, p, len(base)), prefixes):
            batches.extend(part)
    return pa.Table.from_batches(batches, schema=_schema())


def _list_local(root: str):
    import pyarrow as pa

    batches = []
    stack = [""]
    while stack:
        rel = stack.pop()
        paths, sizes, etags = [], [], []
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            for e in it:
                name = rel + "/" + e.name if rel else e.name
                if e.is_dir(follow_symlinks=True):
                    stack.append(name)
                    paths.append(name + "/")  # a folder marker, as an empty S3 folder would be
                    sizes.append(0)
                    etags.append("")
                else:
                    st = e.stat(follow_symlinks=True)
                    paths.append(name)
                    sizes.append(int(st.st_size))
                    etags.append(str(st.st_mtime_ns))
        if paths:
            batches.append(_batch(paths, sizes, etags))
    return pa.Table.from_batches(batches, schema=_schema())


def list_records(uri: str, store: storage.Store = None, workers: int = LIST_WORKERS):
    """The sorted ``(path, size, etag)`` table of every object under ``uri`` (see module doc)."""
    import numpy as np
    import pyarrow.compute as pc

    if storage.is_remote(uri):
        table = _list_s3(uri, store, workers)  # pages of sorted prefixes in order: usually sorted already
    else:
        table = _list_local(storage.get_fs(uri)[1])
    order = pc.sort_indices(table, sort_keys=[("path", "ascending")]).to_numpy()
    if len(order) and not (order[0] == 0 and bool(np.all(np.diff(order) == 1))):
        table = table.take(order)
    return table.combine_chunks()


def _count_prefix(client, bucket: str, prefix: str) -> int:
    return sum(int(page.get("KeyCount", len(page.get("Contents") or ()))) for page in _pages(client, bucket, prefix))


def count_objects(uri: str, prefixes: Sequence[str], store: storage.Store = None,
                  workers: int = LIST_WORKERS) -> dict[str, int]:
    """Objects under each of ``prefixes`` (relative to ``uri``, ending with ``/``), counted
    without keeping a key (S3: the prefixes' pages in parallel; local: the directory walk)."""
    if storage.is_remote(uri):
        bucket, base = split_s3(uri)
        client = s3_client(store, workers)
        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="s3-count") as pool:
            counts = pool.map(lambda p: _count_prefix(client, bucket, base + p), prefixes)
            return dict(zip(prefixes, counts))
    root = storage.get_fs(uri)[1]
    out = {}
    for p in prefixes:
        n = 1  # the folder itself: list_records gives it as a marker "p/", as S3 does a marker object
        for _cur, dnames, fnames in os.walk(os.path.join(root, p), followlinks=True):
            n += len(fnames) + len(dnames)
        out[p] = n
    return out


def top_level(uri: str, store: storage.Store = None) -> tuple[list[str], int]:
    """``(sorted prefixes / folders ending in "/", number of top-level objects)`` under ``uri``:
    one delimiter listing on S3 (a page per 1,000 entries)."""
    if storage.is_remote(uri):
        bucket, base = split_s3(uri)
        prefixes, n = [], 0
        for page in _pages(s3_client(store), bucket, base, "/"):
            prefixes.extend(p["Prefix"][len(base):] for p in page.get("CommonPrefixes") or ())
            n += len(page.get("Contents") or ())
        return sorted(prefixes), n
    root = storage.get_fs(uri)[1]
    prefixes, n = [], 0
    with os.scandir(root) as it:
        for e in it:
            if e.is_dir(follow_symlinks=True):
                prefixes.append(e.name + "/")
            else:
                n += 1
    return sorted(prefixes), n


def head_records(uri: str, paths: Iterable[str], store: storage.Store = None,
                 workers: int = LIST_WORKERS) -> list[tuple[int, str] | None]:
    """``(size, etag)`` of each of ``paths`` (relative to ``uri``) as :func:`list_records` gives
    them, or ``None`` for a missing object (S3: HEAD requests in parallel; local: ``stat``)."""
    paths = list(paths)
    if storage.is_remote(uri):
        bucket, base = split_s3(uri)
        client = s3_client(store, workers)

        def head(p: str):
            try:
                r = client.head_object(Bucket=bucket, Key=base + p)
            except client.exceptions.ClientError as e:
                if str(e.response.get("Error", {}).get("Code")) in ("404", "NoSuchKey", "NotFound"):
                    return None
                raise
            return int(r["ContentLength"]), str(r.get("ETag", "")).strip('"')

        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="s3-head") as pool:
            return list(pool.map(head, paths))
    root = storage.get_fs(uri)[1]
    out: list[tuple[int, str] | None] = []
    for p in paths:
        try:
            st = os.stat(os.path.join(root, p))
        except FileNotFoundError:
            out.append(None)
            continue
        out.append((int(st.st_size), str(st.st_mtime_ns)))
    return out
