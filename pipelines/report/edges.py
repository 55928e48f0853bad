"""A chosen ``(N, τ)`` on the edge of its search range: the optimum may lie outside it.

:func:`edge_notes` gives one line per method whose chosen ``log10 N`` or ``log10 τ`` lies
within :data:`EDGE_FRACTION` of the range's width from one of its ends, with a range that would
include it with room (the range widened by its width on that side). The run's log and the report
print the same lines. A method whose choice is the MAP-limit configuration (``log10 τ`` at the
search's ``map_limit_log10_tau``, outside the range by design) gets none: its mark against MAP
says what that choice means.
"""
from __future__ import annotations

from typing import Any, Mapping

from pipelines.report.methods import method_label

__all__ = ["EDGE_FRACTION", "search_ranges", "edge_notes"]

EDGE_FRACTION = 0.05
_NAMES = {"log10_n": "log10 N", "log10_tau": "log10 τ"}


def search_ranges(search_cfg: Mapping[str, Any] | None, method: str) -> dict[str, tuple[float, float]]:
    """``{"log10_n": (lo, hi), "log10_tau": (lo, hi)}`` searched for ``method``, from the run
    config's ``search`` section (its ``method_ranges`` entry over the common ranges; under TPE the
    τ range reaches ``map_limit_log10_tau``, as the search draws it)."""
    cfg = search_cfg or {}
    out = {k: tuple(float(v) for v in cfg[k]) for k in _NAMES if isinstance(cfg.get(k), (list, tuple))}
    for r in cfg.get("method_ranges") or ():
        if isinstance(r, Mapping) and r.get("method") == method:
            out.update({k: tuple(float(v) for v in r[k]) for k in _NAMES if r.get(k) is not None})
    limit = cfg.get("map_limit_log10_tau")
    if cfg.get("algorithm") == "tpe" and isinstance(limit, (int, float)) and "log10_tau" in out:
        lo, hi = out["log10_tau"]  # TPE's τ range reaches the MAP limit (pipelines.evaluation.tune.tpe_space)
        out["log10_tau"] = (lo, max(hi, float(limit)))
    return out  # type: ignore[return-value]


def edge_notes(chosen: Mapping[str, Any] | None, search_cfg: Mapping[str, Any] | None) -> list[str]:
    """One line per (method, coordinate) whose chosen value is on an edge of its range."""
    out, limit = [], (search_cfg or {}).get("map_limit_log10_tau")
    for method, c in (chosen or {}).items():
        if not isinstance(c, Mapping) or (limit is not None and c.get("log10_tau") == limit):
            continue
        for key, (lo, hi) in search_ranges(search_cfg, method).items():
            v, width = c.get(key), hi - lo
            if not isinstance(v, (int, float)) or width <= 0:
                continue
            if v >= hi - EDGE_FRACTION * width:
                side, wider = "upper", (lo, hi + width)
            elif v <= lo + EDGE_FRACTION * width:
                side, wider = "lower", (lo - width, hi)
            else:
                continue
            out.append(f"{method_label(method)}: the chosen {_NAMES[key]} = {v:.2f} is on the {side} edge of its "
                       f"search range [{lo:.2f}, {hi:.2f}]; the optimum may lie outside: search "
                       f"{key}: [{wider[0]:.2f}, {wider[1]:.2f}] to include it")
    return out
