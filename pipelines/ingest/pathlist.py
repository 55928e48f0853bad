"""A compact, immutable sequence of strings: one UTF-8 buffer and an int64 offset per entry
(``len(path) + 8`` bytes a file, against ~60 + ``len(path)`` + 8 for a tuple of ``str``), used
for the file lists of :class:`pipelines.ingest.index.DatasetIndex` and its partitions so that
an index of 1.28M files is a handful of objects on the driver and pickles as two buffers."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Iterable, Iterator

import numpy as np

__all__ = ["PathList"]


class PathList(Sequence):
    """Strings ``buf[off[i]:off[i+1]].decode()`` (``buf``: ``bytes``, or a ``bytearray`` filled
    once and never changed after); slicing gives a PathList, an int a ``str``;
    equal to a tuple or list with the same strings. A contiguous slice shares the buffer and
    offsets of the list it is cut from (the partitions of an index hold no copy of its paths);
    it pickles as its own bytes only."""

    __slots__ = ("_buf", "_off")

    def __init__(self, buf: bytes = b"", off: np.ndarray | None = None):
        self._buf = buf if isinstance(buf, (bytes, bytearray)) else bytes(buf)  # kept, not copied
        self._off = np.zeros(1, np.int64) if off is None else np.ascontiguousarray(off, dtype=np.int64)

    @classmethod
    def of(cls, items: Iterable[str]) -> "PathList":
        """A PathList of ``items`` (returned as is when it is one)."""
        if isinstance(items, PathList):
            return items
        enc = [s.encode("utf-8") for s in items]
        off = np.zeros(len(enc) + 1, np.int64)
        if enc:
            np.cumsum(np.fromiter((len(b) for b in enc), np.int64, len(enc)), out=off[1:])
        return cls(b"".join(enc), off)

    def __len__(self) -> int:
        return len(self._off) - 1

    def _get(self, i: int) -> str:
        return self._buf[self._off[i]:self._off[i + 1]].decode("utf-8")

    def __getitem__(self, key):
        n = len(self)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step == 1:
                stop = max(start, stop)
                return PathList(self._buf, self._off[start:stop + 1])  # shared, not copied
            return self.take(range(start, stop, step))
        i = int(key)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("PathList index out of range")
        return self._get(i)

    def take(self, idx: Iterable[int]) -> "PathList":
        """The entries at ``idx``, in that order."""
        off, buf = self._off, self._buf
        pieces = [buf[off[i]:off[i + 1]] for i in idx]
        out = np.zeros(len(pieces) + 1, np.int64)
        if pieces:
            np.cumsum(np.fromiter((len(p) for p in pieces), np.int64, len(pieces)), out=out[1:])
        return PathList(b"".join(pieces), out)

    def __iter__(self) -> Iterator[str]:
        buf, off = self._buf, self._off.tolist()
        for i in range(len(off) - 1):
            yield buf[off[i]:off[i + 1]].decode("utf-8")

    def _compact(self) -> tuple[bytes, np.ndarray]:
        """``(the bytes of its entries, offsets from 0)``: a slice's own part of a shared buffer."""
        a, b = int(self._off[0]), int(self._off[-1])
        if a == 0 and b == len(self._buf):
            return self._buf, self._off
        return self._buf[a:b], self._off - a

    def __eq__(self, other) -> bool:
        if isinstance(other, PathList):
            (b1, o1), (b2, o2) = self._compact(), other._compact()
            return b1 == b2 and np.array_equal(o1, o2)
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __add__(self, other):  # concatenation as tuples do (a tuple: callers add tuples of paths)
        return tuple(self) + tuple(other)

    def __radd__(self, other):
        return tuple(other) + tuple(self)

    def __hash__(self) -> int:
        return hash((bytes(self._compact()[0]), len(self)))

    def __reduce__(self):
        return PathList, self._compact()

    @property
    def nbytes(self) -> int:
        """Bytes of its entries (its span of the buffer) and of its offsets."""
        return int(self._off[-1] - self._off[0]) + self._off.nbytes

    def __repr__(self) -> str:
        return f"PathList({len(self)} paths, {self.nbytes} bytes)"
