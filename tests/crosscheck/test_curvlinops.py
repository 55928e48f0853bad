"""Our KFAC factors, exact diagonal and EFB eigenvalues against curvlinops 3.0.1.

curvlinops conventions (``curvlinops/kfac.py``, ``ekfac.py``; summary in docs/conventions.md):

* ``KFACLinearOperator(..., kfac_approx="expand")``: input covariance
  ``Σ_{k,t} a a^T / (N_data T)`` -> equals our ``A / M``; gradient covariance of the loss
  ``Σ_{k,t} g g^T`` for ``reduction="sum"`` -> equals our ``G`` (a sum), and ``G / M`` for
  ``reduction="mean"`` (it rescales by ``B² / N_data``). So the sum-loss operator is
  ``M (A/M ⊗ G/M)`` and the mean-loss operator ``(A/M) ⊗ (G/M)``.
* ``separate_weight_and_bias=False`` appends a ones column to the inputs (bias last), which is
  our ``W~ = [W, b]``; ``True`` (the default, and what laplace-torch uses) drops the
  weight-bias cross terms: weight block ``A_w/M ⊗ G``, bias block ``G`` alone.
* ``EKFACLinearOperator``: eigenvectors of those factors, corrected eigenvalues
  ``Σ_k (Q_G^T d_k Q_A)^2`` from per-example gradients (sum reduction) = our ``efb``.
* The empirical Fisher ``EFLinearOperator`` (sum loss) has diagonal ``Σ_k d_k∘d_k`` = our ``diag``.
"""
from __future__ import annotations

import pytest
import torch

curvlinops = pytest.importorskip(
    "curvlinops", reason="curvlinops-for-pytorch not installed (pip install -e '.[bench]')"
)
from curvlinops import EFLinearOperator, EKFACLinearOperator, KFACLinearOperator  # noqa: E402
from torch.nn import CrossEntropyLoss  # noqa: E402

from laplace_core.curvature.collect import collect_efb  # noqa: E402
from laplace_core.basis.eigenbasis import LayerBasis, eigenbasis  # noqa: E402

from .conftest import M, RTOL, rel_err, torch_order_permutation  # noqa: E402

NAMES = ["conv1", "conv2", "fc"]


def _params(model):
    return [p for p in model.parameters() if p.requires_grad]


def _kfac(model, data, reduction, separate, cls=KFACLinearOperator):
    op = cls(
        model, CrossEntropyLoss(reduction=reduction), _params(model), [data],
        fisher_type="empirical", kfac_approx="expand", separate_weight_and_bias=separate,
        check_deterministic=False,
    )
    return op


@pytest.mark.parametrize("reduction, g_scale", [("sum", 1.0), ("mean", 1.0 / M)])
def test_kfac_factors_joint_bias(model, data, ours, reduction, g_scale):
    """Joint weight+bias: curvlinops' input covariance = A/M, gradient covariance = G (sum
    loss) or G/M (mean loss)."""
    op = _kfac(model, data, reduction, separate=False)
    op.compute_kronecker_factors()
    sd = op.state_dict()
    for name in NAMES:
        ls = ours.layers[name]
        A_c, G_c = sd["input_covariances"][name], sd["gradient_covariances"][name]
        assert A_c.shape == ls.A.shape and G_c.shape == ls.G.shape
        assert rel_err(A_c, ls.A / M) < RTOL, name
        assert rel_err(G_c, ls.G * g_scale) < RTOL, name


def test_kfac_dense_matrix_sum_loss(model, data, ours):
    """The whole sum-loss KFAC matrix, in PyTorch parameter order, equals
    ``M · blockdiag(A/M ⊗ G/M)`` of ours after permuting our column-stacked ``vec(W~)``."""
    op = _kfac(model, data, "sum", separate=False)
    D = op.shape[0]
    dense = op @ torch.eye(D, dtype=torch.float64)
    perm = torch_order_permutation(model, NAMES)
    assert sorted(perm.tolist()) == list(range(D))
    blocks = [torch.kron(ours.layers[k].A / M, ours.layers[k].G / M) for k in NAMES]
    mine = M * torch.block_diag(*blocks)
    assert rel_err(dense[perm][:, perm], mine) < RTOL


def test_kfac_separate_bias_drops_cross_terms(model, data, ours):
    """``separate_weight_and_bias=True``: weight factor ``A_w/M`` (our A without its bias row
    and column), bias block ``G`` alone (our ``A[-1, -1]/M`` = 1), no weight-bias cross terms."""
    op = _kfac(model, data, "sum", separate=True)
    op.compute_kronecker_factors()
    sd = op.state_dict()
    for name in NAMES:
        mod = model.get_submodule(name)
        ls = ours.layers[name]
        n_w = mod.weight[0].numel()
        assert rel_err(sd["input_covariances"][name], ls.A[:n_w, :n_w] / M) < RTOL, name
        assert rel_err(sd["gradient_covariances"][name], ls.G) < RTOL, name
        if mod.bias is not None:
            assert abs(float(ls.A[-1, -1]) / M - 1.0) < RTOL  # bias input is 1 at every position


def test_exact_diagonal_vs_empirical_fisher(model, data, ours):
    """Diagonal of curvlinops' dense empirical Fisher (sum loss) = our exact ``Σ_k d_k∘d_k``."""
    op = EFLinearOperator(model, CrossEntropyLoss(reduction="sum"), _params(model), [data],
                          check_deterministic=False)
    D = op.shape[0]
    ef = op @ torch.eye(D, dtype=torch.float64)
    perm = torch_order_permutation(model, NAMES)
    mine = torch.cat([ours.layers[k].diag.T.reshape(-1) for k in NAMES])  # column stacking
    assert rel_err(torch.diagonal(ef)[perm], mine) < RTOL


def test_efb_vs_ekfac_corrected_eigenvalues(model, data, ours):
    """EKFAC corrected eigenvalues (sum loss, joint bias) = our ``efb`` sums when our second
    pass uses curvlinops' eigenvectors; and, in our own basis, the same numbers up to the
    eigenvector ambiguity of (near-)zero eigenvalues (compared sorted)."""
    op = _kfac(model, data, "sum", separate=False, cls=EKFACLinearOperator)
    op.compute_eigenvalue_correction()
    sd = op.state_dict()
    basis = {}
    for name in NAMES:
        Q_A = sd["input_covariances_eigenvectors"][name]
        Q_G = sd["gradient_covariances_eigenvectors"][name]
        one = lambda U: torch.ones(U.shape[0], dtype=U.dtype)  # noqa: E731 (values unused by the pass)
        basis[name] = LayerBasis(U_A=Q_A, S_A=one(Q_A), U_G=Q_G, S_G=one(Q_G))
    efb, count = collect_efb(model, [data], basis, fisher="empirical")
    assert count == M
    lams = {}
    for name in NAMES:
        lam = sd["corrected_eigenvalues"][name]
        if isinstance(lam, dict):  # layer without bias: stored per parameter position
            (lam,) = lam.values()
        lams[name] = lam
        assert lam.shape == efb[name].shape
        assert rel_err(efb[name], lam) < RTOL, name
    # our own eigenbasis: eigenvalue sets agree (zero eigenvalues have arbitrary eigenvectors)
    efb_own, _ = collect_efb(model, [data], eigenbasis(ours), fisher="empirical")
    for name in NAMES:
        a = efb_own[name].flatten().sort().values
        b = lams[name].flatten().sort().values
        assert rel_err(a, b) < 1e-6, name
        # trace is basis-invariant: Σ Λ = Σ_k ||d_k||² = Σ diag
        assert abs(float(efb_own[name].sum() / ours.layers[name].diag.sum()) - 1) < RTOL, name
