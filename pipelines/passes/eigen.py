"""Spreading the per-layer eigendecompositions over workers.

The cost of one layer's eigenbasis is dominated by two dense symmetric
eigendecompositions, ``O(n^3 + m^3)`` for ``A`` (n x n) and ``G`` (m x m). The
assignment is a pure function of the layer shapes and the worker count — no Ray —
so every worker computes the same plan without talking to the others.

Greedy LPT (longest processing time first): sort layers by cost, descending (ties
by name), give each to the currently least-loaded worker (ties by lowest rank).
LPT's makespan is at most ``4/3 - 1/(3W)`` of the optimum.
"""
from __future__ import annotations

from typing import Mapping, Sequence

__all__ = ["eigh_cost", "assign_layers", "loads"]


def eigh_cost(m: int, n: int) -> float:
    """Arithmetic cost model of one layer's eigenbasis: ``n^3 + m^3``."""
    return float(n) ** 3 + float(m) ** 3


def assign_layers(shapes: Mapping[str, tuple[int, int]], num_workers: int) -> dict[int, list[str]]:
    """Greedy layer-to-worker assignment on ``n^3 + m^3``.

    ``shapes``: layer name -> ``(m, n)`` (the ``W~`` shape). Returns
    ``rank -> [layer names]`` for ranks ``0..num_workers-1`` (possibly empty lists),
    each list in the order the layers appear in ``shapes``. Deterministic: depends
    only on the names, shapes and ``num_workers``.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    order = {name: i for i, name in enumerate(shapes)}
    jobs = sorted(shapes, key=lambda k: (-eigh_cost(*shapes[k]), order[k]))
    load = [0.0] * num_workers
    plan: dict[int, list[str]] = {r: [] for r in range(num_workers)}
    for name in jobs:
        r = min(range(num_workers), key=lambda i: (load[i], i))
        plan[r].append(name)
        load[r] += eigh_cost(*shapes[name])
    return {r: sorted(names, key=order.__getitem__) for r, names in plan.items()}


def loads(shapes: Mapping[str, tuple[int, int]], plan: Mapping[int, Sequence[str]]) -> dict[int, float]:
    """Total cost per worker under ``plan``."""
    return {r: sum(eigh_cost(*shapes[k]) for k in names) for r, names in plan.items()}
