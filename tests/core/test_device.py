"""laplace_core on CUDA against the same computation on the CPU (float64, fixed seeds).

Skipped where there is no CUDA device (CI has none); on a GPU machine:
``python -m pytest tests/core/test_device.py``. What must hold on the GPU:

* the statistics (A, G, exact diagonal, EFB sums) of one pass with keyed MC labels
  equal the CPU pass's (the labels come from ``(seed, key)``, not a device stream);
* the eigenbasis computed on the GPU diagonalises the same factors;
* every posterior built on the GPU has the CPU one's precision (dense, per layer), and
  its scale map ``F`` applied to the same ``z`` gives the same deltas;
* ``Posterior.to("cuda")`` draws on the GPU with a CUDA generator, and the MC and
  GLM predictives run with the model there (the GLM covariance is deterministic and
  equals the CPU one);
* the subnetwork Fisher of the selected weights equals the CPU one.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import laplace_core as lc
from laplace_core.predictive.glm import glm_covariance
from laplace_core.curvature.keyed_rng import KeyedSampler
from laplace_core.predictive.monte_carlo import MCPredictor
from laplace_core.curvature.subnet_fisher import collect_subnet_fisher
from laplace_core.posteriors.subnet import select_subnetwork

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")

F64 = torch.float64
TOL = 1e-10  # relative to each reference tensor's largest entry: float64 sums in another order
METHODS = ("diag", "kfac", "kfac_exact", "efb", "inf")


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float = TOL) -> None:
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    scale = expected.abs().max().clamp_min(1e-300)
    err = float((actual - expected).abs().max() / scale)
    assert err <= tol, f"relative error {err:.3e} > {tol}"


class _Net(nn.Module):
    def __init__(self, classes: int = 5):
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.c2 = nn.Conv2d(6, 8, 3, stride=2, bias=False)
        self.f1 = nn.Linear(8 * 3 * 3, 12)
        self.f2 = nn.Linear(12, classes)

    def forward(self, x):
        h = torch.tanh(self.c1(x))
        h = torch.relu(self.c2(h))
        return self.f2(torch.tanh(self.f1(h.flatten(1))))


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    cpu = _Net().to(F64).eval()
    gpu = _Net().to(F64).eval()
    gpu.load_state_dict(cpu.state_dict())
    gpu = gpu.cuda()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, 8, 8, generator=g, dtype=F64)
    y = torch.randint(0, 5, (40,), generator=g)
    keys = torch.arange(40) * 7 + 3

    def batches(device):
        return [(x[i:i + 10].to(device), y[i:i + 10].to(device), keys[i:i + 10].to(device)) for i in range(0, 40, 10)]

    s_cpu = lc.collect_statistics(cpu, batches("cpu"), fisher="mc", generator=KeyedSampler(5))
    s_gpu = lc.collect_statistics(gpu, batches("cuda"), fisher="mc", generator=KeyedSampler(5))
    basis = lc.eigenbasis(s_cpu)  # one basis for both (eigenvectors of repeated eigenvalues are not unique)
    basis_gpu = lc.Eigenbasis(layers={k: b.to(device="cuda") for k, b in basis.layers.items()},
                              clamped=dict(basis.clamped))
    s_cpu = lc.collect_statistics(cpu, batches("cpu"), fisher="mc", generator=KeyedSampler(6), basis=basis)
    s_gpu = lc.collect_statistics(gpu, batches("cuda"), fisher="mc", generator=KeyedSampler(6), basis=basis_gpu)
    return dict(cpu=cpu, gpu=gpu, x=x, y=y, keys=keys, batches=batches, s_cpu=s_cpu, s_gpu=s_gpu,
                basis=basis, basis_gpu=basis_gpu)


def test_statistics_on_cuda_equal_cpu(case):
    s_cpu, s_gpu = case["s_cpu"], case["s_gpu"]
    assert s_gpu.count == s_cpu.count == 40 and s_gpu.efb_count == 40
    for k, ls in s_cpu.layers.items():
        lg = s_gpu.layers[k]
        assert lg.A.is_cuda and lg.efb.is_cuda, k
        for f in ("A", "G", "diag", "efb"):
            _close(getattr(lg, f), getattr(ls, f))


def test_eigenbasis_on_cuda_diagonalises_the_same_factors(case):
    s_gpu = case["s_gpu"]
    b_gpu = lc.eigenbasis(s_gpu)
    for k, ls in case["s_cpu"].layers.items():
        b = b_gpu[k]
        assert b.U_A.is_cuda, k
        _close(b.U_A @ torch.diag(b.S_A) @ b.U_A.T, ls.A / s_gpu.count, 1e-9)
        _close(b.U_G @ torch.diag(b.S_G) @ b.U_G.T, ls.G / s_gpu.count, 1e-9)


@pytest.mark.parametrize("method", METHODS)
def test_posteriors_built_on_cuda_equal_cpu(case, method):
    rank = 20 if method == "inf" else None
    p_cpu = lc.build_posterior(case["s_cpu"], method, rank=rank, prior_precision=0.5, basis=case["basis"])
    p_gpu = lc.build_posterior(case["s_gpu"], method, rank=rank, prior_precision=0.5, basis=case["basis_gpu"])
    g = torch.Generator().manual_seed(3)
    for k, lp in p_cpu.layers.items():
        _close(p_gpu.layers[k].to_dense(), lp.to_dense())
        z = torch.randn(2, *lp.shape, generator=g, dtype=F64)
        _close(p_gpu.layers[k].scale_matvec(z.cuda()), lp.scale_matvec(z))
    moved = p_cpu.to("cuda")
    d = moved.sample(3, torch.Generator(device="cuda").manual_seed(0))
    assert all(t.is_cuda and t.shape == (3, *p_cpu.layers[k].shape) for k, t in d.items())
    back = moved.to("cpu")
    for k, lp in p_cpu.layers.items():
        _close(back.layers[k].to_dense(), lp.to_dense(), 0.0)


def test_predictives_with_the_model_on_cuda(case):
    post = lc.build_posterior(case["s_cpu"], "inf", rank=20, prior_precision=2.0, basis=case["basis"])
    x = case["x"][:8]
    p = MCPredictor(case["gpu"], post.to("cuda"), n_samples=4, seed=1).predict(x.cuda())
    assert p.is_cuda and p.shape == (8, 5)
    _close(p.sum(-1), torch.ones(8, dtype=F64), 1e-12)
    # the GLM covariance J Σ J^T has no randomness: GPU and CPU agree
    for method in ("kfac", "inf"):
        post = lc.build_posterior(case["s_cpu"], method, rank=20 if method == "inf" else None,
                                  prior_precision=2.0, basis=case["basis"])
        c_cpu = glm_covariance(case["cpu"], post, x)
        c_gpu = glm_covariance(case["gpu"], post.to("cuda"), x.cuda())
        assert c_gpu.is_cuda
        _close(c_gpu, c_cpu, 1e-9)


def test_subnet_fisher_on_cuda_equals_cpu(case):
    masks = select_subnetwork(case["s_cpu"], 30, prior_precision=1.0)
    f_cpu, n_cpu = collect_subnet_fisher(case["cpu"], case["batches"]("cpu"), masks, fisher="mc",
                                         generator=KeyedSampler(9))
    f_gpu, n_gpu = collect_subnet_fisher(case["gpu"], case["batches"]("cuda"),
                                         {k: m.cuda() for k, m in masks.items()}, fisher="mc",
                                         generator=KeyedSampler(9))
    assert n_gpu == n_cpu == 40 and f_gpu.is_cuda
    _close(f_gpu, f_cpu)
    post = lc.build_posterior(case["s_cpu"], "subnet", prior_precision=1.0, subnet_fisher=(f_cpu, n_cpu, masks))
    d = post.to("cuda").sample(2, torch.Generator(device="cuda").manual_seed(0))
    assert all(t.is_cuda for t in d.values())
