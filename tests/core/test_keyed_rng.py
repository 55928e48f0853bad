"""Keyed (counter-based) sampling: order-independent and correctly distributed."""
import torch

from laplace_core.curvature.keyed_rng import keyed_categorical, keyed_normal, keyed_uniform

# Named tolerances for the distribution checks (fixed seeds, n draws):
N_DRAWS = 200_000
FREQ_TOL = 5.0 / N_DRAWS**0.5      # ~5 standard errors of a frequency
MOMENT_TOL = 5.0 / N_DRAWS**0.5


def test_uniform_depends_only_on_seed_key_draw():
    keys = torch.arange(100, dtype=torch.int64)
    u = keyed_uniform(7, keys, 0, 3)
    perm = torch.randperm(100, generator=torch.Generator().manual_seed(0))
    assert torch.equal(keyed_uniform(7, keys[perm], 0, 3), u[perm])
    assert torch.equal(keyed_uniform(7, keys[:10], 0, 3), u[:10])
    assert not torch.equal(keyed_uniform(8, keys, 0, 3), u)
    assert not torch.equal(keyed_uniform(7, keys, 1, 3), u)
    assert u.dtype == torch.float64 and (u > 0).all() and (u < 1).all()


def test_uniform_moments():
    u = keyed_uniform(3, torch.arange(N_DRAWS), 0).squeeze(1)
    assert abs(float(u.mean()) - 0.5) < MOMENT_TOL
    assert abs(float(u.var()) - 1 / 12) < MOMENT_TOL


def test_categorical_frequencies_match_probs():
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    probs = p.expand(N_DRAWS, 4)
    y = keyed_categorical(probs, 11, torch.arange(N_DRAWS), 0)
    freq = torch.bincount(y, minlength=4).double() / N_DRAWS
    assert (freq - p).abs().max() < FREQ_TOL


def test_normal_moments():
    z = keyed_normal((2,), 5, torch.arange(N_DRAWS), 0)
    assert z.shape == (N_DRAWS, 2)
    assert z.mean(0).abs().max() < MOMENT_TOL
    assert (z.var(0) - 1).abs().max() < 3 * MOMENT_TOL
    assert abs(float((z[:, 0] * z[:, 1]).mean())) < MOMENT_TOL
