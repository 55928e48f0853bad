"""Compact, immutable sequences for the file lists of an index. :class:`PathList`, of strings:
one UTF-8 buffer and an offset per entry (int32 while the buffer is below 2 GiB: ``len(path) + 4``
bytes a file, against ~60 + ``len(path)`` + 8 for a tuple of ``str``), used
for the file lists of :class:`pipelines.ingest.index.DatasetIndex` and its partitions so that
an index of 1.28M files is a handful of objects on the driver and pickles as two small buffers
(the UTF-8 compressed, a length per entry in the narrowest integer type: ~6 bytes a file for
ImageNet-style names, against ``len(path) + 8``). :class:`LabelList`, of class labels: one
small-integer array that the partitions' slices share. :class:`PackedPathList`, the form an
index holds its paths in: the UTF-8 zlib-compressed in blocks of 1,024 entries and a length per
entry (~3.5 bytes a file for ImageNet's names, against ~34 for a PathList), decompressed one
block at a time as it is read, so that the driver keeps a 1.28M-file index in ~4 MB while its
stages run."""
from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Iterable, Iterator

import numpy as np

__all__ = ["PathList", "PackedPathList", "LabelList", "offset_dtype", "unpack_pathlist"]


def unpack_pathlist(data: bytes, lengths: bytes, dtype: str) -> "PathList":
    """The PathList that :meth:`PathList.__reduce__` packed: ``data`` the zlib-compressed UTF-8
    of its entries, ``lengths`` their byte lengths as ``dtype`` integers."""
    lens = np.frombuffer(lengths, np.dtype(dtype))
    buf = zlib.decompress(data)
    off = np.zeros(len(lens) + 1, offset_dtype(len(buf)))
    np.cumsum(lens, dtype=off.dtype, out=off[1:])
    return PathList(buf, off)


def _joined(pieces: list) -> "PathList":
    """The PathList of the UTF-8 ``pieces``, in order (one buffer, int64 offsets)."""
    out = np.zeros(len(pieces) + 1, np.int64)
    if pieces:
        np.cumsum(np.fromiter((len(p) for p in pieces), np.int64, len(pieces)), out=out[1:])
    return PathList(b"".join(pieces), out)


def _position(key, n: int, name: str) -> int:
    """The non-negative position of int ``key`` in a sequence of ``n`` (negatives from the end)."""
    i = int(key)
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"{name} index out of range")
    return i


def offset_dtype(nbytes: int) -> type:
    """The offsets' type for a buffer of ``nbytes``: int32 below 2 GiB, else int64."""
    return np.int32 if nbytes < 2**31 else np.int64


class PathList(Sequence):
    """Strings ``buf[off[i]:off[i+1]].decode()`` (``buf``: ``bytes``, or a ``bytearray`` filled
    once and never changed after); slicing gives a PathList, an int a ``str``;
    equal to a tuple or list with the same strings. A contiguous slice shares the buffer and
    offsets of the list it is cut from (the partitions of an index hold no copy of its paths);
    it pickles as its own bytes only."""

    __slots__ = ("_buf", "_off")

    def __init__(self, buf: bytes = b"", off: np.ndarray | None = None):
        self._buf = buf if isinstance(buf, (bytes, bytearray)) else bytes(buf)  # kept, not copied
        off = np.zeros(1, np.int64) if off is None else np.ascontiguousarray(off)
        self._off = off if off.dtype in (np.int32, np.int64) else off.astype(np.int64)  # int32: a large index's

    @classmethod
    def of(cls, items: Iterable[str]) -> "PathList":
        """A PathList of ``items`` (returned as is when it is one, or a PackedPathList)."""
        if isinstance(items, (PathList, PackedPathList)):
            return items
        return _joined([s.encode("utf-8") for s in items])

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
        return self._get(_position(key, n, "PathList"))

    def take(self, idx: Iterable[int]) -> "PathList":
        """The entries at ``idx``, in that order."""
        off, buf = self._off, self._buf
        return _joined([buf[off[i]:off[i + 1]] for i in idx])

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
        if isinstance(other, PackedPathList):
            return other == self
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
        """Its own entries only (a slice: not the buffer it shares), compressed (zlib level 1:
        sorted paths share long prefixes), each length in the narrowest unsigned type that holds it."""
        buf, off = self._compact()
        lens = np.diff(off)
        top = int(lens.max()) if len(lens) else 0
        dtype = _narrowest(top)
        return unpack_pathlist, (zlib.compress(buf, 1), lens.astype(dtype).tobytes(), np.dtype(dtype).str)

    @property
    def nbytes(self) -> int:
        """Bytes of its entries (its span of the buffer) and of its offsets."""
        return int(self._off[-1] - self._off[0]) + self._off.nbytes

    def __repr__(self) -> str:
        return f"PathList({len(self)} paths, {self.nbytes} bytes)"


def _narrowest(top: int) -> type:
    """The narrowest unsigned integer type that holds ``top``."""
    return np.uint8 if top < 2**8 else np.uint16 if top < 2**16 else np.uint32 if top < 2**32 else np.int64


class PackedPathList(Sequence):
    """The strings of a PathList held compressed: entry ``j`` is in block ``j // block``, one
    zlib stream of the blocks' entries' UTF-8, ``lens[j]`` bytes long. Reading decompresses a
    block (~50 µs for 1,024 ImageNet names) and keeps the last one, so that reading in order
    (iteration, sorted indices, a contiguous slice) decompresses each block once. A contiguous
    slice is a view sharing the blocks (an index's partitions); a slice with a step or
    :meth:`take` gives a PathList (a rank's share, small); pickles as the PathList of its
    entries; equal to a PathList, tuple or list of the same strings."""

    __slots__ = ("_blocks", "_lens", "_block", "_start", "_stop", "_cache")

    def __init__(self, blocks: tuple, lens: np.ndarray, block: int, start: int = 0, stop: int | None = None):
        self._blocks, self._lens, self._block = blocks, lens, int(block)
        self._start, self._stop = int(start), len(lens) if stop is None else int(stop)
        self._cache: list = [-1, b"", None]  # block number, its bytes, its offsets

    @classmethod
    def pack(cls, paths, block: int = 1024) -> "PackedPathList":
        """``paths`` (a PathList, a PackedPathList or strings) packed in blocks of ``block`` entries."""
        if isinstance(paths, PackedPathList):
            return paths
        paths = PathList.of(paths)
        buf, off = paths._compact()
        lens = np.diff(off)
        lens = lens.astype(_narrowest(int(lens.max()) if len(lens) else 0))
        blocks = tuple(zlib.compress(bytes(buf[off[s]:off[min(s + block, len(lens))]]), 1)
                       for s in range(0, len(lens), block))
        return cls(blocks, lens, block)

    def __len__(self) -> int:
        return self._stop - self._start

    def _load(self, b: int) -> tuple[bytes, np.ndarray]:
        """Block ``b``'s bytes and its entries' offsets in them (the last block read is kept)."""
        if self._cache[0] != b:
            lens = self._lens[b * self._block:(b + 1) * self._block]
            off = np.zeros(len(lens) + 1, np.int64)
            np.cumsum(lens, out=off[1:])
            self._cache[:] = [b, zlib.decompress(self._blocks[b]), off.tolist()]
        return self._cache[1], self._cache[2]

    def _raw(self, j: int) -> bytes:
        """The UTF-8 of absolute entry ``j``."""
        b, k = divmod(j, self._block)
        data, off = self._load(b)
        return data[off[k]:off[k + 1]]

    def __getitem__(self, key):
        n = len(self)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step == 1:
                stop = max(start, stop)
                return PackedPathList(self._blocks, self._lens, self._block, self._start + start, self._start + stop)
            return self.take(range(start, stop, step))
        return self._raw(self._start + _position(key, n, "PackedPathList")).decode("utf-8")

    def take(self, idx: Iterable[int]) -> PathList:
        """The entries at ``idx`` (positions in this list), in that order, as a PathList."""
        return _joined([self._raw(self._start + i) for i in idx])

    def _chunks(self) -> Iterator[tuple[bytes, list]]:
        """``(block bytes, offsets of this list's entries in them)`` block by block."""
        j = self._start
        while j < self._stop:
            b, k = divmod(j, self._block)
            data, off = self._load(b)
            last = min(self._block, k + self._stop - j)
            yield data, off[k:last + 1]
            j += last - k

    def __iter__(self) -> Iterator[str]:
        for data, off in self._chunks():
            for a, b in zip(off[:-1], off[1:]):
                yield data[a:b].decode("utf-8")

    def unpack(self) -> PathList:
        """Its entries as one PathList."""
        pieces = [data[off[0]:off[-1]] for data, off in self._chunks()]
        lens = self._lens[self._start:self._stop]
        out = np.zeros(len(lens) + 1, offset_dtype(int(lens.sum(dtype=np.int64))))
        np.cumsum(lens, out=out[1:])
        return PathList(b"".join(pieces), out)

    def __eq__(self, other) -> bool:
        if isinstance(other, PackedPathList):
            other = other.unpack()
        if isinstance(other, PathList):
            return len(other) == len(self) and self.unpack() == other
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.unpack())

    def __add__(self, other):  # concatenation as tuples do
        return tuple(self) + tuple(other)

    def __radd__(self, other):
        return tuple(other) + tuple(self)

    def __reduce__(self):
        """As the PathList of its entries (compressed in one stream)."""
        return self.unpack().__reduce__()

    @property
    def nbytes(self) -> int:
        """Bytes it holds: its blocks' compressed bytes (a view: its share of them) and lengths."""
        n = len(self._lens)
        comp = sum(len(b) for b in self._blocks)
        return int(comp * len(self) / n if n else 0) + self._lens[self._start:self._stop].nbytes

    @property
    def unpacked_nbytes(self) -> int:
        """:attr:`PathList.nbytes` of :meth:`unpack` (its UTF-8 and offsets), without unpacking."""
        lens = self._lens[self._start:self._stop]
        total = int(lens.sum(dtype=np.int64))
        return total + (len(lens) + 1) * np.dtype(offset_dtype(total)).itemsize

    def __repr__(self) -> str:
        return f"PackedPathList({len(self)} paths, {self.nbytes} bytes)"


class LabelList(Sequence):
    """An immutable sequence of class labels (``-1``: unlabeled) in one numpy array of the
    narrowest signed type that holds them (2 bytes a file below 32,767 classes, against 8 for a
    tuple's slot); an int gives an ``int``, a slice a LabelList that is a view of the same array
    (the partitions of an index hold no copy of its labels); equal to a tuple or list of the same
    ints; pickles as its own values only."""

    __slots__ = ("_a",)

    def __init__(self, values=()):
        a = values if isinstance(values, np.ndarray) else np.asarray(tuple(values), np.int64)
        self._a = a.reshape(-1) if a.dtype.kind == "i" else a.astype(np.int64).reshape(-1)

    @classmethod
    def of(cls, values) -> "LabelList":
        """A LabelList of ``values`` (ints or an integer array) in the narrowest signed type."""
        if isinstance(values, LabelList):
            return values
        a = values if isinstance(values, np.ndarray) else np.asarray(tuple(values), np.int64)
        lo, hi = (int(a.min()), int(a.max())) if len(a) else (0, 0)
        for dt in (np.int16, np.int32):
            if np.iinfo(dt).min <= lo and hi <= np.iinfo(dt).max:
                return cls(a.astype(dt))
        return cls(a.astype(np.int64))

    def __len__(self) -> int:
        return len(self._a)

    def __getitem__(self, key):
        if isinstance(key, slice):
            return LabelList(self._a[key])  # a view, also with a step
        return int(self._a[key])

    def __iter__(self) -> Iterator[int]:
        for s in range(0, len(self._a), 65536):
            yield from self._a[s:s + 65536].tolist()

    def __array__(self, dtype=None, copy=None):
        return self._a if dtype is None else self._a.astype(dtype)

    def __eq__(self, other) -> bool:
        if isinstance(other, LabelList):
            return np.array_equal(self._a, other._a)
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._a.astype(np.int64).tobytes())

    def __add__(self, other):  # concatenation as tuples do
        return tuple(self) + tuple(other)

    def __radd__(self, other):
        return tuple(other) + tuple(self)

    def __reduce__(self):
        return LabelList, (np.ascontiguousarray(self._a),)

    @property
    def nbytes(self) -> int:
        return int(self._a.nbytes)

    def __repr__(self) -> str:
        return f"LabelList({len(self)} labels, {self._a.dtype})"
