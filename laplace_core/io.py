"""Artifact I/O: safetensors + JSON manifest, versioned and checksummed (docs/design.md §4).

An artifact is a directory ``<uri>/`` (local path or any fsspec URL, e.g.
``s3://bucket/prefix``) holding

* ``tensors.safetensors``: every tensor, by flat name;
* ``manifest.json``: ``{"format": "infoform.tensors", "version": 1, "meta": {...},
  "file": "tensors.safetensors", "sha256": ..., "bytes": ..., "tensors": {name:
  {"dtype", "shape"}}}``, and optionally ``"refs": {"uri", "sha256", "tensors": {name:
  name in the other artifact}}``: tensors stored once in another artifact (a posterior's
  eigenvectors are the run's eigenbasis), ``uri`` relative to this artifact's directory (or
  absolute); loading reads them from there and checks that artifact's checksum is still the
  one recorded, so a rewritten eigenbasis is reported, never silently mixed.

Writes are atomic per file (local: temporary name in the same directory, fsync,
``os.replace``; remote: one PUT of the whole object) and ordered tensors first,
manifest last, so a reader never sees a manifest whose tensors are missing; an
interrupted re-save leaves a checksum mismatch, which is reported, never a silent
mix. Loading never unpickles: JSON and ``safetensors.torch.load`` on bytes.
Remote credentials come from the environment (standard AWS chain for s3) and are
never logged (a posterior is loaded by :meth:`laplace_core.posteriors.structures.base.Posterior.load`,
which reads its artifact through :func:`load_tensors`; this module knows no structure).
Everything else about reaching a store (an S3-compatible endpoint, addressing
style, region) is passed explicitly as ``storage_options``: fsspec's keyword arguments for
the URI's filesystem, ignored for local paths. Nothing here reads or writes ``os.environ``.
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import tempfile
from typing import Any, Mapping

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

__all__ = ["FORMAT", "VERSION", "TENSORS_FILE", "MANIFEST_FILE", "save_tensors", "load_tensors"]

FORMAT = "infoform.tensors"
VERSION = 1
TENSORS_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"


def _fs(uri: str, storage_options: Mapping[str, Any] | None = None):
    if not isinstance(uri, (str, os.PathLike)) or not str(uri):
        raise ValueError(f"artifact uri must be a non-empty path or URL, got {uri!r}")
    uri = str(uri)
    remote = "://" in uri and not uri.startswith("file://")
    fs, path = fsspec.core.url_to_fs(uri, **(dict(storage_options or {}) if remote else {}))
    return fs, path.rstrip("/") or path


def _join(fs, base: str, name: str) -> str:
    return f"{base}/{name}" if base else name


def _write_bytes(fs, path: str, data: bytes) -> None:
    """Atomic write: local temp file + fsync + rename; remote single put."""
    if isinstance(fs, LocalFileSystem):
        d = os.path.dirname(path) or "."
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".part", dir=d)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    else:
        fs.pipe_file(path, data)


def _prepare(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors; storage shared between entries is copied
    (safetensors refuses shared storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for k, t in tensors.items():
        if not isinstance(k, str) or not k:
            raise ValueError(f"tensor names must be non-empty strings, got {k!r}")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensor {k!r} is a {type(t).__name__}, not a torch.Tensor")
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
        elif t.numel():
            seen.add(ptr)
        out[k] = t
    return out


def save_tensors(uri: str, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
                 storage_options: Mapping[str, Any] | None = None, refs: Mapping[str, Any] | None = None) -> None:
    """Write ``tensors`` and the JSON-able ``meta`` as an artifact directory at ``uri``.

    ``refs``: ``{"uri": other artifact (relative to ``uri`` or absolute), "tensors": {name:
    name there}}``: those of ``tensors`` are not written here but referenced (the caller
    checked that they are equal); the other artifact's sha256 is recorded."""
    fs, base = _fs(uri, storage_options)
    try:
        meta_json = json.loads(json.dumps(meta, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{uri}: meta is not JSON-serialisable ({e})") from None
    ref_json = None
    if refs:
        names = dict(refs["tensors"])
        unknown = sorted(set(names) - set(tensors))
        if unknown:
            raise ValueError(f"{uri}: refs name tensors that are not given: {unknown[:3]}")
        ref_manifest = _manifest(_ref_uri(uri, refs["uri"]), storage_options)
        ref_json = {"uri": str(refs["uri"]), "sha256": ref_manifest["sha256"], "tensors": names}
        tensors = {k: t for k, t in tensors.items() if k not in names}
    prepared = _prepare(tensors)
    data = st_save(prepared)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "file": TENSORS_FILE,
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        "tensors": {k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for k, t in prepared.items()},
        "meta": meta_json,
    }
    if ref_json is not None:
        manifest["refs"] = ref_json
    fs.makedirs(base, exist_ok=True)
    _write_bytes(fs, _join(fs, base, TENSORS_FILE), data)
    _write_bytes(fs, _join(fs, base, MANIFEST_FILE), json.dumps(manifest, indent=1, sort_keys=True).encode())


def _read(fs, path: str, uri: str, what: str) -> bytes:
    try:
        with fs.open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{uri}: {what} not found ({path})") from None


def _ref_uri(uri: str, ref: str) -> str:
    """``ref`` resolved against the artifact directory ``uri`` (kept when absolute)."""
    if "://" in ref or ref.startswith("/"):
        return ref
    scheme, sep, path = str(uri).rpartition("://")
    joined = posixpath.normpath(posixpath.join(path.rstrip("/"), ref))
    return f"{scheme}{sep}{joined}" if sep else joined


def _manifest(uri: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    fs, base = _fs(uri, storage_options)
    raw = _read(fs, _join(fs, base, MANIFEST_FILE), uri, MANIFEST_FILE)
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{uri}: {MANIFEST_FILE} is not valid JSON ({e.__class__.__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise ValueError(f"{uri}: not an infoform artifact (format tag {got!r}, expected {FORMAT!r})")
    return manifest


def _load_refs(uri: str, refs: Mapping[str, Any], storage_options) -> dict[str, torch.Tensor]:
    """The referenced tensors, from the other artifact, whose checksum must be the recorded one."""
    other = _ref_uri(uri, str(refs["uri"]))
    if _manifest(other, storage_options).get("sha256") != refs.get("sha256"):
        raise ValueError(f"{uri}: the artifact it shares tensors with ({other}) was rewritten since "
                         "(checksum differs); rebuild this artifact")
    tensors, _ = load_tensors(other, storage_options)
    missing = [r for r in refs["tensors"].values() if r not in tensors]
    if missing:
        raise ValueError(f"{uri}: {other} lacks the shared tensors {missing[:3]}")
    return {k: tensors[r] for k, r in refs["tensors"].items()}


def load_tensors(uri: str, storage_options: Mapping[str, Any] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, meta)`` of the artifact at ``uri``, after checking format, version,
    byte size and sha256 (and those of an artifact it shares tensors with). Tensors are on the CPU."""
    fs, base = _fs(uri, storage_options)
    manifest = _manifest(uri, storage_options)
    if manifest.get("version") != VERSION:
        raise ValueError(f"{uri}: unsupported artifact version {manifest.get('version')!r} (this code reads {VERSION})")
    for key in ("file", "sha256", "bytes", "tensors", "meta"):
        if key not in manifest:
            raise ValueError(f"{uri}: {MANIFEST_FILE} lacks the field {key!r}")
    fname = manifest["file"]
    if not isinstance(fname, str) or "/" in fname or fname in ("", ".", ".."):
        raise ValueError(f"{uri}: {MANIFEST_FILE} names an invalid tensors file {fname!r}")
    data = _read(fs, _join(fs, base, fname), uri, fname)
    if len(data) != manifest["bytes"]:
        raise ValueError(f"{uri}: {fname} has {len(data)} bytes, manifest says {manifest['bytes']} (truncated or replaced)")
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise ValueError(f"{uri}: {fname} checksum mismatch (sha256 differs from the manifest; file corrupted)")
    try:
        tensors = st_load(data)
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"{uri}: {fname} is not a valid safetensors file ({e})") from None
    expected = manifest["tensors"]
    if set(tensors) != set(expected):
        raise ValueError(f"{uri}: tensor names differ from the manifest")
    for k, t in tensors.items():
        e = expected[k]
        if list(t.shape) != list(e["shape"]) or str(t.dtype).removeprefix("torch.") != e["dtype"]:
            raise ValueError(f"{uri}: tensor {k!r} is {t.dtype}{list(t.shape)}, manifest says {e['dtype']}{e['shape']}")
    if manifest.get("refs"):
        tensors.update(_load_refs(uri, manifest["refs"], storage_options))
    return tensors, manifest["meta"]
