"""Explicit registry ``method name -> LayerPosterior class``.

Handed to :mod:`.base` when this package is imported (:func:`.base.register_structures`), so
that :meth:`~laplace_core.posteriors.structures.base.Posterior.from_state_dict` rebuilds layers from
their saved ``method`` tag without :mod:`.base` importing the structures built on it.
"""
from __future__ import annotations

from .base import LayerPosterior, register_structures
from .diag import DiagLayer
from .efb import EFBLayer, KronExactLayer
from .inf import InfLayer
from .kron import KronLayer

__all__ = ["LAYER_CLASSES", "layer_class", "POSTERIOR_CLASSES", "posterior_class"]

LAYER_CLASSES: dict[str, type[LayerPosterior]] = {
    "diag": DiagLayer,
    "kfac": KronLayer,
    "kfac_exact": KronExactLayer,
    "efb": EFBLayer,
    "inf": InfLayer,
}


def layer_class(method_name: str) -> type[LayerPosterior]:
    """The layer class for a registry name; ``ValueError`` listing the valid names otherwise."""
    try:
        return LAYER_CLASSES[str(method_name)]
    except KeyError:
        raise ValueError(
            f"unknown posterior structure {method_name!r}; valid: {', '.join(LAYER_CLASSES)}"
        ) from None


def _subnet_posterior():
    from .subnet import SubnetPosterior

    return SubnetPosterior


# Structures whose covariance couples layers are a Posterior subclass, rebuilt as a whole
# (method name -> zero-argument loader, resolved lazily to keep imports acyclic).
POSTERIOR_CLASSES = {"subnet": _subnet_posterior}


def posterior_class(method_name):
    """The :class:`~.base.Posterior` (sub)class that rebuilds a saved posterior of this method."""
    from .base import Posterior

    loader = POSTERIOR_CLASSES.get(str(method_name))
    return Posterior if loader is None else loader()


register_structures(layer_class, posterior_class)
