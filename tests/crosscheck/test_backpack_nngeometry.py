"""Our exact Fisher diagonal (and KFAC factors) against BackPACK 1.7.1 and nngeometry 0.4.

* BackPACK ``SumGradSquared`` on ``CrossEntropyLoss(reduction="sum")``: ``Σ_k (∂ℓ_k/∂θ)²`` per
  parameter, the empirical-Fisher diagonal = our ``diag`` (a sum) for ``fisher="empirical"``;
  ``BatchGrad`` gives the per-example gradients ``d_k`` themselves.
* nngeometry ``PMatDiag`` / ``PMatKFAC`` with ``TorchHooksJacobianBackend`` on the per-example
  log-likelihood ``f_k = log p(y_k|x_k)`` (output dimension 1): averages over examples, so
  ``diag / M``; KFAC factors ``(Σ a a^T / M, Σ g g^T / M)`` for Linear and, for Conv2d,
  ``(Σ_{k,t} a a^T / M, Σ_{k,t} g g^T / (T M))``: the ``1/T`` sits on the *output* factor
  (ours and curvlinops put it on the input factor), so ``A_nng = T A/M``, ``G_nng = G/(T M)``
  with the same Kronecker product. Summary in docs/conventions.md.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from .conftest import M, POSITIONS, RTOL, rel_err, split_w_b

NAMES = ["conv1", "conv2", "fc"]


@pytest.mark.filterwarnings("ignore:Full backward hook is firing", "ignore:Extension saving to")
def test_backpack_sum_grad_squared(model, data, ours):
    backpack = pytest.importorskip("backpack", reason="backpack-for-pytorch not installed (pip install -e '.[bench]')")
    from backpack.extensions import BatchGrad, SumGradSquared
    import copy

    X, y = data
    emodel = backpack.extend(copy.deepcopy(model))
    lossf = backpack.extend(nn.CrossEntropyLoss(reduction="sum"))
    loss = lossf(emodel(X), y)
    with backpack.backpack(SumGradSquared(), BatchGrad()):
        loss.backward()
    for name in NAMES:
        mod = emodel.get_submodule(name)
        w, b = split_w_b(ours.layers[name].diag, mod)
        assert rel_err(mod.weight.sum_grad_squared, w) < RTOL, name
        # the per-example gradients square-sum to the same diagonal
        assert rel_err(mod.weight.grad_batch.square().sum(0), w) < RTOL, name
        if b is not None:
            assert rel_err(mod.bias.sum_grad_squared, b) < RTOL, name


def _nng(model, data, what):
    nngeometry = pytest.importorskip("nngeometry", reason="nngeometry not installed (pip install -e '.[bench]')")
    from nngeometry.backend import TorchHooksJacobianBackend
    from nngeometry.layercollection import LayerCollection
    from nngeometry.object.pspace import PMatDiag, PMatKFAC
    from torch.utils.data import DataLoader, TensorDataset

    X, y = data
    loader = DataLoader(TensorDataset(X, y), batch_size=3, shuffle=False)
    lc = LayerCollection.from_model(model)

    def loglik(x, t):  # per-example log-likelihood, shape (B, 1)
        return torch.log_softmax(model(x), dim=1).gather(1, t.view(-1, 1))

    try:
        gen = TorchHooksJacobianBackend(model=model, function=loglik, layer_collection=lc)
        pm = (PMatDiag if what == "diag" else PMatKFAC)(generator=gen, examples=loader)
    except Exception as e:  # noqa: BLE001 - optional peer: skip with the reason, never fail on its API
        pytest.skip(f"nngeometry 0.4 API does not run here: {type(e).__name__}: {e}")
    return pm, lc


# nngeometry 0.4's generic per-example diagonal (used for Conv2d, JacobianFactory.diag) stores the
# per-example gradients in ``torch.zeros(bs, numel)`` without a dtype, i.e. float32 even for a
# float64 model: conv entries carry float32 round-off (measured ~5e-8 relative; ours agrees with
# torch.func per-example gradients to 2e-16). Linear layers use a dtype-preserving path.
NNG_CONV_RTOL = 1e-6


def test_nngeometry_diag(model, data, ours):
    pm, lc = _nng(model, data, "diag")
    diag = pm.get_diag()
    assert diag.dtype == torch.float64
    # nngeometry's flat order: layer_collection order, each layer weight (row-major) then bias
    off = 0
    for lid in lc.layers:
        name = lid if lid in ours.layers else lid.rsplit(".", 1)[0]
        mod = model.get_submodule(name)
        w, b = split_w_b(ours.layers[name].diag, mod)
        mine = torch.cat([w.reshape(-1)] + ([b] if b is not None else [])) / M
        got = diag[off:off + mine.numel()]
        off += mine.numel()
        tol = NNG_CONV_RTOL if isinstance(mod, nn.Conv2d) else RTOL
        assert rel_err(got, mine) < tol, name
    assert off == diag.numel()


def test_nngeometry_kfac_conv_positions_on_output_factor(model, data, ours):
    pm, lc = _nng(model, data, "kfac")
    for lid in lc.layers:
        name = lid if lid in ours.layers else lid.rsplit(".", 1)[0]
        A_n, G_n = pm.data[lid]
        T = POSITIONS[name]
        ls = ours.layers[name]
        assert rel_err(A_n, T * ls.A / M) < RTOL, name
        assert rel_err(G_n, ls.G / (T * M)) < RTOL, name
