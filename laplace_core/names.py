"""The names and numbers the core accepts, written once and without torch.

A run configuration is checked against these before any tensor exists (``pipelines.config``
imports this module, not the modules that use the names, so that checking a configuration,
listing images or decoding them does not import torch). Each module that acts on a name
imports it from here:

- ``FISHER_TYPES``: :mod:`.curvature.likelihoods` (``mc``: labels drawn from the model;
  ``empirical``: the true labels);
- ``NORM_LAYER_MODES``: :mod:`.curvature.layers` (``map``: normalisation layers stay point
  estimates; ``diag``: curvature layers of kind ``"norm"``);
- ``PRECISION_NAMES``: :data:`.curvature.batch_loop.PRECISIONS` maps them to autocast dtypes;
- ``DTYPE_NAMES``: :data:`.curvature.batch_loop.DTYPES` maps them to torch dtypes;
- ``SUBNET_FISHER_TYPES``: :mod:`.curvature.subnet_fisher`; ``SELECTION_RULES``:
  :mod:`.posteriors.subnet`;
- ``DEFAULT_ECE_BINS``, ``ENTROPY_BINS``, ``ECE_STRATEGIES``: :mod:`.metrics.base`.

The method names are the method registry's (:func:`.posteriors.methods.method_names`), which is
torch-free too: its per-layer builders live apart, in :mod:`.posteriors.layer_builders`.
"""
from __future__ import annotations

__all__ = ["FISHER_TYPES", "NORM_LAYER_MODES", "PRECISION_NAMES", "DTYPE_NAMES", "SUBNET_FISHER_TYPES",
           "SELECTION_RULES", "DEFAULT_ECE_BINS", "ENTROPY_BINS", "ECE_STRATEGIES"]

FISHER_TYPES = ("mc", "empirical")
NORM_LAYER_MODES = ("map", "diag")
PRECISION_NAMES = ("fp32", "bf16", "fp16")
DTYPE_NAMES = ("float32", "float64")
SUBNET_FISHER_TYPES = ("mc", "empirical", "ggn")
SELECTION_RULES = ("wasserstein", "wasserstein_live", "random")
DEFAULT_ECE_BINS = 15
ENTROPY_BINS = 50
ECE_STRATEGIES = ("equal_width", "equal_mass")
