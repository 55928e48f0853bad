"""The job's own log line: one place, below every stage, so that any layer may write to it."""
from __future__ import annotations

import time

__all__ = ["log"]


def log(msg: str) -> None:
    """One line of the job's own log."""
    print(f"[infoform {time.strftime('%H:%M:%S')}] {msg}", flush=True)
