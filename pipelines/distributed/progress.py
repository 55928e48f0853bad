"""One progress/ETA logger for every distributed loop (the partitioned passes, and any
actor that counts images against a known total)."""
from __future__ import annotations

import sys
import threading
import time

__all__ = ["Progress", "say"]


def say(line: str) -> None:
    """One log line from a worker, written to its stdout once (Ray forwards it to the driver).
    Not ``print``: Ray Train's workers patch ``print`` to also log each line, which the
    driver then shows twice."""
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


class Progress:
    """A log line every ``every_s`` seconds (rank 0 only): images done, images/s, ETA.

    ``__call__(n)`` counts ``n`` images done by this process; the estimate of the whole
    group's progress is ``done_global + done_local * world`` (every rank is assumed to go
    at the same pace) until :meth:`partition_done` adds the exact global count. Between
    :meth:`start_ticker` and :meth:`finish` a daemon thread also writes the line when no line
    came for ``every_s`` (a long batch, a slow first read), so the log is never silent longer;
    :meth:`finish` writes the closing line with the exact count and the rate."""

    def __init__(self, label: str, total: int | None, world: int = 1, rank: int = 0, every_s: float = 10.0,
                 prefix: str = "curvature"):
        self.label, self.total, self.world, self.rank, self.every_s = label, total, world, rank, every_s
        self.prefix = prefix
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.done_local = 0
        self.done_global = 0

    def __call__(self, n: int) -> None:
        self.done_local += n
        now = time.perf_counter()
        if self.rank == 0 and now - self.last >= self.every_s:
            self.last = now
            say(self.line(now))

    def line(self, now: float | None = None) -> str:
        now = time.perf_counter() if now is None else now
        est = min(self.done_global + self.done_local * self.world, self.total or 1 << 62)
        rate = est / max(now - self.t0, 1e-9)
        eta = "?" if not self.total or not est else f"{max(self.total - est, 0) / max(rate, 1e-9):.0f} s"
        if not est:
            return (f"[{self.prefix}] {self.label}: 0/{self.total or '?'} images after {now - self.t0:.0f} s "
                    "(reading and computing the first batch)")
        approx = "~" if self.done_local and self.world > 1 else ""
        return (f"[{self.prefix}] {self.label}: {approx}{est}/{self.total or '?'} images, {rate:.2f} images/s, "
                f"ETA {eta}")

    def start_ticker(self) -> None:
        """Rank 0: a line at least every ``every_s`` seconds until :meth:`finish`."""
        if self.rank != 0 or getattr(self, "_stop", None) is not None:
            return
        self._stop = threading.Event()

        def tick() -> None:
            while not self._stop.wait(min(self.every_s, 1.0)):
                now = time.perf_counter()
                if now - self.last >= self.every_s:
                    self.last = now
                    say(self.line(now))

        threading.Thread(target=tick, name=f"progress-{self.prefix}", daemon=True).start()

    def finish(self, images: int | None = None) -> None:
        """Stop the ticker; rank 0 writes ``done/total images in s, images/s`` (``images``: the exact count)."""
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        if self.rank != 0:
            return
        now = time.perf_counter()
        n = images if images is not None else self.done_global + self.done_local * self.world
        dt = now - self.t0
        say(f"[{self.prefix}] {self.label}: {n}/{self.total if self.total is not None else n} images done in "
            f"{dt:.1f} s, {n / max(dt, 1e-9):.2f} images/s")

    def restart(self, now: float) -> None:
        """Start the rate's clock at ``now`` (the pass's own start, after whatever ran before)."""
        self.t0 = self.last = now

    def partition_done(self, rows_global: int) -> None:
        """Replace the local estimate by the exact global count of a reduced segment."""
        self.done_global += rows_global
        self.done_local = 0
