"""Shared helpers of the paper reproductions: output folder, JSON + Markdown writing,
``mean ± std`` formatting."""
from __future__ import annotations

import json
import math
import platform
from pathlib import Path
from typing import Any, Sequence

import torch

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "benchmarks" / "paper" / "results"


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and population standard deviation (as the paper's ``±``)."""
    v = [float(x) for x in values]
    m = sum(v) / len(v)
    return m, math.sqrt(sum((x - m) ** 2 for x in v) / len(v))


def fmt(values: Sequence[float], digits: int = 3) -> str:
    m, s = mean_std(values)
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def machine() -> dict[str, Any]:
    return {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}


def write(out: Path, stem: str, payload: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """``<out>/<stem>.json`` and ``<out>/<stem>.md``; returns both paths."""
    out.mkdir(parents=True, exist_ok=True)
    j, m = out / f"{stem}.json", out / f"{stem}.md"
    j.write_text(json.dumps(payload, indent=2, sort_keys=True, default=float) + "\n")
    m.write_text(markdown.rstrip() + "\n")
    return j, m
