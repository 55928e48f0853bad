"""The ImageFolder scan of a listing table (:mod:`pipelines.ingest.listing`), column-wise.

:func:`imagefolder` reads the ``path`` column (sorted, ``/``-separated, folder markers ending
in ``/``) with Arrow kernels and gives the kept files as one :class:`PathList` and their labels
as one integer array, so that scanning 1.28M files holds no Python object per file (the
row-by-row scan in :mod:`pipelines.ingest.scan` held a ``str`` per file, a set of folders and
lists of labels: ~300 MB at ImageNet's size). The rules are the scan's: hidden entries (any
part starting with ``.``) are dropped; the class folders are the top-level folders (of files or
markers); a file under a class folder is kept when its suffix (``posixpath.splitext``,
case-insensitive) is in ``extensions``; top-level files and other suffixes are ignored.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from pipelines.ingest.index import DataError
from pipelines.ingest.pathlist import PathList

__all__ = ["imagefolder", "first_part", "pathlist_of", "labels_tuple", "release_unused"]


def release_unused() -> None:
    """Give the memory Arrow's allocator keeps after large temporaries back to the system, so
    that the Python objects allocated next do not add to the peak (mimalloc and jemalloc keep
    freed pages for reuse by Arrow only)."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


def pathlist_of(chunks, total: int | None = None) -> PathList:
    """A PathList of the strings of Arrow string arrays (a chunked array, or an iterable of
    arrays), copied one chunk at a time into one buffer: of ``total`` bytes when the caller knows
    it (filled in place: the only copy), else joined at the end. No ``str`` per entry."""
    import pyarrow as pa

    buf = bytearray(total) if total is not None else None
    pieces: list[bytes] = []
    offs: list[np.ndarray] = [np.zeros(1, np.int64)]
    end = 0
    for array in (chunks.chunks if isinstance(chunks, pa.ChunkedArray) else chunks):
        if not len(array):
            continue
        if array.type != pa.string():
            array = array.cast(pa.string())
        _validity, offsets, data = array.buffers()
        off = np.frombuffer(offsets, np.int32, len(array) + 1, array.offset * 4).astype(np.int64)
        a, b = int(off[0]), int(off[-1])
        if buf is not None:
            buf[end:end + b - a] = memoryview(data)[a:b]
        else:
            pieces.append(memoryview(data)[a:b].tobytes())
        offs.append(off[1:] - a + end)
        end += b - a
    if buf is None:
        buf = b"".join(pieces)
    elif end != len(buf):
        raise ValueError(f"pathlist_of: {end} bytes of strings, {len(buf)} announced")
    return PathList(buf, np.concatenate(offs))


def labels_tuple(labels: np.ndarray, num_classes: int) -> tuple[int, ...]:
    """``tuple(int(y) for y in labels)`` with one shared ``int`` object per class (8 bytes an
    entry, not 8 + 28), built a block at a time."""
    import itertools

    ints = tuple(range(-1, num_classes))
    blocks = (map(ints.__getitem__, (labels[a:a + 65536] + 1).tolist()) for a in range(0, len(labels), 65536))
    return tuple(itertools.chain.from_iterable(blocks))


def first_part(paths):
    """The first ``/``-separated part of each path when it has a ``/`` (its class folder), else
    ``""`` (one small string per row, not a list of every part)."""
    import pyarrow.compute as pc

    return pc.fill_null(pc.struct_field(pc.extract_regex(paths, r"^(?P<c>[^/]*)/"), [0]), "")


def _suffix_ok(paths, extensions: Sequence[str] | None):
    import pyarrow as pa
    import pyarrow.compute as pc

    if extensions is None:
        return pc.is_valid(paths)
    # posixpath.splitext of the last part: its last ".", unless the part is only dots before it
    ext = pc.struct_field(pc.extract_regex(paths, r"(?:^|/)\.*[^./][^/]*?(?P<e>\.[^./]*)$"), [0])
    ok = pc.is_in(pc.utf8_lower(ext), value_set=pa.array(list(extensions), pa.string()))
    return pc.fill_null(ok, False)


def imagefolder(table, split_uri: str, explicit: tuple[str, ...] | None, extensions: Sequence[str] | None):
    """``(classes, kept files, their labels, ignored files)`` of an ImageFolder listing, or
    ``None`` when ``table`` has no class folder (another layout: the row-by-row scan)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    paths = table.column("path")
    first = table.column("class") if "class" in table.column_names else first_part(paths)
    marker = pc.ends_with(paths, "/")
    visible = pc.and_(pc.invert(pc.match_substring_regex(paths, r"(^|/)\.")),
                      pc.not_equal(paths, pa.scalar("/")))
    nested = pc.and_(visible, pc.match_substring(paths, "/"))  # markers, and files in folders
    folders = pc.unique(pc.filter(first, nested)).to_pylist()
    if not folders:
        return None
    top_dirs = tuple(sorted(folders))
    classes = explicit if explicit is not None else top_dirs
    if explicit is not None:
        known = set(explicit)
        unknown = [d for d in top_dirs if d not in known]
        if unknown:
            shown = ", ".join(unknown[:3]) + (", ..." if len(unknown) > 3 else "")
            raise DataError(f"{len(unknown)} class folder(s) under {split_uri} are not in the class list: {shown}")
    files = pc.and_(visible, pc.invert(marker))
    in_folder = pc.and_(files, pc.match_substring(paths, "/"))
    keep = pc.and_(in_folder, _suffix_ok(paths, extensions))
    del marker, visible, nested
    ignored = pc.filter(paths, pc.and_(files, pc.invert(keep))).to_pylist()
    labels = pc.filter(pc.index_in(first, value_set=pa.array(list(classes), pa.string())), keep)
    labels = labels.to_numpy().astype(np.int64) if len(labels) else np.zeros(0, np.int64)
    total = int(pc.sum(pc.filter(pc.binary_length(paths), keep)).as_py() or 0) if len(labels) else 0
    return classes, pathlist_of(_filtered(paths, keep), total), labels, ignored


def _filtered(paths, mask):
    """``pc.filter(paths, mask)`` a chunk of ``paths`` at a time (each chunk freed once read)."""
    import pyarrow.compute as pc

    start = 0
    for chunk in paths.chunks:
        yield pc.filter(chunk, mask.slice(start, len(chunk)).combine_chunks())
        start += len(chunk)
