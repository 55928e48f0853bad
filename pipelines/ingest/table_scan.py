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
from pipelines.ingest.pathlist import PathList, offset_dtype

__all__ = ["imagefolder", "first_part", "pathlist_of", "release_unused"]


def release_unused() -> None:
    """Give the memory Arrow's allocator and glibc's heaps keep after large temporaries back to
    the system, so that what is allocated next does not add to the peak (mimalloc and jemalloc
    keep freed pages for reuse by Arrow only; glibc keeps free pages inside its heaps:
    :func:`pipelines.malloc.release_free_memory`)."""
    import pyarrow as pa

    from pipelines.malloc import release_free_memory

    pa.default_memory_pool().release_unused()
    release_free_memory()


def pathlist_of(chunks, total: int | None = None, count: int | None = None) -> PathList:
    """A PathList of the strings of Arrow string arrays (a chunked array, or an iterable of
    arrays), copied one chunk at a time into one buffer: of ``total`` bytes when the caller knows
    it (filled in place: the only copy), else joined at the end; the offsets likewise filled in
    place in one array when the caller knows the ``count`` of strings. No ``str`` per entry."""
    import pyarrow as pa

    buf = bytearray(total) if total is not None else None
    pieces: list[bytes] = []
    offs: list[np.ndarray] = [np.zeros(1 if count is None else count + 1,
                                       np.int64 if total is None else offset_dtype(total))]
    end = rows = 0
    for array in (chunks.chunks if isinstance(chunks, pa.ChunkedArray) else chunks):
        if not len(array):
            continue
        if array.type != pa.string():
            array = array.cast(pa.string())
        _validity, offsets, data = array.buffers()
        off = np.frombuffer(offsets, np.int32, len(array) + 1, array.offset * 4)
        a, b = int(off[0]), int(off[-1])
        if buf is not None:
            buf[end:end + b - a] = memoryview(data)[a:b]
        else:
            pieces.append(memoryview(data)[a:b].tobytes())
        if count is None:
            offs.append(off[1:].astype(np.int64) - a + end)
        else:
            out = offs[0][rows + 1:rows + 1 + len(array)]
            out[:] = off[1:]
            out += end - a
        end, rows = end + b - a, rows + len(array)
    if buf is None:
        buf = b"".join(pieces)
    elif end != len(buf):
        raise ValueError(f"pathlist_of: {end} bytes of strings, {len(buf)} announced")
    if count is not None and rows != count:
        raise ValueError(f"pathlist_of: {rows} strings, {count} announced")
    return PathList(buf, offs[0] if count is not None else np.concatenate(offs))


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
    release_unused()  # the regex kernels' temporaries: not kept beside the file list built next
    ignored = pc.filter(paths, pc.and_(files, pc.invert(keep))).to_pylist()
    labels = pc.filter(pc.index_in(first, value_set=pa.array(list(classes), pa.string())), keep)
    labels = labels.to_numpy().astype(np.int64) if len(labels) else np.zeros(0, np.int64)
    total = int(pc.sum(pc.filter(pc.binary_length(paths), keep)).as_py() or 0) if len(labels) else 0
    return classes, pathlist_of(_filtered(paths, keep), total, len(labels)), labels, ignored


_FILTER_ROWS = 65536  # rows filtered at a time: a Parquet-read column comes in chunks of up to 1M rows


def _filtered(paths, mask):
    """``pc.filter(paths, mask)`` ``_FILTER_ROWS`` rows at a time (each piece freed once read)."""
    import pyarrow.compute as pc

    start = 0
    for chunk in paths.chunks:
        for s in range(0, len(chunk), _FILTER_ROWS):
            piece = chunk.slice(s, _FILTER_ROWS)
            yield pc.filter(piece, mask.slice(start + s, len(piece)).combine_chunks())
        start += len(chunk)
