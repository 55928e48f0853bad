"""pipelines.malloc: the settings take effect (a freed batch's buffers stay in the process for
the next batch instead of going back to the kernel), can be switched off, and reject bad values.
Measured by RSS, not by page-fault counts: with transparent huge pages those vary from run to
run. Each check that calls ``mallopt`` runs in a fresh subprocess so this test process's
allocator is left as it was."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipelines.malloc import ENV_SWITCH, tune_malloc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_PROBE = r"""
import json, sys, torch
from pipelines.malloc import tune_malloc
applied = tune_malloc()
torch.set_num_threads(1)

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

# a "batch" of 12 float32 buffers of ~6 MiB, all freed at its end; each batch's buffers are a
# little larger than the last one's, as when input sizes vary, so glibc's adaptive mmap
# threshold (raised to the largest block freed so far) never catches up with them
drops = []
for b in range(4):
    n = (6 * 2**20 + b * 2**18) // 4
    ts = [torch.empty(n).fill_(1.0) for _ in range(12)]
    peak = rss_mib()
    del ts
    drops.append(peak - rss_mib())  # MiB the process gave back to the kernel when the batch ended
print(json.dumps({"applied": applied, "drops": drops}))
"""

BATCH_MIB = 12 * 6  # at least


def _probe(switch: str | None) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop(ENV_SWITCH, None)
    if switch is not None:
        env[ENV_SWITCH] = switch
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc-only")
def test_reused_large_buffers_stop_page_faulting():
    off = _probe("0")
    on = _probe(None)
    assert off["applied"] is None
    assert on["applied"] == {"mmap_threshold": 32 * 2**20, "trim_threshold": 512 * 2**20}
    # glibc's defaults give each batch's ~72 MiB back to the kernel when it is freed (each
    # buffer is above the adaptive mmap threshold: unmapped), so the next batch faults it in again
    assert min(off["drops"]) > 0.8 * BATCH_MIB, off
    # tuned: the memory stays in the process and the next batch reuses it (measured: 0 MiB)
    assert max(on["drops"]) < 0.1 * BATCH_MIB, on


def test_bad_values_are_rejected_before_mallopt():
    for bad in (0, -1, 2**31, 1.5, True):
        with pytest.raises(ValueError, match="must be an int"):
            tune_malloc(mmap_threshold=bad)
        with pytest.raises(ValueError, match="must be an int"):
            tune_malloc(trim_threshold=bad)


_TRIM_PROBE = r"""
import json, torch
from pipelines.malloc import release_free_memory, tune_malloc
tune_malloc()  # freed memory is kept (up to 512 MiB at the heap's top): what a Train worker does

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

keep = []
ts = []
for i in range(48):  # 48 buffers of 2 MiB from the heap, every other one kept: freed holes inside the heap
    ts.append(torch.empty(2**19).fill_(1.0))
    if i % 2:
        keep.append(ts[-1])
del ts
before = rss_mib()
done = release_free_memory()
print(json.dumps({"done": done, "dropped": before - rss_mib(), "kept_ok": all(float(t[0]) == 1.0 for t in keep)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc-only")
def test_release_free_memory_returns_the_holes_of_the_heap():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop(ENV_SWITCH, None)
    out = subprocess.run([sys.executable, "-c", _TRIM_PROBE], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # 24 freed 2 MiB buffers between live ones (48 MiB): free() returns none of it, the trim most
    assert got["done"] and got["dropped"] > 30 and got["kept_ok"], got


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps and madvise: Linux")
def test_object_store_pages_leave_the_rss_and_keep_their_contents(tmp_path):
    """A shared mapping of a file named like Ray's object store: after
    ``release_object_store_pages`` its pages no longer count in this process's RSS (RssShmem),
    and reading them again gives the same bytes; a private mapping is left alone."""
    import mmap

    from pipelines.malloc import release_object_store_pages

    def shmem_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssShmem"))

    path = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    name = os.path.join(path, f"plasma-infoform-test-{os.getpid()}")
    size = 16 * 2**20
    fd = os.open(name, os.O_CREAT | os.O_RDWR)
    try:
        os.ftruncate(fd, size)
        shared = mmap.mmap(fd, size, mmap.MAP_SHARED)
        private = mmap.mmap(-1, 2**20, mmap.MAP_PRIVATE)
        for i in range(0, size, 4096):
            shared[i] = i // 4096 % 251
        private[0] = 9
        before = shmem_kib()
        assert release_object_store_pages() >= size
        if path == "/dev/shm":
            assert before - shmem_kib() >= 0.9 * size / 1024
        assert all(shared[i] == i // 4096 % 251 for i in range(0, size, 4096)) and private[0] == 9
        shared.close()
        private.close()
    finally:
        os.close(fd)
        os.unlink(name)
