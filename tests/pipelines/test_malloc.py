"""pipelines.malloc: the settings take effect (no page faults for reused large buffers), can be
switched off, and reject bad values. Each check that calls ``mallopt`` runs in a fresh
subprocess so this test process's allocator is left as it was."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipelines.malloc import ENV_SWITCH, tune_malloc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PROBE = r"""
import json, resource, sys, torch
from pipelines.malloc import tune_malloc
applied = tune_malloc()
torch.set_num_threads(1)
n = 6 * 2**20 // 4  # a "batch" of 12 buffers of 6 MiB (float32), all freed at its end
for _ in range(2):  # first uses: the heap (or the mappings) are faulted in
    ts = [torch.empty(n).fill_(1.0) for _ in range(12)]; del ts
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    ts = [torch.empty(n).fill_(1.0) for _ in range(12)]; del ts
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0}))
"""

PAGES_PER_BATCH = 12 * 6 * 2**20 // 4096  # 18432 pages of 4 KiB


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
    # glibc's defaults give the freed 72 MiB back to the kernel after every batch (trimmed or
    # unmapped), so every batch faults all its pages in again (measured: 20 x 18400)
    assert off["faults"] > 10 * PAGES_PER_BATCH, off
    # tuned: the buffers come back from the heap, already resident (measured: 0)
    assert on["faults"] < PAGES_PER_BATCH // 10, on


def test_bad_values_are_rejected_before_mallopt():
    for bad in (0, -1, 2**31, 1.5, True):
        with pytest.raises(ValueError, match="must be an int"):
            tune_malloc(mmap_threshold=bad)
        with pytest.raises(ValueError, match="must be an int"):
            tune_malloc(trim_threshold=bad)
