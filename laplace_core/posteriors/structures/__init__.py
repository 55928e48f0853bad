"""Posterior structures, one module each: diag, kron (KFAC), efb (EFB and exact-prior
KFAC), inf (sparse information form). See :mod:`.base` for the shared interface."""
from .base import LayerPosterior, Posterior, unvec, vec
from .diag import DiagLayer
from .efb import EFBLayer, EigenDiagLayer, KronExactLayer
from .inf import MAX_L, InfLayer, diagonal_correction
from .kron import KronLayer
from .registry import LAYER_CLASSES, layer_class

__all__ = [
    "LayerPosterior", "Posterior", "vec", "unvec",
    "DiagLayer", "KronLayer", "EigenDiagLayer", "EFBLayer", "KronExactLayer",
    "InfLayer", "diagonal_correction", "MAX_L",
    "LAYER_CLASSES", "layer_class",
]
