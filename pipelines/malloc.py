"""glibc ``malloc`` settings for the compute processes (Ray Train workers, evaluation actors).

Why: with glibc's defaults a CPU tensor above the dynamic ``mmap`` threshold (128 KiB at
start, raised to the size of each mapped block freed, at most 32 MiB) is a fresh ``mmap`` and
its ``free`` an ``munmap``, and a free heap top above twice that threshold is returned to the
kernel. A curvature or evaluation loop allocates and frees a batch's worth of activation and
gradient buffers every batch, so every batch page-faults those pages in again and the kernel
zeroes them: measured on the demo CNN (64x64, one thread) 190k-500k minor faults and 7-18 % of
the pass in system time. With the settings below the buffers are reused from the heap: ~0
faults, ~0 system time, the same peak RSS (``benchmarks/RESULTS.md``, "malloc").
Blocks above 32 MiB keep glibc's default (mapped per use): a fixed higher threshold let
2 MiB-aligned 48 MiB tensors fragment the heap (+336 MiB RSS in a probe).

``tune_malloc`` sets ``M_MMAP_THRESHOLD`` (allocations below it come from the heap and are
reused; setting it also switches off glibc's dynamic threshold) and ``M_TRIM_THRESHOLD``
(freed memory at the heap top is kept up to this much) with ``mallopt(3)``. It affects only
the calling process, from the next allocation on. The cost: freed memory up to the trim
threshold stays in the process (RSS does not fall back after a peak). It does nothing off
glibc (macOS, musl), and nothing when ``INFOFORM_MALLOC_TUNING=0``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

MMAP_THRESHOLD = 32 * 2**20  # bytes: below this, allocations come from (and return to) the heap
TRIM_THRESHOLD = 512 * 2**20  # bytes of free heap top kept before returning memory to the kernel
ENV_SWITCH = "INFOFORM_MALLOC_TUNING"

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # only glibc has it (musl does not)
        libc.mallopt
    except (OSError, AttributeError):
        return None
    return libc


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> dict[str, int] | None:
    """Apply the settings to this process; returns ``{"mmap_threshold": .., "trim_threshold": ..}``
    as applied, or ``None`` when not applied (not glibc, switched off by ``INFOFORM_MALLOC_TUNING=0``,
    or ``mallopt`` refused a value)."""
    for name, v in (("mmap_threshold", mmap_threshold), ("trim_threshold", trim_threshold)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 2**31:
            raise ValueError(f"{name} must be an int in (0, 2^31) bytes, got {v!r}")
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    libc = _glibc()
    if libc is None:
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    if libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) != 1 or libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold) != 1:
        return None
    return {"mmap_threshold": mmap_threshold, "trim_threshold": trim_threshold}


def release_free_memory() -> bool:
    """Give the free pages of every glibc heap back to the kernel (``malloc_trim(0)``), also those
    inside a heap, which ``free`` never returns (it only shrinks a heap's top beyond
    ``M_TRIM_THRESHOLD``). For the end of a phase whose large temporaries are gone: the memory
    stays counted in the process's RSS otherwise, until later allocations of the same allocator
    happen to reuse it. Costs a walk over the free chunks (milliseconds). ``True`` when glibc
    returned memory; ``False`` when it had none to return or this is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return bool(libc.malloc_trim(0))


_MADV_DONTNEED = 4  # <sys/mman.h> (Linux)


def release_object_store_pages(marker: str = "plasma") -> int:
    """Drop this process's page-table entries of the Ray object store's shared memory (every
    *shared* mapping of a file whose name contains ``marker``) with ``madvise(MADV_DONTNEED)``.

    Why: a process maps the whole object store and every page it ever read or wrote there stays
    counted in its resident set (``RssShmem``), also after the object on it is freed; as blocks
    of later partitions land on other pages, a Ray Train worker's RSS grows with the rows it
    read up to the store's size (measured: +2 MiB a partition of 10,000 rows a rank at 16x16,
    benchmarks/RESULTS.md, issue 29). The pages themselves belong to the store: for a shared file
    mapping ``MADV_DONTNEED`` discards nothing (a later access maps the same page again, with
    its current contents), so objects still in use, also those of a pipeline running beside,
    are read as before. Private mappings are never touched. Returns the bytes of the mappings
    advised (0 off Linux, or when no such mapping is found)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        with open("/proc/self/maps") as f:
            spans = [line.split(maxsplit=5) for line in f]
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    done = 0
    for span in spans:
        if len(span) < 6 or marker not in span[5] or span[1][3:4] != "s":
            continue
        lo, hi = (int(x, 16) for x in span[0].split("-"))
        if libc.madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
            done += hi - lo
    return done
