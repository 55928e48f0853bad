"""The data counts of a run in one shape for ``run.json``, the report and the log: files not
indexed as images (per split) and images that failed to decode (per split and per pass).

``skipped_images`` is ``{split: {"count", "examples", "passes"}}``: the training split's count is
the most any one pass skipped (every pass reads the same files, so the same undecodable ones;
``passes`` gives each pass's own count), the held-out splits' counts are what the search and the
evaluation skipped. The report sums the splits, so each bad file is counted once per split.
"""
from __future__ import annotations

from typing import Any, Mapping

__all__ = ["skipped_images", "ignored_lines", "skipped_lines"]

#: examples kept per split
MAX_EXAMPLES = 3


def _report(d: Any) -> dict[str, Any] | None:
    if not isinstance(d, Mapping) or "count" not in d:
        return None
    return {"count": int(d["count"]), "examples": list(d.get("examples") or [])}


def _train(curv: Mapping[str, Any]) -> dict[str, Any] | None:
    passes: dict[str, int] = {}
    examples: list[Any] = []
    for name, rec in (curv.get("skipped") or {}).items():
        rep = _report((rec or {}).get("skipped")) if isinstance(rec, Mapping) else None
        if rep is None:
            continue
        passes[name] = rep["count"]
        examples += [e for e in rep["examples"] if e not in examples]
    if not passes:
        return None
    return {"count": max(passes.values()), "examples": examples[:MAX_EXAMPLES], "passes": passes}


def skipped_images(results: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per split, the images that failed to decode, from the stage summaries (``results``)."""
    out: dict[str, dict[str, Any]] = {}
    train = _train(results.get("curvature") or {})
    if train is not None:
        out["train"] = train
    srch = _report(((results.get("search") or {}).get("skipped")))
    if srch is not None:
        out["search"] = {**srch, "examples": srch["examples"][:MAX_EXAMPLES], "passes": {"search": srch["count"]}}
    for split, rep in ((results.get("evaluate") or {}).get("skipped") or {}).items():
        r = _report(rep)
        if r is not None:
            out[split] = {**r, "examples": r["examples"][:MAX_EXAMPLES], "passes": {"evaluate": r["count"]}}
    return out


def _names(examples: list[Any]) -> str:
    return ", ".join(str(e.get("path", e)) + (f" ({e['reason']})" if e.get("reason") else "")
                     if isinstance(e, Mapping) else str(e) for e in examples[:MAX_EXAMPLES])


def ignored_lines(ignored: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One log line per split with files that are not indexed as images (none when there are none)."""
    return [f"data: {split}: {d['count']} file(s) ignored, not an image suffix (data.extensions adds suffixes): "
            f"{_names(d['examples'])}{', ...' if d['count'] > len(d['examples']) else ''}"
            for split, d in ignored.items() if d.get("count")]


def skipped_lines(skipped: Mapping[str, Mapping[str, Any]], splits: tuple[str, ...] | None = None) -> list[str]:
    """One log line per split (of ``splits``, default all) with images that failed to decode."""
    out = []
    for split, d in skipped.items():
        if (splits is not None and split not in splits) or not d.get("count"):
            continue
        per = "; ".join(f"{p} {n}" for p, n in d.get("passes", {}).items())
        out.append(f"data: {split}: {d['count']} image(s) could not be decoded and were skipped ({per}): "
                   f"{_names(d['examples'])}{', ...' if d['count'] > len(d['examples']) else ''}")
    return out
