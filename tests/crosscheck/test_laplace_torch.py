"""Our KFAC factors against laplace-torch 0.3's ``KronLaplace`` (``hessian_structure="kron"``).

laplace-torch conventions (``laplace/curvature/curvlinops.py``, ``laplace/utils/matrix.py``;
summary in docs/conventions.md):

* Backend ``CurvlinopsEF`` (empirical Fisher; ``BackPackEF.kron`` raises NotImplementedError)
  runs curvlinops' ``KFACLinearOperator`` per batch with ``CrossEntropyLoss(reduction="sum")``,
  ``kfac_approx="expand"``, ``separate_weight_and_bias=True`` (curvlinops gives ``G_b`` and
  ``A_b / M_b`` per batch), then rescales the input factor by ``M_b / N`` (``N`` =
  ``len(dataset)``). Batches add factor-wise (``Kron.__add__``), so for any batching
  ``H_facs.kfacs`` holds ``[G, A_w / M]`` per weight and ``[G]`` per bias: the weight block is
  ``A_w/M ⊗ G = M (A_w/M ⊗ G/M)``, the KFAC of the *sum* loss over the data.
* Posterior precision: eigenvalues ``λ_A λ_G + δ`` (``damping=False``, default), our
  ``kfac_exact`` with ``N = M``, ``τ = δ``; laplace-torch's ``prior_precision`` is ``τ``.
"""
from __future__ import annotations

import pytest
import torch

laplace = pytest.importorskip("laplace", reason="laplace-torch not installed (pip install -e '.[bench]')")
from laplace import Laplace  # noqa: E402
from laplace.curvature import CurvlinopsEF  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from laplace_core.posteriors.build import build_posterior  # noqa: E402

from .conftest import M, RTOL, rel_err, torch_order_permutation  # noqa: E402

NAMES = ["conv1", "conv2", "fc"]


def _fit(model, data, batch_size, prior_precision=1.0):
    X, y = data
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="kron",
                 backend=CurvlinopsEF, prior_precision=prior_precision)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=batch_size, shuffle=False))
    return la


def _groups(model):
    """laplace-torch's factor groups in order: (layer, "weight"|"bias")."""
    out = []
    for name in NAMES:
        out.append((name, "weight"))
        if model.get_submodule(name).bias is not None:
            out.append((name, "bias"))
    return out


@pytest.mark.parametrize("n_batches", [1, 2, 3])
def test_kron_factors(model, data, ours, n_batches):
    """Factors ``[G, A_w/M]`` (weight) and ``[G]`` (bias), however the data are batched."""
    la = _fit(model, data, batch_size=M // n_batches)
    kfacs = la.H_facs.kfacs
    groups = _groups(model)
    assert len(kfacs) == len(groups)
    for (name, kind), F in zip(groups, kfacs):
        ls = ours.layers[name]
        n_w = model.get_submodule(name).weight[0].numel()
        assert rel_err(F[0], ls.G) < RTOL, (name, kind)
        if kind == "weight":
            assert len(F) == 2
            assert rel_err(F[1], ls.A[:n_w, :n_w] / M) < RTOL, name
        else:
            assert len(F) == 1


def test_kron_posterior_precision_is_our_kfac_exact_without_cross_terms(model, data, ours):
    """laplace-torch's KronLaplace precision (``δ = τ``) equals our ``kfac_exact`` posterior
    ``N (A/M ⊗ G/M) + τ I`` with ``N = M``, once the weight-bias cross terms of ours are set to
    zero (laplace-torch keeps weight and bias blocks separate); conv2 has no bias and agrees
    with no change."""
    tau = 0.7
    la = _fit(model, data, batch_size=M, prior_precision=tau)
    P_la = la.posterior_precision.to_matrix()
    perm = torch_order_permutation(model, NAMES)
    post = build_posterior(ours, "kfac_exact", n_data=M, prior_precision=tau)
    blocks = []
    for name in NAMES:
        P = post.to_dense(name).clone()
        m = ours.layers[name].G.shape[0]
        mod = model.get_submodule(name)
        if mod.bias is not None:
            nw = mod.weight[0].numel() * m  # bias entries come last in column-stacked vec(W~)
            assert P[:nw, nw:].abs().max() > 0  # ours has the cross terms
            P[:nw, nw:] = 0
            P[nw:, :nw] = 0
        blocks.append(P)
    assert rel_err(P_la[perm][:, perm], torch.block_diag(*blocks)) < RTOL
