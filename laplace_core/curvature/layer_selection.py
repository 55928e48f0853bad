"""Which curvature layers carry the posterior: ``layers = "all" | "last" | (names or globs)``.

One pure function, :func:`select_layers`, resolves a selection against the curvature
layer names of :func:`laplace_core.curvature.layers.find_layers` (model order), so that every pass
(pass 1, the EFB pass, the subnet pass) and every predictive sees the same set; the other
layers stay point estimates at the MAP and are reported as such (``excluded``).

* ``"all"``: every curvature layer (the default: nothing changes).
* ``"last"``: the last curvature layer in module order (``fc`` of a ResNet, the classifier
  head of most torchvision models): last-layer Laplace (Kristiadi et al. 2020; the
  laplace-torch default).
* a sequence of names or shell-style globs (:mod:`fnmatch`, case-sensitive): a layer is
  selected when a pattern matches its name or a module containing it (``"layer4"``
  selects every layer under ``layer4``; ``"features.*.conv"``, ``"fc"``). Every pattern
  must select at least one layer, else ``ValueError`` naming a few valid layer names.
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Sequence

__all__ = ["LAYER_SELECTIONS", "LayerSelectionError", "check_selection", "select_layers", "selection_label"]

LAYER_SELECTIONS = ("all", "last")
"""The named selections; anything else is a sequence of layer names or globs."""

class LayerSelectionError(ValueError):
    """A layer name or glob that matches no curvature layer of the model."""


def check_selection(layers) -> str | tuple[str, ...]:
    """``layers`` normalised (``"all"``, ``"last"`` or a non-empty tuple of non-empty strings);
    one-line ``ValueError`` otherwise."""
    if isinstance(layers, str):
        if layers in LAYER_SELECTIONS:
            return layers
        return (layers,)  # one name or glob
    if isinstance(layers, (list, tuple)) and layers and all(isinstance(p, str) and p for p in layers):
        return tuple(layers)
    raise ValueError(f"layers must be 'all', 'last' or a non-empty list of layer names or globs, got {layers!r}")


def _matches(name: str, pattern: str) -> bool:
    return fnmatchcase(name, pattern) or fnmatchcase(name, pattern + ".*")


def _examples(names: Sequence[str], k: int = 6) -> str:
    """A few valid names: the first three and the last three (deep models have hundreds)."""
    names = list(names)
    shown = names if len(names) <= k else names[: k // 2] + ["..."] + names[-(k // 2):]
    return ", ".join(shown) + f" ({len(names)} layers)"


def select_layers(names: Sequence[str], layers="all") -> tuple[str, ...]:
    """The selected curvature layer names, in the order of ``names`` (model order).

    ``names``: the curvature layer names (:func:`laplace_core.curvature.layers.find_layers`).
    :class:`LayerSelectionError` (a ``ValueError``; one line, with a few valid names) when a
    name or glob matches no layer.
    """
    sel = check_selection(layers)
    names = tuple(names)
    if sel == "all":
        return names
    if not names:
        raise ValueError("the model has no curvature layers to select from")
    if sel == "last":
        return names[-1:]
    unmatched = [p for p in sel if not any(_matches(n, p) for n in names)]
    if unmatched:
        raise LayerSelectionError(f"{', '.join(map(repr, unmatched))} "
                                  f"match{'es' if len(unmatched) == 1 else ''} no curvature layer; "
                                  f"valid names: {_examples(names)}")
    return tuple(n for n in names if any(_matches(n, p) for p in sel))


def selection_label(layers="all") -> str:
    """A short label for summaries and fingerprints: ``all``, ``last`` or ``a,b*``."""
    sel = check_selection(layers)
    return sel if isinstance(sel, str) else ",".join(sel)
