"""URIs for data and artifacts: local paths, ``file://`` and ``s3://`` through fsspec.

One idea: every other module names a location by a URI string and calls these
functions; only this module knows about filesystems.

- Local: ``/abs/path``, ``relative/path`` or ``file:///abs/path``.
- S3 (and S3-compatible stores such as MinIO or Ceph): ``s3://bucket/key``, via
  s3fs. Credentials come from the standard AWS chain (env vars, shared config
  files, instance / pod roles); they are never passed through or logged here.
  The endpoint is, in order: the ``endpoint_url`` argument,
  ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, AWS's default.

Atomicity: ``write_bytes_atomic`` writes a local file as a temporary sibling,
fsyncs it, then ``os.replace`` -> readers see the old or the new file, never a
partial one. On S3 an object is one PUT (s3fs uses a multipart upload above
its 50 MiB chunk size, which also becomes visible only when completed).

Listing caches are disabled for S3 so that files written by other processes
(Ray workers) are seen at once.
"""
from __future__ import annotations

import json
import os
import posixpath
import tempfile
from typing import Any
from urllib.parse import urlsplit

import fsspec

__all__ = [
    "SCHEMES",
    "get_fs",
    "resolve_endpoint",
    "is_remote",
    "join",
    "exists",
    "isdir",
    "read_bytes",
    "write_bytes_atomic",
    "write_json_atomic",
    "read_json",
    "listdir",
    "remove",
    "pyarrow_fs",
]

#: Supported URI schemes ("" = plain local path).
SCHEMES: dict[str, str] = {"": "local", "file": "local", "s3": "s3", "s3a": "s3"}


def _scheme(uri: str) -> str:
    if not isinstance(uri, (str, os.PathLike)):
        raise ValueError(f"URI must be a string or path, got {type(uri).__name__}")
    uri = os.fspath(uri)
    if "://" not in uri:
        return ""
    scheme = uri.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise ValueError(
            f"unsupported URI scheme {scheme!r} in {uri!r}; valid: local paths, "
            + ", ".join(f"{s}://" for s in sorted(SCHEMES) if s)
        )
    return scheme


def resolve_endpoint(endpoint_url: str | None = None) -> str | None:
    """The S3 endpoint to use: argument, else ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``."""
    for value in (endpoint_url, os.environ.get("AWS_ENDPOINT_URL_S3"), os.environ.get("AWS_ENDPOINT_URL")):
        if value:
            return value
    return None


def is_remote(uri: str) -> bool:
    """True for object-store URIs (s3://)."""
    return SCHEMES[_scheme(uri)] != "local"


def get_fs(uri: str, endpoint_url: str | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Filesystem and filesystem-native path for ``uri``.

    Local -> (LocalFileSystem, absolute posix path); s3 -> (S3FileSystem, "bucket/key").
    s3fs instances are cached per process by fsspec (same endpoint -> same object).
    """
    scheme = _scheme(uri)
    uri = os.fspath(uri)
    if SCHEMES[scheme] == "local":
        path = uri[len("file://"):] if scheme == "file" else uri
        return fsspec.filesystem("file"), os.path.abspath(os.path.expanduser(path))
    parts = urlsplit(uri)
    if not parts.netloc:
        raise ValueError(f"S3 URI without a bucket: {uri!r} (expected s3://bucket/key)")
    path = (parts.netloc + parts.path).rstrip("/")
    endpoint = resolve_endpoint(endpoint_url)
    kwargs: dict[str, Any] = {"use_listings_cache": False}
    if endpoint:
        kwargs["endpoint_url"] = endpoint
    return fsspec.filesystem("s3", **kwargs), path


def join(uri: str, *parts: str) -> str:
    """Join path components onto a URI with "/" (keeps the scheme; no normalisation of "..")."""
    uri = os.fspath(uri)
    _scheme(uri)
    out = uri
    for p in parts:
        p = str(p)
        if not p:
            continue
        out = out.rstrip("/") + "/" + p.lstrip("/") if out else p
    return out


def exists(uri: str, endpoint_url: str | None = None) -> bool:
    fs, path = get_fs(uri, endpoint_url)
    fs.invalidate_cache(path)
    return bool(fs.exists(path))


def isdir(uri: str, endpoint_url: str | None = None) -> bool:
    fs, path = get_fs(uri, endpoint_url)
    fs.invalidate_cache(path)
    return bool(fs.isdir(path))


def read_bytes(uri: str, endpoint_url: str | None = None) -> bytes:
    """Whole object/file as bytes; FileNotFoundError names the URI."""
    fs, path = get_fs(uri, endpoint_url)
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"no such file: {uri}") from None


def write_bytes_atomic(uri: str, data: bytes, endpoint_url: str | None = None) -> None:
    """Write ``data`` so that readers never see a partial file (see module docstring)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"data must be bytes, got {type(data).__name__}")
    fs, path = get_fs(uri, endpoint_url)
    if is_remote(uri):
        fs.pipe_file(path, bytes(data))
        fs.invalidate_cache(path)
        return
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_json_atomic(uri: str, obj: Any, endpoint_url: str | None = None) -> None:
    """``json.dumps(obj, indent=2, sort_keys=True)`` written atomically (UTF-8)."""
    text = json.dumps(obj, indent=2, sort_keys=True, allow_nan=False)
    write_bytes_atomic(uri, (text + "\n").encode("utf-8"), endpoint_url)


def read_json(uri: str, endpoint_url: str | None = None) -> Any:
    raw = read_bytes(uri, endpoint_url)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not valid JSON: {uri}: {e}") from None


def listdir(uri: str, endpoint_url: str | None = None) -> list[str]:
    """Sorted names (not paths) of the entries directly under ``uri``; [] when it does not exist.

    On S3 a "directory" is a key prefix, so a missing prefix and an empty one look the same.
    """
    fs, path = get_fs(uri, endpoint_url)
    fs.invalidate_cache(path)
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    if not is_remote(uri) and not os.path.isdir(path):
        raise NotADirectoryError(f"not a directory: {uri}")
    names = set()
    for entry in entries:
        name = posixpath.basename(str(entry).rstrip("/"))
        if name and str(entry).rstrip("/") != path.rstrip("/"):
            names.add(name)
    return sorted(names)


def remove(uri: str, recursive: bool = False, endpoint_url: str | None = None) -> None:
    """Delete a file (or a tree with ``recursive=True``); missing -> no-op."""
    fs, path = get_fs(uri, endpoint_url)
    fs.invalidate_cache(path)
    if not fs.exists(path):
        return
    fs.rm(path, recursive=recursive)
    fs.invalidate_cache(path)


def pyarrow_fs(uri: str, endpoint_url: str | None = None):
    """``(pyarrow.fs.FileSystem, scheme-less path)`` for APIs that want pyarrow filesystems
    (e.g. Ray Train ``RunConfig(storage_filesystem=..., storage_path=path)``).

    S3 uses pyarrow's native client (AWS default credential chain); an endpoint
    ``http(s)://host:port`` becomes ``endpoint_override`` + ``scheme``.
    """
    import pyarrow.fs as pafs

    fs, path = get_fs(uri, endpoint_url)
    if not is_remote(uri):
        return pafs.LocalFileSystem(), path
    endpoint = resolve_endpoint(endpoint_url)
    kwargs: dict[str, Any] = {}
    if endpoint:
        ep = urlsplit(endpoint)
        kwargs["endpoint_override"] = ep.netloc or ep.path
        kwargs["scheme"] = ep.scheme or "https"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    return pafs.S3FileSystem(**kwargs), path
