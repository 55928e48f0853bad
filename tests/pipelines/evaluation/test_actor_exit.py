"""An actor's exit raised inside a garbage-collection callback (Ray's SIGTERM handler raises
``SystemExit`` wherever the process is) leaves no traceback in the job's log; other exceptions
Python cannot raise there are still printed."""
from __future__ import annotations

import subprocess
import sys

_PROBE = r"""
import gc, sys, weakref
from pipelines.evaluation.actors import quiet_exit_in_callbacks
class Box: pass
def fire(exc):
    b = Box(); b.self = b  # a cycle: freed by the collection, which runs the callback
    weakref.finalize(b, lambda: (_ for _ in ()).throw(exc))
    del b
    gc.collect()
if sys.argv[1] == "quiet":
    quiet_exit_in_callbacks()
    quiet_exit_in_callbacks()  # twice: one hook, not a chain
fire(SystemExit(1))
fire(ValueError("still printed"))
print("alive")
"""


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=60,
                          check=True)


def test_system_exit_in_a_collection_callback_is_quiet_and_other_errors_are_not():
    before, after = _run("default"), _run("quiet")
    assert "SystemExit" in before.stderr and "ValueError: still printed" in before.stderr  # Python's default
    assert "SystemExit" not in after.stderr and "Traceback" in after.stderr
    assert "ValueError: still printed" in after.stderr and after.stdout.strip() == "alive"
