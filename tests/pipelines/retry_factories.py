"""Model factories for the retry tests (imported by Ray workers: this folder is on their
PYTHONPATH). Each call appends a line to :data:`CALLS`, so a test counts the attempts."""
from __future__ import annotations

import os
import tempfile

CALLS = os.path.join(tempfile.gettempdir(), f"infoform-retry-calls-{os.getuid()}.log")


def raises_value_error(num_classes: int | None = None):
    with open(CALLS, "a") as f:
        f.write(f"{os.getpid()}\n")
    raise ValueError("this model's config names a layer 'head9' that does not exist")


def calls() -> int:
    try:
        with open(CALLS) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0
