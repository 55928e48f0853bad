"""laplace_core: Laplace posteriors for image classifiers in the sparse information form.

Pure torch; never imports Ray (docs/design.md §2). Public API (docs/design.md §3)::

    import laplace_core as lc
    stats = lc.collect_statistics(model, batches, fisher="mc", mc_samples=1, generator=g)
    basis = lc.eigenbasis(stats)
    stats = lc.collect_statistics(model, batches, generator=g, basis=basis)   # + EFB sums
    post  = lc.build_posterior(stats, method="inf", rank=100, prior_precision=1.0)
    deltas = post.sample(1, g)          # layer name -> [1, m, n] perturbation of W~ = [W, b]
    post.save("runs/x/posterior/inf"); post2 = lc.load_posterior("runs/x/posterior/inf")

The subpackages follow the data, in this order (as ``pipelines/`` follows the stages):

1. :mod:`.curvature`: model + batches -> :class:`CurvatureStatistics` (which layers, the
   hooks that tap them, the batch loop, likelihoods and label draws, the per-layer sums);
2. :mod:`.basis`: statistics -> the Kronecker factors' :class:`Eigenbasis`;
3. :mod:`.posteriors`: statistics (+ basis) -> a :class:`Posterior` (the structures diag,
   KFAC, EFB, INF, subnet; the method registry; Algorithm 1; sizes);
4. :mod:`.predictive`: model + posterior + inputs -> predictive probabilities (MC sampling,
   GLM, last-layer closed forms);
5. :mod:`.metrics`: probabilities + labels -> mergeable metrics.

:mod:`.io` (safetensors + JSON artifacts) and :mod:`.names` (the names and numbers a run
configuration is checked against, torch-free) serve every floor. A floor imports only from the
floors above it, :mod:`.io` and :mod:`.names`, with one loop in the flow: the EFB pass of
:mod:`.curvature.collect` takes the :mod:`.basis` back to sum in it.

Names are resolved lazily so that ``import laplace_core`` stays cheap.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "CurvatureStatistics": "curvature.statistics",
    "LayerStatistics": "curvature.statistics",
    "LayerInfo": "curvature.statistics",
    "find_layers": "curvature.layers",
    "perturbed": "curvature.layers",
    "collect_statistics": "curvature.collect",
    "Eigenbasis": "basis.eigenbasis",
    "LayerBasis": "basis.eigenbasis",
    "eigenbasis": "basis.eigenbasis",
    "build_posterior": "posteriors.build",
    "METHODS": "posteriors.build",
    "with_hyper": "posteriors.build",
    "Posterior": "posteriors.structures.base",
    "sparsify": "posteriors.sparsify",
    "load_posterior": "posteriors.structures.base",
    "save_tensors": "io",
    "load_tensors": "io",
    "MetricSuite": "metrics.suite",
    "MCPredictor": "predictive.monte_carlo",
    "mc_predict": "predictive.monte_carlo",
    "map_predict": "predictive.monte_carlo",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'laplace_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
