"""Collectives of the partitioned passes: bucketed SUM all-reduce, object broadcast, and the
packing of symmetric matrices into their upper triangles.

The Kronecker factors ``A`` (``n x n``), ``G`` (``m x m``) and the subnet Fisher (``S x S``)
are symmetric sums, so only their upper triangles (row-major ``torch.triu_indices`` order,
``n (n + 1) / 2`` numbers) are all-reduced and stored; :func:`unpack_symmetric` rebuilds the
full matrix (both triangles from the same numbers, so the result is exactly symmetric).
Every worker adds its examples in float64, so the packed sums lose nothing.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch

__all__ = ["buckets", "allreduce_sum", "broadcast_object", "pack_symmetric", "unpack_symmetric",
           "packed_size", "new_comm_record"]


def new_comm_record() -> dict[str, Any]:
    """The counters :func:`allreduce_sum` adds to: seconds, payload bytes, collective calls."""
    return {"allreduce_s": 0.0, "allreduce_bytes": 0, "allreduce_calls": 0}


def buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Consecutive groups of tensor indices whose total size stays under ``bucket_bytes``
    (a single larger tensor gets a bucket of its own)."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, t in enumerate(tensors):
        nb = t.numel() * t.element_size()
        if cur and size + nb > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nb
    if cur:
        out.append(cur)
    return out


def allreduce_sum(tensors: list[torch.Tensor], bucket_bytes: int, rec: dict) -> list[torch.Tensor]:
    """SUM-all-reduce of ``tensors`` (same dtype/device) in flattened buckets of at most
    ``bucket_bytes``. Returns tensors with the summed values: views into the buckets, or, for
    a contiguous tensor alone in its bucket (a large factor, a packed subnet Fisher), the
    tensor itself, reduced in place (no copy of the largest payloads). Adds seconds, payload
    bytes and calls to ``rec`` (:func:`new_comm_record`)."""
    import torch.distributed as dist

    out: list[torch.Tensor | None] = [None] * len(tensors)
    for group in buckets(tensors, bucket_bytes):
        if len(group) == 1 and tensors[group[0]].is_contiguous():
            flat = tensors[group[0]].view(-1)  # in place
        else:
            flat = torch.cat([tensors[i].reshape(-1) for i in group])
        t0 = time.perf_counter()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)
        rec["allreduce_s"] += time.perf_counter() - t0
        rec["allreduce_bytes"] += flat.numel() * flat.element_size()
        rec["allreduce_calls"] += 1
        off = 0
        for i in group:
            k = tensors[i].numel()
            out[i] = flat[off: off + k].view_as(tensors[i])
            off += k
    return out  # type: ignore[return-value]


def broadcast_object(obj, rank: int):
    """Rank 0's ``obj`` on every rank (pickled by ``torch.distributed``; small objects only)."""
    import torch.distributed as dist

    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def packed_size(n: int) -> int:
    """Numbers in the upper triangle (with the diagonal) of an ``n x n`` matrix: ``n (n + 1) / 2``."""
    return n * (n + 1) // 2


_INDEX_CACHE: dict[tuple[int, str], torch.Tensor] = {}
#: Up to this size the upper triangle is gathered with one cached index tensor (``n (n+1)/2``
#: int64, 16.8 MiB at 2048); larger matrices (the 4608 x 4608 factors, an ``S x S`` subnet
#: Fisher) are packed row by row, so no index larger than the matrix itself is ever formed.
INDEX_MAX_N = 2048


def _triu_flat_index(n: int, device) -> torch.Tensor:
    key = (n, str(device))
    idx = _INDEX_CACHE.get(key)
    if idx is None:
        r, c = torch.triu_indices(n, n, device=device)
        idx = r * n + c
        _INDEX_CACHE[key] = idx
    return idx


def pack_symmetric(mat: torch.Tensor) -> torch.Tensor:
    """The upper triangle of the square ``mat`` (with its diagonal), row by row: a new 1-D
    tensor of :func:`packed_size` numbers."""
    n = mat.shape[0]
    if mat.dim() != 2 or mat.shape[1] != n:
        raise ValueError(f"pack_symmetric needs a square matrix, got shape {tuple(mat.shape)}")
    if n <= INDEX_MAX_N:
        return mat.reshape(-1).index_select(0, _triu_flat_index(n, mat.device))
    out = torch.empty(packed_size(n), dtype=mat.dtype, device=mat.device)
    off = 0
    for i in range(n):
        out[off: off + n - i] = mat[i, i:]
        off += n - i
    return out


def unpack_symmetric(packed: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The symmetric ``n x n`` matrix whose upper triangle is ``packed`` (:func:`pack_symmetric`);
    written into ``out`` when given (its previous values are replaced)."""
    if packed.numel() != packed_size(n):
        raise ValueError(f"{packed.numel()} packed numbers do not make an upper triangle of {n} x {n}")
    if out is None:
        out = torch.empty(n, n, dtype=packed.dtype, device=packed.device)
    src = packed.reshape(-1).to(device=out.device, dtype=out.dtype)
    if n <= INDEX_MAX_N:
        idx = _triu_flat_index(n, out.device)
        flat = out.view(-1)
        flat.index_copy_(0, idx, src)
        flat.index_copy_(0, (idx % n) * n + idx // n, src)
        return out
    off = 0
    for i in range(n):
        seg = src[off: off + n - i]
        out[i, i:] = seg
        out[i:, i] = seg
        off += n - i
    return out
