"""Fixed-size batches for the search and evaluation actors (``docs/design.md`` §2).

Every forward pass of an actor runs on **exactly** ``batch_size`` rows: :func:`iter_chunks`
re-batches the valid images of a shard into fixed-size batches, zero-pads the last one
(the padding rows are dropped from the outputs) and groups the batches into chunks of
``batches_per_chunk`` batches (a group of weight samples is drawn once per chunk).
Per-example results of a fixed-size batch do not depend on the other rows, so an example
gets the same prediction whichever actor and batch it lands in.
:func:`valid_batches` drops the invalid rows of a Ray Data shard and keeps the skip report.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping, NamedTuple

import numpy as np
import torch

__all__ = ["Chunk", "check_pos_int", "iter_chunks", "load_chunk", "valid_batches"]


def check_pos_int(name: str, v: Any) -> None:
    """``ValueError`` naming ``name`` unless ``v`` is an int >= 1 (not a bool)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


# --------------------------------------------------------------------------- fixed-size batches
class Chunk(NamedTuple):
    """``xs``: list of ``[batch_size, ...]`` inputs (the last one may be zero-padded);
    ``ys``: list of int64 labels ``[b_j]`` of the real rows; ``sizes``: ``b_j`` (real rows
    in batch ``j``, a prefix of the batch)."""

    xs: list[torch.Tensor]
    ys: list[torch.Tensor]
    sizes: list[int]

    @property
    def count(self) -> int:
        return sum(self.sizes)


def _as_xy(b: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(b, Mapping):
        x = b["image"] if "image" in b else b["x"]
        y = b["label"] if "label" in b else b.get("y")
    else:
        x, y = b[0], b[1]
    x = torch.as_tensor(np.asarray(x)) if not isinstance(x, torch.Tensor) else x
    if y is None:
        y = torch.full((x.shape[0],), -1, dtype=torch.int64)
    y = torch.as_tensor(np.asarray(y)) if not isinstance(y, torch.Tensor) else y
    return x, y.to(torch.int64)


def iter_chunks(
    batches: Iterable[Any],
    batch_size: int,
    batches_per_chunk: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Iterator[Chunk]:
    """Re-batch ``(x, y)`` pairs (or dicts with image/label) into fixed-size batches and
    group them into chunks of ``batches_per_chunk`` batches. Inputs are converted to
    ``dtype`` / ``device``. Every yielded batch has exactly ``batch_size`` rows."""
    check_pos_int("batch_size", batch_size)
    check_pos_int("batches_per_chunk", batches_per_chunk)
    buf_x: list[torch.Tensor] = []
    buf_y: list[torch.Tensor] = []
    buffered = 0
    xs: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    sizes: list[int] = []

    def emit(n_real: int) -> None:
        nonlocal buf_x, buf_y, buffered
        x = torch.cat(buf_x) if len(buf_x) > 1 else buf_x[0]
        y = torch.cat(buf_y) if len(buf_y) > 1 else buf_y[0]
        take_x, rest_x = x[:n_real], x[n_real:]
        take_y, rest_y = y[:n_real], y[n_real:]
        if n_real < batch_size:
            pad = take_x.new_zeros((batch_size - n_real, *take_x.shape[1:]))
            take_x = torch.cat([take_x, pad])
        xs.append(take_x.to(device=device, dtype=dtype).contiguous())
        ys.append(take_y.clone())
        sizes.append(n_real)
        buf_x, buf_y = ([rest_x], [rest_y]) if rest_x.shape[0] else ([], [])
        buffered = int(rest_x.shape[0])

    for b in batches:
        x, y = _as_xy(b)
        if x.shape[0] == 0:
            continue
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"batch has {x.shape[0]} inputs but {y.shape[0]} labels")
        buf_x.append(x)
        buf_y.append(y)
        buffered += int(x.shape[0])
        while buffered >= batch_size:
            emit(batch_size)
            if len(xs) == batches_per_chunk:
                yield Chunk(xs, ys, sizes)
                xs, ys, sizes = [], [], []
    if buffered:
        emit(buffered)
    if xs:
        yield Chunk(xs, ys, sizes)


def valid_batches(shard: Any, batch_size: int):
    """(iterator of (x, y) without invalid rows, callable returning the SkipReport so far)."""
    from pipelines.ingest.batches import SkipReport, iter_valid_batches

    state = {"skipped": SkipReport()}

    def gen():
        for b in iter_valid_batches(shard, batch_size=batch_size):
            state["skipped"] = state["skipped"].merge(b.skipped)
            if b.y.shape[0]:
                yield b.x, b.y

    return gen(), lambda: state["skipped"]


def load_chunk(d: Mapping[str, Any], device: str) -> Chunk:
    """One chunk of :func:`pipelines.evaluation.tune.chunk_refs` (its ``ray.get`` value) as a
    :class:`Chunk` on ``device``."""
    sizes = [int(s) for s in d["sizes"]]
    ys = torch.from_numpy(np.array(d["ys"]))
    xs = torch.from_numpy(np.array(d["xs"])).to(device)
    return Chunk(list(xs.unbind(0)), list(ys.split(sizes)), sizes)
