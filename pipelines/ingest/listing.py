"""Listing the objects under a split folder as compact records ``(path, size, etag)``.

``list_records(uri, options)`` returns a ``pyarrow.Table`` with the columns ``path`` (relative to
``uri``, ``/``-separated, sorted), ``size`` (bytes) and ``etag`` (the S3 ETag, or the local
file's ``mtime_ns`` as text): one Arrow row per object, no Python object per key kept.

On S3 the top level is listed first with a delimiter (the class prefixes and the top-level
keys), then the class prefixes are listed in parallel on a bounded thread pool
(``workers``, default :data:`LIST_WORKERS`), each a chain of ListObjectsV2 pages signed by a botocore client; every
page is a presigned GET whose XML body is parsed as it streams in (``iterparse``, each
element dropped once read; every 128 keys become an Arrow record batch), so the driver holds ~``len(path) + len(etag) + 16`` bytes per key plus a constant per
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


def s3_client(options: storage.Store = None, pool: int = LIST_WORKERS):
    """A botocore S3 client for ``options`` (its endpoint and the s3fs ``client_kwargs`` /
    ``config_kwargs`` options it understands), with ``pool`` connections; cached per process.
    Credentials come from the AWS chain."""
    import botocore.config
    import botocore.session

    opts = storage.resolve_options(options)
    o = dict(opts.options or {})
    key = (opts.endpoint, repr(sorted(o.items())), pool)
    with _CLIENTS_LOCK:
        if key not in _CLIENTS:
            cfg_kw = dict(o.get("config_kwargs") or {})
            cfg_kw["max_pool_connections"] = max(pool, int(cfg_kw.get("max_pool_connections", 10)))
            client_kw = dict(o.get("client_kwargs") or {})
            session = botocore.session.get_session()
            _CLIENTS[key] = session.create_client(
                "s3", endpoint_url=opts.endpoint, region_name=client_kw.pop("region_name", None),
                config=botocore.config.Config(**cfg_kw), **{k: v for k, v in client_kw.items() if k == "verify"})
        return _CLIENTS[key]


def _batch(paths: list, sizes: list, etags: list):
    import pyarrow as pa

    return pa.record_batch([pa.array(paths, pa.string()), pa.array(sizes, pa.int64()), pa.array(etags, pa.string())],
                           schema=_schema())


_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_FLUSH = 128  # keys per Arrow batch while a page streams in


class _Page:
    """One ListObjectsV2 page, parsed as it streams in: Arrow batches of its keys (relative,
    ``strip`` characters cut), its common prefixes, and where the next page starts."""

    def __init__(self):
        self.batches: list = []
        self.prefixes: list[str] = []
        self.keys = 0
        self.truncated = False
        self.token: str | None = None


def _parse_page(stream, strip: int, keep: bool) -> _Page:
    """Parse a ListObjectsV2 response body from ``stream`` with ``iterparse``, dropping each
    ``Contents`` element once read (no tree or dict per key is kept); ``keep=False`` only counts."""
    import xml.etree.ElementTree as ET

    page, root = _Page(), None
    cols: tuple[list, list, list] = ([], [], [])  # path, size, etag of the keys not yet in a batch
    for event, el in ET.iterparse(stream, events=("start", "end")):
        if root is None:
            root = el
        if event != "end":
            continue
        tag = el.tag[len(_NS):] if el.tag.startswith(_NS) else el.tag
        if tag == "Contents":
            page.keys += 1
            if keep:
                _add_key(page, cols, el, strip)
            root.clear()
        elif _page_field(page, tag, el):
            root.clear()
    if cols[0]:
        page.batches.append(_batch(*cols))
    return page


def _add_key(page: _Page, cols: tuple[list, list, list], el, strip: int) -> None:
    """One ``Contents`` element's key (less ``strip`` characters), size and ETag into ``cols``;
    every :data:`_FLUSH` keys they become one Arrow batch of ``page``."""
    cols[0].append(el.findtext(_NS + "Key")[strip:])
    cols[1].append(int(el.findtext(_NS + "Size") or 0))
    cols[2].append((el.findtext(_NS + "ETag") or "").strip('"'))
    if len(cols[0]) >= _FLUSH:
        page.batches.append(_batch(*cols))
        for c in cols:
            c.clear()


def _page_field(page: _Page, tag: str, el) -> bool:
    """A page-level element into ``page``; True for a ``CommonPrefixes`` element (done with it)."""
    if tag == "CommonPrefixes":
        page.prefixes.append(el.findtext(_NS + "Prefix"))
        return True
    if tag == "IsTruncated":
        page.truncated = (el.text or "").strip().lower() == "true"
    elif tag == "NextContinuationToken":
        page.token = el.text
    return False


_HTTP: dict[int, Any] = {}


def _http(pool: int):
    import urllib3

    with _CLIENTS_LOCK:
        if pool not in _HTTP:
            _HTTP[pool] = urllib3.PoolManager(maxsize=pool, retries=urllib3.Retry(total=5, backoff_factor=0.2))
        return _HTTP[pool]


def _pages(client, bucket: str, prefix: str, strip: int = 0, delimiter: str | None = None,
           keep: bool = True, pool: int = LIST_WORKERS) -> Iterator[_Page]:
    """The ListObjectsV2 pages of ``prefix``, one after another, each streamed and parsed as it
    arrives (a presigned GET of the botocore client: its endpoint, credentials and signing)."""
    token = None
    while True:
        params: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": 1000}
        if delimiter:
            params["Delimiter"] = delimiter
        if token:
            params["ContinuationToken"] = token
        url = client.generate_presigned_url("list_objects_v2", Params=params, ExpiresIn=900)
        resp = _http(pool).request("GET", url, preload_content=False)
        try:
            if resp.status != 200:
                body = resp.read(2000).decode("utf-8", "replace")
                raise OSError(f"listing s3://{bucket}/{prefix} failed: HTTP {resp.status} {body[:300]}")
            page = _parse_page(resp, strip, keep)
        finally:
            resp.release_conn()
        yield page
        if not page.truncated or not page.token:
            return
        token = page.token


def _list_prefix(client, bucket: str, prefix: str, strip: int, pool: int) -> list:
    return [b for page in _pages(client, bucket, prefix, strip, pool=pool) for b in page.batches]


def _list_s3(uri: str, options, workers: int):
    import pyarrow as pa

    bucket, base = split_s3(uri)
    client = s3_client(options, workers)
    batches, prefixes = [], []
    for page in _pages(client, bucket, base, len(base), "/", pool=workers):  # the top level: prefixes, loose keys
        prefixes.extend(page.prefixes)
        batches.extend(page.batches)
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="s3-list") as pool:
        for part in pool.map(lambda p: _list_prefix(client, bucket, p, len(base), workers), prefixes):
            batches.extend(part)
    return pa.Table.from_batches(batches, schema=_schema())


_LOCAL_BATCH = 65536  # rows per Arrow batch of a local listing
_MAX_CHUNKS = 64  # a listing in more record batches than this is combined into one


def _list_local(root: str):
    """Every entry under ``root`` in sorted path order, without a global sort: each folder's
    entries are visited sorted by ``name`` (``name/`` for a folder), depth first, which is the
    order of the full paths (a folder's ``name/`` is the prefix of everything under it)."""
    import pyarrow as pa

    batches: list = []
    paths: list[str] = []
    sizes: list[int] = []
    etags: list[str] = []
    stack: list[tuple[str, bool]] = [("", True)]  # (relative path, is a folder), popped in order
    while stack:
        rel, is_dir = stack.pop()
        if rel:
            paths.append(rel + "/" if is_dir else rel)  # a folder marker, as an empty S3 folder would be
            if is_dir:
                sizes.append(0)
                etags.append("")
            else:
                st = os.stat(os.path.join(root, rel))
                sizes.append(int(st.st_size))
                etags.append(str(st.st_mtime_ns))
            if len(paths) >= _LOCAL_BATCH:
                batches.append(_batch(paths, sizes, etags))
                paths, sizes, etags = [], [], []
        if is_dir:
            with os.scandir(os.path.join(root, rel) if rel else root) as it:
                entries = [(e.name + "/" if e.is_dir(follow_symlinks=True) else e.name) for e in it]
            entries.sort(reverse=True)  # popped from the end: ascending
            stack.extend(((rel + "/" if rel else "") + n.rstrip("/"), n.endswith("/")) for n in entries)
    if paths:
        batches.append(_batch(paths, sizes, etags))
    return pa.Table.from_batches(batches, schema=_schema())


def _is_sorted(column) -> bool:
    """Whether a (chunked) string column is in ascending order, checked chunk by chunk."""
    import pyarrow.compute as pc

    last = None
    for chunk in column.chunks:
        if not len(chunk):
            continue
        if last is not None and last > chunk[0].as_py():
            return False
        if len(chunk) > 1 and pc.any(pc.less(chunk[1:], chunk[:-1])).as_py():
            return False
        last = chunk[-1].as_py()
    return True


def list_records(uri: str, options: storage.Store = None, workers: int = LIST_WORKERS):
    """The sorted ``(path, size, etag)`` table of every object under ``uri`` (see module doc).
    Sorted already (a local walk always, S3 pages of sorted prefixes usually), it is returned as
    listed (record batches, no copy); otherwise one sorted copy replaces it."""
    import pyarrow.compute as pc

    if storage.is_remote(uri):
        table = _list_s3(uri, options, workers)
    else:
        table = _list_local(storage.get_fs(uri)[1])
    if table.column("path").num_chunks > _MAX_CHUNKS:  # S3's batches of 128 keys: one copy, then freed
        table = table.combine_chunks()
    if _is_sorted(table.column("path")):
        return table
    table = table.combine_chunks()  # then the take copies one chunk, not a concatenation
    order = pc.sort_indices(table, sort_keys=[("path", "ascending")])
    return table.take(order)


def _count_prefix(client, bucket: str, prefix: str, pool: int) -> int:
    return sum(page.keys for page in _pages(client, bucket, prefix, keep=False, pool=pool))


def count_objects(uri: str, prefixes: Sequence[str], options: storage.Store = None,
                  workers: int = LIST_WORKERS) -> dict[str, int]:
    """Objects under each of ``prefixes`` (relative to ``uri``, ending with ``/``), counted
    without keeping a key (S3: the prefixes' pages in parallel; local: the directory walk)."""
    if storage.is_remote(uri):
        bucket, base = split_s3(uri)
        client = s3_client(options, workers)
        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="s3-count") as pool:
            counts = pool.map(lambda p: _count_prefix(client, bucket, base + p, workers), prefixes)
            return dict(zip(prefixes, counts))
    root = storage.get_fs(uri)[1]
    out = {}
    for p in prefixes:
        n = 1  # the folder itself: list_records gives it as a marker "p/", as S3 does a marker object
        for _cur, dnames, fnames in os.walk(os.path.join(root, p), followlinks=True):
            n += len(fnames) + len(dnames)
        out[p] = n
    return out


def top_level(uri: str, options: storage.Store = None) -> tuple[list[str], int]:
    """``(sorted prefixes / folders ending in "/", number of top-level objects)`` under ``uri``:
    one delimiter listing on S3 (a page per 1,000 entries)."""
    if storage.is_remote(uri):
        bucket, base = split_s3(uri)
        prefixes, n = [], 0
        for page in _pages(s3_client(options), bucket, base, delimiter="/", keep=False):
            prefixes.extend(p[len(base):] for p in page.prefixes)
            n += page.keys
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


def head_records(uri: str, paths: Iterable[str], options: storage.Store = None,
                 workers: int = LIST_WORKERS) -> list[tuple[int, str] | None]:
    """``(size, etag)`` of each of ``paths`` (relative to ``uri``) as :func:`list_records` gives
    them, or ``None`` for a missing object (S3: HEAD requests in parallel; local: ``stat``)."""
    paths = list(paths)
    if storage.is_remote(uri):
        bucket, base = split_s3(uri)
        client = s3_client(options, workers)

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
