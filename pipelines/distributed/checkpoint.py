"""Checkpoints of a partitioned pass: the reduced running sum with the finished partition ids.

``<base>/ckpt-<k>/`` (``k`` = finished partitions, 6 digits) is a :mod:`laplace_core.io`
artifact (``tensors.safetensors`` + ``manifest.json``, manifest written last = commit point;
SHA-256 checked on load). Its meta: ``format`` (the pass kind's tag), ``fingerprint`` (of the
model, partitions and settings: a checkpoint of another run is never used), ``done`` (the
finished partition ids), ``counts``, ``rows`` / ``invalid`` per partition, ``skipped`` (the
skip report), ``final`` (every partition of the pass is in it).

:func:`save_checkpoint` removes the older checkpoints only after the new one is committed.
:func:`load_checkpoint` takes the most advanced one that loads; a corrupt or truncated one
is reported in one line and the one before it (or a fresh start) is used.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from laplace_core.io import load_tensors, save_tensors

from pipelines.distributed.progress import say
from pipelines.storage import uris as storage
from pipelines.storage.store import RunStore

__all__ = ["MANIFEST", "list_checkpoints", "load_checkpoint", "save_checkpoint", "tensor_bytes"]

MANIFEST = "manifest.json"


def tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the tensor data in an artifact (what :func:`save_checkpoint` reports as written)."""
    return int(sum(t.numel() * t.element_size() for t in tensors.values()))


def list_checkpoints(base: str, fingerprint: str, store: RunStore = RunStore(), fmt: str | None = None,
                     tag: str = "curvature") -> list[tuple[str, dict[str, Any]]]:
    """``(uri, meta)`` of every committed checkpoint under ``base`` with ``fingerprint`` (and
    format ``fmt`` when given), most finished partitions first. A manifest that cannot be read
    is reported in one line and skipped."""
    found = []
    for name in store.listdir(base):
        if not name.startswith("ckpt-") or not name[5:].isdigit():
            continue
        uri = storage.join(base, name)
        man = storage.join(uri, MANIFEST)
        if not store.exists(man):
            continue  # cut short before its commit point
        try:
            meta = store.read_json(man).get("meta", {})
            done = len(meta["done"]) if fmt is None or meta.get("format") == fmt else -1
        except (ValueError, OSError, KeyError, TypeError, AttributeError) as e:
            say(f"[{tag}] checkpoint {uri} has an unreadable manifest ({type(e).__name__}); not used")
            continue
        if done >= 0 and meta.get("fingerprint") == fingerprint:
            found.append((done, name, uri, meta))
    found.sort(key=lambda f: (-f[0], f[1]))
    return [(uri, meta) for _, _, uri, meta in found]


def load_checkpoint(base: str, fingerprint: str, store: RunStore = RunStore(), fmt: str | None = None,
                    tag: str = "curvature") -> tuple[str, dict[str, Any], dict[str, torch.Tensor]] | None:
    """``(uri, meta, tensors)`` of the most advanced checkpoint that loads and passes its
    SHA-256 check; a corrupt or truncated one is reported in one line and passed over (its
    partitions are computed again). ``None`` when none is usable."""
    for uri, meta in list_checkpoints(base, fingerprint, store, fmt, tag):
        try:
            tensors, _ = load_tensors(uri, store.fsspec_options(uri))
            return uri, meta, tensors
        except (ValueError, OSError, KeyError) as e:
            say(f"[{tag}] checkpoint {uri} is unusable ({str(e).splitlines()[0][:200]}); "
                  f"its partitions are computed again")
    return None


def save_checkpoint(base: str, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
                    store: RunStore = RunStore()) -> tuple[str, int]:
    """Commit ``ckpt-<len(meta['done'])>`` under ``base``, then remove every other checkpoint
    there. Returns ``(uri, bytes of tensor data written)``."""
    name = f"ckpt-{len(meta['done']):06d}"
    uri = storage.join(base, name)
    save_tensors(uri, tensors, dict(meta), store.fsspec_options(uri))
    for other in store.listdir(base):  # the older ones, now that this one is committed
        if other.startswith("ckpt-") and other != name:
            store.remove(storage.join(base, other), recursive=True)
    return uri, tensor_bytes(tensors)
