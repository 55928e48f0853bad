"""The search's progress lines: a Ray Tune callback on the driver that writes, at least every
``log_every_s`` and once at the end, the trials finished, the images scored against the most the
search can score (every trial on every chunk; ASHA stops most trials early, so the ETA is an
upper bound), images/s and the ETA."""
from __future__ import annotations

import time
from typing import Any

from ray import tune

__all__ = ["SearchProgress", "total_line"]


class SearchProgress(tune.Callback):
    """``[search] trials a/b done, images scored x/y, r images/s, ETA s``; with a ``label`` (one
    of several experiments, e.g. ``kfac, glm``) ``[search] kfac, glm: trials ...``."""

    def __init__(self, num_trials: int, images: int, every_s: float, end_line: bool = True, label: str = ""):
        self.num_trials, self.images, self.every_s = int(num_trials), int(images), float(every_s)
        self.label = f"{label}: " if label else ""
        self.end_line = end_line  # False: one of several experiments, whose caller writes the total (total_line)
        self.scored: dict[str, int] = {}
        self.done: set[str] = set()
        self.t0 = self.last = time.perf_counter()

    def line(self, now: float) -> str:
        total = self.num_trials * self.images
        n = sum(self.scored.values())
        rate = n / max(now - self.t0, 1e-9)
        eta = "?" if not n else f"<= {max(total - n, 0) / max(rate, 1e-9):.0f} s"
        return (f"[search] {self.label}trials {len(self.done)}/{self.num_trials} done, images scored {n}/{total}, "
                f"{rate:.2f} images/s, ETA {eta}")

    def _maybe(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and not self.done and not any(self.scored.values()):
            return  # nothing to say yet (beside other experiments: a line of zeros and "ETA ?" each)
        if force or now - self.last >= self.every_s:
            self.last = now
            print(self.line(now), flush=True)

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        self.scored[trial.trial_id] = int(result.get("images", 0) or 0)
        if result.get("done"):
            self.done.add(trial.trial_id)
        self._maybe()

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.done.add(trial.trial_id)
        self._maybe()

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        self._maybe()  # the controller's loop: a line also while no trial reports (a long chunk)

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        if self.end_line:
            total_line(len(self.done), self.num_trials, sum(self.scored.values()), time.perf_counter() - self.t0)


def total_line(done: int, num_trials: int, images: int, seconds: float, experiments: int = 1) -> None:
    """``[search] a/b trials done, x images scored in s s, r images/s`` (``in e experiments`` when several)."""
    where = f" in {experiments} experiments" if experiments > 1 else ""
    print(f"[search] {done}/{num_trials} trials done{where}, {images} images scored in {seconds:.1f} s, "
          f"{images / max(seconds, 1e-9):.2f} images/s", flush=True)
