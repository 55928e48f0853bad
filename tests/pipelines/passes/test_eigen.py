"""Layer-to-worker assignment for the distributed eigendecomposition (no Ray)."""
import itertools

import pytest
import torch
import torchvision

from laplace_core.curvature.layers import find_layers
from pipelines.passes.eigen import assign_layers, eigh_cost, loads


def _shapes(name: str) -> dict[str, tuple[int, int]]:
    with torch.device("meta"):
        model = torchvision.models.get_model(name, weights=None)
    _, infos, _ = find_layers(model)
    return {k: v.shape for k, v in infos.items()}


def test_resnet50_four_workers_balanced_and_deterministic():
    shapes = _shapes("resnet50")
    plan = assign_layers(shapes, 4)
    # every layer exactly once
    assigned = list(itertools.chain.from_iterable(plan.values()))
    assert sorted(assigned) == sorted(shapes)
    ld = loads(shapes, plan)
    mean = sum(ld.values()) / 4
    assert max(ld.values()) <= 1.5 * mean, ld
    # deterministic, and independent of dict insertion order of equal-cost ties
    assert assign_layers(shapes, 4) == plan
    assert assign_layers(dict(shapes), 4) == plan


def test_greedy_is_optimal_on_a_tiny_brute_force_case():
    shapes = {"a": (8, 9), "b": (7, 7), "c": (5, 6), "d": (4, 4), "e": (3, 3)}
    plan = assign_layers(shapes, 2)
    got = max(loads(shapes, plan).values())
    best = min(
        max(sum(eigh_cost(*shapes[k]) for k, s in zip(shapes, bits) if s == w) for w in (0, 1))
        for bits in itertools.product((0, 1), repeat=len(shapes))
    )
    # LPT bound: makespan <= (4/3 - 1/(3W)) * optimum
    assert got <= (4 / 3 - 1 / 6) * best + 1e-9


def test_more_workers_than_layers_and_bad_count():
    plan = assign_layers({"x": (2, 3)}, 3)
    assert plan == {0: ["x"], 1: [], 2: []}
    with pytest.raises(ValueError, match="num_workers"):
        assign_layers({"x": (2, 3)}, 0)
