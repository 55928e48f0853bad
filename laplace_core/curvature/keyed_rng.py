"""Counter-based random numbers keyed by example identity.

The MC Fisher samples a label ``y_k ~ p(y | x_k)`` per example. With a sequential
``torch.Generator`` the draw depends on the order in which a process sees the
examples, so two Ray workers (or a restarted worker) would not reproduce a single
process. Here the uniform behind each draw is a pure function
``u = h(seed, key_k, draw, j)`` of the run's seed, the example's key, the draw number
and a component index, so the statistics do not depend on sharding, batching or restarts.

The key is an int64 that names the example itself, not its position: whatever the caller
supplies with each batch (a dict batch's ``"key"``, or the third element of ``(x, y, keys)``).
The Ray pipelines key each image by the first 63 bits of SHA-1 of its path relative to the
split dir (for Parquet data, its ``path`` column), so an image gets the same uniforms, and
hence, for a given model, the same MC labels, in any partition layout, on any worker and
after a restart.

``h`` is SplitMix64 (Steele, Lea & Flood 2014) chained over the inputs, computed in
NumPy ``uint64`` (well-defined wrap-around arithmetic); the top 53 bits give a
float64 in ``(0, 1)``.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["KeyedSampler", "keyed_uniform", "keyed_categorical", "keyed_normal"]


class KeyedSampler:
    """Pass as ``generator=`` to :func:`laplace_core.curvature.collect.collect_statistics` to draw
    the MC-Fisher labels from ``(seed, example key, draw)`` instead of a stream; every
    batch must then carry integer keys (dict batches: ``"key"``)."""

    __slots__ = ("seed",)

    def __init__(self, seed: int):
        self.seed = int(seed)

    def __repr__(self) -> str:
        return f"KeyedSampler(seed={self.seed})"

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def keyed_uniform(seed: int, keys: torch.Tensor, draw: int, width: int = 1) -> torch.Tensor:
    """Uniforms in ``(0, 1)``, shape ``(B, width)`` float64, on ``keys.device``.

    Entry ``[k, j]`` depends only on ``(seed, keys[k], draw, j)``.
    """
    if keys.dim() != 1:
        raise ValueError(f"keys must be a 1-D integer tensor, got shape {tuple(keys.shape)}")
    k = keys.detach().to("cpu", torch.int64).numpy().astype(np.uint64)
    with np.errstate(over="ignore"):
        h = _splitmix64(np.full(k.shape, np.uint64(seed & 0xFFFFFFFFFFFFFFFF)))
        h = _splitmix64(h ^ k)
        h = _splitmix64(h ^ np.uint64(draw))
        j = np.arange(width, dtype=np.uint64)
        h = _splitmix64(h[:, None] ^ j[None, :])
    u = ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)
    return torch.from_numpy(u).to(keys.device)


def keyed_categorical(probs: torch.Tensor, seed: int, keys: torch.Tensor, draw: int) -> torch.Tensor:
    """One class index per row of ``probs`` (B, C) by inverse-CDF on a keyed uniform."""
    u = keyed_uniform(seed, keys, draw, 1).to(torch.float64)
    cdf = probs.detach().to(torch.float64).cumsum(dim=1)
    cdf = cdf / cdf[:, -1:].clamp_min(torch.finfo(torch.float64).tiny)
    idx = torch.searchsorted(cdf, u.to(cdf.device), right=True).squeeze(1)
    return idx.clamp_max(probs.shape[1] - 1)


def keyed_normal(shape: tuple[int, ...], seed: int, keys: torch.Tensor, draw: int) -> torch.Tensor:
    """Standard normals of shape ``(B, *shape)`` float64 by Box-Muller on keyed uniforms."""
    width = int(np.prod(shape)) if shape else 1
    u = keyed_uniform(seed, keys, draw, 2 * width)
    u1, u2 = u[:, :width], u[:, width:]
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * torch.pi * u2)
    return z.reshape(keys.shape[0], *shape)
