"""URIs for data and artifacts: local paths, ``file://`` and ``s3://`` through fsspec.

One idea: every other module names a location by a URI string and calls these
functions; only this module knows about filesystems.

- Local: ``/abs/path``, ``relative/path`` or ``file:///abs/path``.
- S3 (and S3-compatible stores such as MinIO or Ceph): ``s3://bucket/key``, via
  s3fs. Credentials come from the standard AWS chain (env vars, shared config
  files, instance / pod roles); they are never passed through or logged here.
  The endpoint is, in order: the run's ``storage.endpoint_url`` (``--endpoint-url``),
  ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, AWS's default.

This module is the storage boundary: its functions take the store's settings explicitly as
``options``, a :class:`StorageOptions` (endpoint plus any other s3fs ``storage_options``, e.g.
``client_kwargs: {region_name: ...}`` or ``config_kwargs: {s3: {addressing_style: path}}``).
The driver builds one :class:`pipelines.storage.store.RunStore` per run (the output URI and
the options, resolved once on the driver by :meth:`StorageOptions.resolved`) and hands that
same object to every stage, Train worker, Ray Data task and actor, which do their IO through
its methods. Only the data readers (``pipelines.ingest``: the options travel in the
``DataConfig``) and the driver's checks before the store exists (preflight, the demo's data)
call these functions with the resolved options themselves; so nothing depends on a process's
environment or mutates it.

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
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Mapping, Union
from urllib.parse import urlsplit

import fsspec

__all__ = [
    "SCHEMES",
    "StorageOptions",
    "Store",
    "fsspec_options",
    "resolve_options",
    "get_fs",
    "resolve_endpoint",
    "is_remote",
    "join",
    "exists",
    "isdir",
    "read_bytes",
    "read_many",
    "write_bytes_atomic",
    "write_json_atomic",
    "read_json",
    "listdir",
    "remove",
    "unreachable",
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


@dataclass(frozen=True)
class StorageOptions:
    """How to reach an object store: the S3 endpoint and any further s3fs keyword arguments
    (``options``, JSON-able). Plain data: it pickles to Ray workers and actors unchanged.
    Credentials are never part of it (they come from the AWS chain of the process using it)."""

    endpoint_url: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        given = self.endpoint
        if given is not None and (urlsplit(str(given)).scheme not in ("http", "https") or not urlsplit(str(given)).netloc):
            raise ValueError(f"endpoint URL must look like http(s)://host[:port], got {given!r}")
        if not isinstance(self.options, Mapping):
            raise ValueError(f"storage options must be a mapping of s3fs keyword arguments, got {type(self.options).__name__}")
        for bad in ("key", "secret", "token", "aws_access_key_id", "aws_secret_access_key", "aws_session_token"):
            if bad in self.options:
                raise ValueError(f"storage option {bad!r}: credentials come from the AWS chain "
                                 "(environment, shared config, instance role), never from the run's config")

    @property
    def endpoint(self) -> str | None:
        """The S3 endpoint given (None: the environment's or AWS's default)."""
        return self.endpoint_url

    def resolved(self) -> "StorageOptions":
        """The same options with the endpoint filled in from ``AWS_ENDPOINT_URL_S3`` /
        ``AWS_ENDPOINT_URL`` when none was given (call on the driver; the result travels)."""
        return StorageOptions(resolve_endpoint(self.endpoint), dict(self.options))

    def s3_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``s3fs.S3FileSystem`` (and of a boto3 client, less the listing cache)."""
        return {"use_listings_cache": False, **dict(self.options), **({"endpoint_url": self.endpoint} if self.endpoint else {})}


#: What the functions here accept as ``options``: full options, an endpoint, or None (the environment's).
Store = Union[StorageOptions, str, None]


def resolve_options(store: Store) -> StorageOptions:
    """``store`` as :class:`StorageOptions`, the endpoint filled in from the environment when unset."""
    if isinstance(store, StorageOptions):
        return store if store.endpoint else StorageOptions(resolve_endpoint(None), store.options)
    if store is None or isinstance(store, str):
        return StorageOptions(resolve_endpoint(store))
    raise ValueError(f"expected an endpoint URL or StorageOptions, got {type(store).__name__}")


def resolve_endpoint(given: str | None = None) -> str | None:
    """The S3 endpoint to use: ``given``, else ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``."""
    for value in (given, os.environ.get("AWS_ENDPOINT_URL_S3"), os.environ.get("AWS_ENDPOINT_URL")):
        if value:
            return value
    return None


def fsspec_options(uri: str, options: Store = None) -> dict[str, Any]:
    """``storage_options`` for fsspec-based readers of ``uri`` (e.g. :mod:`laplace_core.io`):
    ``{}`` for local paths, the s3fs keyword arguments for ``s3://``."""
    return resolve_options(options).s3_kwargs() if is_remote(uri) else {}


def is_remote(uri: str) -> bool:
    """True for object-store URIs (s3://)."""
    return SCHEMES[_scheme(uri)] != "local"


def get_fs(uri: str, options: Store = None) -> tuple[fsspec.AbstractFileSystem, str]:
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
    return fsspec.filesystem("s3", **resolve_options(options).s3_kwargs()), path


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


def exists(uri: str, options: Store = None) -> bool:
    fs, path = get_fs(uri, options)
    fs.invalidate_cache(path)
    return bool(fs.exists(path))


def isdir(uri: str, options: Store = None) -> bool:
    fs, path = get_fs(uri, options)
    fs.invalidate_cache(path)
    return bool(fs.isdir(path))


def read_bytes(uri: str, options: Store = None) -> bytes:
    """Whole object/file as bytes; FileNotFoundError names the URI."""
    fs, path = get_fs(uri, options)
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"no such file: {uri}") from None


def read_many(uris: list[str], options: Store = None) -> dict[str, bytes]:
    """``{uri: bytes}`` for several files of one filesystem (on S3 fetched concurrently by s3fs);
    FileNotFoundError names the first missing one."""
    if not uris:
        return {}
    fs, _ = get_fs(uris[0], options)
    paths = {get_fs(u, options)[1]: u for u in uris}
    try:
        got = fs.cat(list(paths), on_error="raise")
    except FileNotFoundError as e:
        raise FileNotFoundError(f"no such file: {e}") from None
    return {paths[p]: got[p] for p in paths}


def write_bytes_atomic(uri: str, data: bytes, options: Store = None) -> None:
    """Write ``data`` so that readers never see a partial file (see module docstring)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"data must be bytes, got {type(data).__name__}")
    fs, path = get_fs(uri, options)
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


def write_json_atomic(uri: str, obj: Any, options: Store = None) -> None:
    """``json.dumps(obj, indent=2, sort_keys=True)`` written atomically (UTF-8)."""
    text = json.dumps(obj, indent=2, sort_keys=True, allow_nan=False)
    write_bytes_atomic(uri, (text + "\n").encode("utf-8"), options)


def read_json(uri: str, options: Store = None) -> Any:
    raw = read_bytes(uri, options)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not valid JSON: {uri}: {e}") from None


def listdir(uri: str, options: Store = None) -> list[str]:
    """Sorted names (not paths) of the entries directly under ``uri``; [] when it does not exist.

    On S3 a "directory" is a key prefix, so a missing prefix and an empty one look the same.
    """
    fs, path = get_fs(uri, options)
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


def remove(uri: str, recursive: bool = False, options: Store = None) -> None:
    """Delete a file (or a tree with ``recursive=True``); missing -> no-op."""
    fs, path = get_fs(uri, options)
    fs.invalidate_cache(path)
    if not fs.exists(path):
        return
    if SCHEMES[_scheme(uri)] == "local":  # fsspec's local rm compares with os.getcwd(), which raises once the cwd is gone
        _remove_local(path, recursive)
    else:
        fs.rm(path, recursive=recursive)
    fs.invalidate_cache(path)


def _remove_local(path: str, recursive: bool) -> None:
    """A local file or tree removed without ``os.getcwd()``: a job's driver can outlive its
    working directory (seen with two Ray nodes on one machine: the driver's cwd, the job's
    package folder, was deleted while the files at its path stayed importable — most likely
    the second node's runtime-env agent extracting the same package at the same path)."""
    if os.path.isdir(path) and not os.path.islink(path):
        if not recursive:
            os.rmdir(path)
        else:
            shutil.rmtree(path)
    else:
        os.remove(path)


def unreachable(options: Store = None, timeout_s: float = 3.0) -> str | None:
    """Why the S3 endpoint cannot be reached (a TCP connection to its host and port within
    ``timeout_s``), or None when it answers. No request is sent and no credentials are needed,
    so a dead endpoint is told apart from missing credentials (botocore signs, and fails for want
    of credentials, before it connects)."""
    import socket

    ep = resolve_options(options).endpoint or "https://s3.amazonaws.com"
    parts = urlsplit(ep)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except socket.timeout:
        return f"no answer from {host}:{port} within {timeout_s:g} s"
    except OSError as e:
        return f"{e.strerror or type(e).__name__} at {host}:{port}"
