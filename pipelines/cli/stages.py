"""Run-or-skip bookkeeping of a run's stages: the stage marker is the commit point.

A stage whose marker exists with the same fingerprint (a hash of every setting and input
that shapes its result) is skipped and its stored summary reused; one made with other
settings is refused in one line (a new ``--output`` or ``--force <stage>``); a stage that is
not requested reuses an earlier result if there is one. The marker is written last, after
every artifact of the stage (docs/design.md §4).
"""
from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Callable

from pipelines.config.schema import RunConfig
from pipelines.console import log
from pipelines.errors import PreflightError, StageError, memory_line
from pipelines.storage.store import RunStore

__all__ = ["log", "fingerprint", "Stages", "DRIVER_ONLY_STAGES"]

#: What to run fewer of per node when Ray's memory monitor kills a stage's workers.
_FEWER = {"curvature": "fewer curvature workers (curvature.num_workers)",
          "search": "fewer search trials at once (search.concurrent_trials, else evaluate.num_actors)", "evaluate": "fewer actors (evaluate.num_actors)"}


def fingerprint(obj: Any) -> str:
    """A short stable hash of a JSON-able settings tree."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


#: Stages that run in the driver alone (the report reads the stored results and renders them): a
#: run of nothing else (``--stages report``, ``--force report``) neither starts nor joins a cluster.
DRIVER_ONLY_STAGES = frozenset({"report"})


class Stages:
    """Run-or-skip bookkeeping for one output folder (``store``'s); ``results`` holds each stage's summary."""

    def __init__(self, cfg: RunConfig, store: RunStore, ensure_ray: Callable[[], None]):
        self.cfg = cfg
        self.output = store.output
        self.store = store
        self.ensure_ray = ensure_ray
        self.results: dict[str, Any] = {}

    def run(self, stage: str, fp_obj: Any, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        uri = self.store.stage_marker_uri(stage)
        fp = fingerprint(fp_obj)
        if stage not in self.cfg.stages:
            if self.store.exists(uri):
                self.results[stage] = self.store.read_json(uri)["summary"]
                return self.results[stage]
            log(f"stage {stage}: not requested (--stages) and no earlier result")
            return None
        if self.store.exists(uri) and stage not in self.cfg.force:
            marker = self.store.read_json(uri)
            if marker.get("fingerprint") != fp:
                raise PreflightError(  # one line, exit 2: a user's choice to make, not a traceback
                    f"{self.output} already holds a {stage} result made with other settings; "
                    f"use a new --output or --force {stage} (and the stages after it)"
                )
            log(f"stage {stage}: done earlier, skipped ({uri})")
            self.results[stage] = marker["summary"]
            return marker["summary"]
        if stage not in DRIVER_ONLY_STAGES:
            self.ensure_ray()  # connects and checks the cluster's shape before the stage starts
        log(f"stage {stage}: running")
        t0 = time.perf_counter()
        try:
            summary = fn()
        except Exception as e:  # noqa: BLE001 - Ray's memory monitor's kill, in one line; anything else as it was
            line = memory_line(e)
            if line is None:
                raise
            fewer = _FEWER.get(stage, "fewer Ray workers per node")
            raise StageError(f"stage {stage}: {line}; give the nodes more memory or run {fewer}; the finished stages "
                             "are kept and a re-submitted job starts at this one") from None
        summary = {**summary, "seconds": time.perf_counter() - t0}
        self.store.write_json_atomic(uri, {"stage": stage, "fingerprint": fp, "summary": summary})
        log(f"stage {stage}: finished in {summary['seconds']:.1f} s")
        self.results[stage] = summary
        return summary
