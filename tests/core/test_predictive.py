"""laplace_core.predictive.monte_carlo: MC predictive over posterior weight samples, and MAP.

The posterior is a hand-made dense Gaussian per layer (covariance ``Σ = L L^T`` in
vec order), so the tests do not depend on any structure module. Forward passes in
the reference computations are written out with explicit ``F.linear`` / ``F.conv2d``
on ``W~ + δ`` (no module, no ``perturbed``).
"""
from __future__ import annotations

from typing import Any, ClassVar, Mapping

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from laplace_core.predictive import monte_carlo as P
from laplace_core.curvature.layers import find_layers, get_matrix
from laplace_core.posteriors.structures.base import LayerPosterior, Posterior, unvec, vec

DT = torch.float64
EXACT = 1e-13        # same θ_t, same summation order: equal up to BLAS blocking
COV_TOL = 0.08       # sample covariance of 4000 draws, relative to max |Σ| (≈ 4.5 / sqrt(4000))


class DenseGaussianLayer(LayerPosterior):
    """``N(0, Σ)`` over ``vec(W~)`` with ``Σ = (scale L)(scale L)^T``; tests only."""

    method: ClassVar[str] = "test_dense"

    def __init__(self, tril: torch.Tensor, m: int, n: int, scale: float = 1.0):
        self.tril, self.m, self.n, self.scale = tril, m, n, float(scale)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.m, self.n)

    def covariance(self) -> torch.Tensor:
        f = self.scale * self.tril
        return f @ f.T

    def precision_matvec(self, v):
        return unvec(torch.linalg.solve(self.covariance(), vec(v).unsqueeze(-1)).squeeze(-1), self.m, self.n)

    def scale_matvec(self, z):
        return unvec(vec(z) @ (self.scale * self.tril).T, self.m, self.n)

    def to_dense(self):
        return torch.linalg.inv(self.covariance())

    def num_stored(self) -> int:
        return self.tril.numel()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"tril": self.tril}

    def meta(self) -> dict[str, Any]:
        return {"m": self.m, "n": self.n, "scale": self.scale}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]):
        return cls(tensors["tril"], meta["m"], meta["n"], meta["scale"])


def make_posterior(model: nn.Module, scale: float = 0.3, seed: int = 0) -> Posterior:
    g = torch.Generator().manual_seed(seed)
    layers = {}
    for name, info in find_layers(model)[1].items():
        m, n = info.shape
        a = torch.randn(m * n, m * n, generator=g, dtype=DT) / (m * n) ** 0.5
        cov = a @ a.T + 0.5 * torch.eye(m * n, dtype=DT)
        layers[name] = DenseGaussianLayer(torch.linalg.cholesky(cov), m, n, scale)
    return Posterior(method="test_dense", layers=layers, n_data=1.0, prior_precision=1.0)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))

    @staticmethod
    def reference(x, mats):
        w1, w2 = mats["fc1"], mats["fc2"]
        h = torch.tanh(F.linear(x, w1[:, :-1], w1[:, -1]))
        return F.linear(h, w2[:, :-1], w2[:, -1])


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 4 * 4, 4, bias=False)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))

    @staticmethod
    def reference(x, mats):
        wc, wf = mats["conv"], mats["fc"]
        h = F.conv2d(x, wc[:, :-1].reshape(3, 2, 3, 3), wc[:, -1], padding=1)
        return F.linear(torch.relu(h).flatten(1), wf)


def setup(kind="mlp", n=20, seed=0):
    torch.manual_seed(seed)
    model = (MLP() if kind == "mlp" else ConvNet()).to(DT)
    g = torch.Generator().manual_seed(seed + 100)
    shape = (n, 4) if kind == "mlp" else (n, 2, 4, 4)
    return model, torch.randn(shape, generator=g, dtype=DT)


# ----------------------------------------------------------------- determinism / sharding
def test_same_seed_same_predictions_across_batches_and_order():
    model, x = setup()
    post = make_posterior(model)
    whole = P.mc_predict(model, post, x, n_samples=8, seed=3)
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(1))
    pieces = [perm[:7], perm[7:12], perm[12:]]
    out = torch.empty_like(whole)
    for idx in reversed(pieces):  # different order, fresh predictor per shard
        out[idx] = P.MCPredictor(model, post, n_samples=8, seed=3).predict(x[idx])
    assert torch.allclose(out, whole, rtol=0, atol=EXACT)
    # samples outer / batches inner, and the cached-deltas variant, give the same numbers
    pred = P.MCPredictor(model, post, n_samples=8, seed=3)
    by_batch = pred.predict_batches([x[idx] for idx in pieces])
    cached = P.MCPredictor(model, post, n_samples=8, seed=3, cache_bytes=10**7)
    assert cached._samples.enabled
    for idx, pb in zip(pieces, by_batch):
        assert torch.allclose(pb, whole[idx], rtol=0, atol=EXACT)
        assert torch.allclose(cached.predict(x[idx]), whole[idx], rtol=0, atol=EXACT)
    assert len(cached._samples._cached) == 8


def test_sample_depends_only_on_seed_and_index():
    model, _ = setup()
    post = make_posterior(model)
    a = P.draw_sample(post, 5, 2)
    b = P.draw_sample(post, 5, 2)
    c = P.draw_sample(post, 5, 3)
    d = P.draw_sample(post, 6, 2)
    for k in a:
        assert torch.equal(a[k], b[k])
        assert not torch.allclose(a[k], c[k]) and not torch.allclose(a[k], d[k])
        assert a[k].shape == post.layers[k].shape
    assert P.sample_seed(5, 2) == P.sample_seed(5, 2) != P.sample_seed(2, 5)


def test_different_seeds_differ():
    model, x = setup()
    post = make_posterior(model)
    p0 = P.mc_predict(model, post, x, n_samples=4, seed=0)
    p1 = P.mc_predict(model, post, x, n_samples=4, seed=1)
    assert (p0 - p1).abs().max() > 1e-3


# ----------------------------------------------------------------- correctness
@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_mc_average_equals_direct_computation(kind):
    model, x = setup(kind, n=6)
    post = make_posterior(model, scale=0.5)
    modules = find_layers(model)[0]
    K, seed = 5, 11
    ref = torch.zeros(6, 3 if kind == "mlp" else 4, dtype=DT)
    ref_logits = type(model).reference
    for t in range(K):
        g = torch.Generator().manual_seed(P.sample_seed(seed, t))
        deltas = post.sample(1, g)
        mats = {k: get_matrix(modules[k]) + deltas[k][0] for k in modules}
        ref += torch.softmax(ref_logits(x, mats), dim=1)
    ref /= K
    got = P.mc_predict(model, post, x, n_samples=K, seed=seed)
    assert torch.allclose(got, ref, rtol=0, atol=1e-12)
    assert torch.allclose(got.sum(1), torch.ones(6, dtype=DT), atol=1e-12)
    assert not torch.allclose(got, P.map_predict(model, x), atol=1e-3)  # samples really perturb


def test_map_restored_exactly_and_mode_restored():
    model, x = setup()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    post = make_posterior(model, scale=2.0)
    P.mc_predict(model, post, x, n_samples=3)
    P.MCPredictor(model, post, n_samples=2).predict_batches([x[:5], x[5:]])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model.training and model.fc1.training


def test_eval_mode_inside_predict():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3)).to(DT)
    model.train()
    x = torch.randn(10, 4, dtype=DT)
    post = make_posterior(model, scale=0.0)
    a = P.mc_predict(model, post, x, n_samples=2)
    b = P.map_predict(model, x)
    assert torch.equal(a, b)  # dropout off, zero variance
    assert model.training


def test_zero_and_vanishing_variance_give_map():
    model, x = setup()
    map_p = P.map_predict(model, x)
    assert torch.equal(P.mc_predict(model, make_posterior(model, scale=0.0), x, n_samples=4), map_p)
    near = P.mc_predict(model, make_posterior(model, scale=1e-7), x, n_samples=4)
    err = (near - map_p).abs().max()
    assert 0 < err < 1e-5


def test_samples_have_posterior_covariance():
    model, _ = setup()
    post = make_posterior(model, scale=1.0)
    draws = torch.stack([vec(P.draw_sample(post, 0, t)["fc2"]) for t in range(4000)])
    emp = draws.T @ draws / draws.shape[0]
    cov = post.layers["fc2"].covariance()
    assert (emp - cov).abs().max() / cov.abs().max() < COV_TOL
    assert draws.mean(0).abs().max() < 0.2 * cov.diagonal().max().sqrt()


def test_float32_model_float64_posterior():
    model, x = setup()
    model = model.float()
    post = make_posterior(model)
    got = P.mc_predict(model, post, x.float(), n_samples=3)
    assert got.dtype == torch.float32
    model64 = model.double()
    ref = P.mc_predict(model64, post, x, n_samples=3)
    assert torch.allclose(got.double(), ref, atol=1e-5)


def test_diag_structure_if_available():
    diag = pytest.importorskip("laplace_core.posteriors.structures.diag")
    model, x = setup(n=5)
    modules, infos, _ = find_layers(model)
    g = torch.Generator().manual_seed(2)
    layers = {k: diag.DiagLayer(torch.rand(i.shape, generator=g, dtype=DT), 10.0, 1.0) for k, i in infos.items()}
    post = Posterior("diag", layers, 10.0, 1.0)
    ref = torch.zeros(5, 3, dtype=DT)
    for t in range(3):
        d = post.sample(1, torch.Generator().manual_seed(P.sample_seed(0, t)))
        ref += torch.softmax(MLP.reference(x, {k: get_matrix(modules[k]) + d[k][0] for k in modules}), 1)
    assert torch.allclose(P.mc_predict(model, post, x, n_samples=3), ref / 3, rtol=0, atol=1e-12)


# ----------------------------------------------------------------- errors
def test_bad_arguments():
    model, x = setup()
    post = make_posterior(model)
    with pytest.raises(ValueError, match="n_samples"):
        P.MCPredictor(model, post, n_samples=0)
    with pytest.raises(ValueError, match="valid: classification"):
        P.MCPredictor(model, post, likelihood="poisson")
    with pytest.raises(ValueError, match="not found in the model"):
        P.MCPredictor(nn.Sequential(nn.Linear(4, 3)).to(DT), post)
    other = MLP().to(DT)
    other.fc2 = nn.Linear(6, 5).to(DT)
    with pytest.raises(ValueError, match="shape"):
        P.MCPredictor(other, post)
    with pytest.raises(ValueError, match="re-iterable"):
        P.MCPredictor(model, post, n_samples=2).predict_batches(iter([x]))
    with pytest.raises(ValueError, match="ints"):
        P.sample_seed(1.5, 0)
