"""The posterior stage: build and store the posteriors of a curvature run (driver side, no Ray needed).

``build_posteriors(store, methods, ...)`` is the stage: it reads what the curvature
stage left (``stats/reduced``, ``stats/eigenbasis``, and for ``subnet`` the subnet pass's
``stats/subnet``) and calls ``build_and_save``.

``build_and_save(stats, basis, methods, rank, store)`` calls
:func:`laplace_core.build_posterior` once per requested method with the reduced
statistics and the eigenbasis the EFB pass used, and writes each posterior to
``<output>/posterior/<method>/`` of the run's store (safetensors + JSON manifest, via
``Posterior.save``); ``subnet`` is built from the subnet pass's artifact
(:mod:`pipelines.passes.subnet`). It returns a JSON-able summary per method: numbers stored
(Table 3 counting), clipped ``D`` entries (Lemma 3), clamped factor eigenvalues,
build and save seconds and the artifact URI.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

from laplace_core.basis.eigenbasis import Eigenbasis
from laplace_core.posteriors.build import build_posterior, resolve_method
from laplace_core.curvature.statistics import CurvatureStatistics

from pipelines.storage import layout
from pipelines.passes.curvature import BASIS_METHODS, EFB_METHODS
from pipelines.passes.eigen import load_eigenbasis
from pipelines.storage.store import RunStore
from pipelines.passes.subnet import load_subnet_fisher

__all__ = ["EFB_METHODS", "BASIS_METHODS", "posterior_uri", "build_and_save", "build_posteriors"]


posterior_uri = layout.posterior_uri


def build_and_save(
    stats: CurvatureStatistics,
    basis: Eigenbasis | None,
    methods: Sequence[str],
    rank: int | None,
    store: RunStore,
    *,
    n_data: float | None = None,
    prior_precision: float = 1.0,
) -> dict[str, dict[str, Any]]:
    """Build every method of ``methods`` and save it under ``<output>/posterior/<method>/`` of ``store``.

    ``rank`` is applied to ``inf`` only (the other methods have no rank). ``subnet`` reads
    the ``S x S`` Fisher sum and masks of the subnet pass from ``<output>/stats/subnet``
    (:func:`pipelines.passes.subnet.run_subnet_pass`; prior ``τ S / D_total``). Returns
    ``method -> {"num_stored", "clipped_D", "clamped_eigenvalues", "build_s", "save_s", "uri"}``.
    Unknown method names raise ``ValueError`` before anything is built.
    """
    names = [resolve_method(m) for m in methods]
    if any(m in BASIS_METHODS for m in names) and basis is None:
        raise ValueError(f"methods {sorted(set(names) & BASIS_METHODS)} need the run's eigenbasis; got basis=None")
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        t0 = time.perf_counter()
        subnet_fisher = None
        if name == "subnet":  # the S x S Fisher of the subnet pass (pipelines.passes.subnet)
            F_sum, count, masks, _ = load_subnet_fisher(store.subnet_uri(), store)
            subnet_fisher = (F_sum, count, masks)
        post = build_posterior(
            stats,
            name,
            rank=rank if name == "inf" else None,
            n_data=n_data,
            prior_precision=prior_precision,
            basis=basis if name in BASIS_METHODS else None,
            subnet_fisher=subnet_fisher,
        )
        t1 = time.perf_counter()
        uri = store.posterior_uri(name)
        refs = shared_with_basis(post, basis) if name in BASIS_METHODS else None
        post.save(uri, store.fsspec_options(uri), refs=refs)
        t2 = time.perf_counter()
        out[name] = {
            "num_stored": int(post.num_stored()),
            "clipped_D": int(post.info.get("clipped_D", 0)),
            "clamped_eigenvalues": int(post.info.get("clamped_eigenvalues", 0)),
            "build_s": t1 - t0,
            "save_s": t2 - t1,
            "uri": uri,
        }
        if name == "subnet":
            out[name].update({k: post.info[k] for k in ("subnet_size", "d_total", "prior_scale") if k in post.info})
    return out


#: where a posterior's shared eigenvectors live, relative to its artifact (<output>/posterior/<method>/)
BASIS_FROM_POSTERIOR = "../../stats/eigenbasis"


def shared_with_basis(post, basis: Eigenbasis | None) -> dict[str, Any] | None:
    """``refs`` for :meth:`Posterior.save`: the posterior's tensors that are bit-equal to the
    run's saved eigenbasis (``<layer>/U_A``, ``<layer>/U_G`` of ``kfac`` and ``efb``), stored once
    in ``stats/eigenbasis`` and referenced from the posterior; None when nothing is shared."""
    if basis is None:
        return None
    import torch

    tensors = post.state_dict()["tensors"]
    shared = {}
    for k, b in basis.layers.items():
        for part, t in (("U_A", b.U_A), ("U_G", b.U_G)):
            name = f"{k}/{part}"
            mine = tensors.get(name)
            if mine is not None and mine.dtype == t.dtype and mine.shape == t.shape and torch.equal(mine.cpu(), t.cpu()):
                shared[name] = name
    return {"uri": BASIS_FROM_POSTERIOR, "tensors": shared} if shared else None


def build_posteriors(
    store: RunStore,
    methods: Sequence[str],
    rank: int | None,
    *,
    n_data: float | None = None,
    prior_precision: float = 1.0,
) -> dict[str, dict[str, Any]]:
    """The posterior stage: load the reduced statistics (``<output>/stats/reduced``) and, when a
    method needs it, the eigenbasis (``<output>/stats/eigenbasis``) that the curvature stage
    wrote, and :func:`build_and_save` every method of ``methods``."""
    stats = CurvatureStatistics.load(store.reduced_uri(), store.fsspec_options(store.output))
    names = [resolve_method(m) for m in methods]
    basis = load_eigenbasis(store.basis_uri(), store) if any(m in BASIS_METHODS for m in names) else None
    return build_and_save(stats, basis, names, rank, store, n_data=n_data, prior_precision=prior_precision)


def inf_clipping_at(uri: str, n_data: float, prior_precision: float, store: RunStore = RunStore()) -> dict[str, Any]:
    """INF's clipping of ``N D + τ`` (see :mod:`laplace_core.posteriors.structures.inf`) for the saved
    posterior at ``uri`` under ``(N, τ)`` (e.g. the search's choice): ``clipped_D``,
    ``clipped_D_fraction``, ``diag_rel_error`` (the Fisher diagonal's relative error after
    clipping; 0 = Lemma 2's exact diagonal), ``n_data``, ``prior_precision``."""
    from laplace_core.posteriors.structures.base import load_posterior
    from laplace_core.posteriors.build import with_hyper

    post = with_hyper(load_posterior(uri, store.fsspec_options(uri)), n_data, prior_precision)
    info = post.info
    return {"clipped_D": int(info.get("clipped_D", 0)), "clipped_D_fraction": float(info.get("clipped_D_fraction", 0.0)),
            "diag_rel_error": float(info.get("diag_rel_error", 0.0)), "n_data": float(n_data),
            "prior_precision": float(prior_precision)}
