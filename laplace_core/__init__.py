"""laplace_core: Laplace posteriors for image classifiers in the sparse information form.

Pure torch; never imports Ray (docs/design.md §2). Public API (docs/design.md §3)::

    import laplace_core as lc
    stats = lc.collect_statistics(model, batches, fisher="mc", mc_samples=1, generator=g)
    basis = lc.eigenbasis(stats)
    stats = lc.collect_statistics(model, batches, generator=g, basis=basis)   # + EFB sums
    post  = lc.build_posterior(stats, method="inf", rank=100, prior_precision=1.0)
    deltas = post.sample(1, g)          # layer name -> [1, m, n] perturbation of W~ = [W, b]
    post.save("runs/x/posterior/inf"); post2 = lc.load_posterior("runs/x/posterior/inf")

Names are resolved lazily so that ``import laplace_core`` stays cheap.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Submodules that share a name with a public function are imported eagerly, so that
# the package attribute is the function, not the module (both are light).
from .eigenbasis import eigenbasis  # noqa: E402
from .sparsify import sparsify  # noqa: E402

_EXPORTS = {
    "CurvatureStatistics": "statistics",
    "LayerStatistics": "statistics",
    "LayerInfo": "statistics",
    "find_layers": "layers",
    "perturbed": "layers",
    "collect_statistics": "collect",
    "Eigenbasis": "eigenbasis",
    "LayerBasis": "eigenbasis",
    "eigenbasis": "eigenbasis",
    "build_posterior": "posterior",
    "METHODS": "posterior",
    "with_hyper": "posterior",
    "Posterior": "structures.base",
    "sparsify": "sparsify",
    "load_posterior": "structures.base",
    "save_tensors": "io",
    "load_tensors": "io",
    "MetricSuite": "metrics.suite",
    "MCPredictor": "predictive",
    "mc_predict": "predictive",
    "map_predict": "predictive",
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
