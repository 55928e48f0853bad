"""Likelihoods the Fisher differentiates, and the label draws of the curvature pass.

Two likelihoods on the model output ``f`` of one example:

* classification: ``log p(y|f) = log_softmax(f)[y]``, gradient ``onehot(y) - softmax(f)``;
* regression (unit noise): ``log p(y|f) = -||y - f||² / 2`` (+ const), gradient ``y - f``.

The Fisher is ``E_y[∇ log p ∇ log p^T]``: with ``fisher="mc"`` the labels ``y`` are
``mc_samples`` draws from the model's predictive (the MC Fisher, averaged over draws),
with ``fisher="empirical"`` the true labels (the empirical Fisher).
:func:`sample_targets` is exactly what :func:`laplace_core.curvature.collect.collect_statistics`
draws for a batch.
"""
from __future__ import annotations

import torch

from ..names import FISHER_TYPES
from .keyed_rng import keyed_categorical, keyed_normal

__all__ = [
    "FISHER_TYPES",
    "LIKELIHOODS",
    "Classification",
    "Regression",
    "likelihood_for",
    "check_fisher",
    "sample_targets",
    "output_gradients",
]


class Classification:
    """Categorical likelihood on logits ``f`` (B, C): ``log p(y|f) = log_softmax(f)[y]``.
    Gradient w.r.t. ``f``: ``onehot(y) - softmax(f)``."""

    name = "classification"

    def check(self, out: torch.Tensor, labels: torch.Tensor | None, fisher: str) -> torch.Tensor | None:
        if out.dim() != 2:
            raise ValueError(f"classification expects model output of shape (B, C), got {tuple(out.shape)}")
        if labels is None:
            if fisher == "empirical":
                raise ValueError("fisher='empirical' needs labels in every batch")
            return None
        if not isinstance(labels, torch.Tensor):
            labels = torch.as_tensor(labels)
        if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
            raise ValueError(f"classification labels must be integers, got dtype {labels.dtype}")
        if labels.dim() != 1 or labels.shape[0] != out.shape[0]:
            raise ValueError(f"labels must have shape ({out.shape[0]},), got {tuple(labels.shape)}")
        C = out.shape[1]
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= C):
            raise ValueError(f"labels must lie in [0, {C}), got range [{int(labels.min())}, {int(labels.max())}]")
        return labels.to(device=out.device, dtype=torch.long)

    def sample(self, out: torch.Tensor, S: int, generator: torch.Generator | None) -> torch.Tensor:
        probs = torch.softmax(out, dim=1)
        return torch.multinomial(probs, S, replacement=True, generator=generator).T.contiguous()  # (S, B)

    def sample_keyed(self, out: torch.Tensor, S: int, seed: int, keys: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(out.to(torch.float64), dim=1)
        return torch.stack([keyed_categorical(probs, seed, keys, s) for s in range(S)]).to(out.device)

    def log_lik(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(out, dim=1)
        return logp.gather(1, targets.T).sum()

    def output_grad(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        S = targets.shape[0]
        grad = -torch.softmax(out, dim=1).unsqueeze(0).repeat(S, 1, 1)  # (S, B, C)
        grad.scatter_add_(2, targets.unsqueeze(2), torch.ones_like(grad[..., :1]))
        return grad


class Regression:
    """Gaussian likelihood with unit noise: ``log p(y|f) = -||y - f||² / 2`` (+ const).
    Gradient w.r.t. ``f``: ``y - f``; MC targets ``y = f + ε``, ``ε ~ N(0, I)``."""

    name = "regression"

    def check(self, out: torch.Tensor, labels: torch.Tensor | None, fisher: str) -> torch.Tensor | None:
        if labels is None:
            if fisher == "empirical":
                raise ValueError("fisher='empirical' needs targets in every batch")
            return None
        if not isinstance(labels, torch.Tensor):
            labels = torch.as_tensor(labels)
        if labels.shape != out.shape:
            if labels.numel() == out.numel() and labels.dim() >= 1 and labels.shape[0] == out.shape[0]:
                labels = labels.reshape(out.shape)
            else:
                raise ValueError(f"regression targets must have the output's shape {tuple(out.shape)}, got {tuple(labels.shape)}")
        return labels.to(device=out.device, dtype=out.dtype)

    def sample(self, out: torch.Tensor, S: int, generator: torch.Generator | None) -> torch.Tensor:
        eps = torch.randn((S,) + tuple(out.shape), generator=generator, dtype=out.dtype, device=out.device)
        return out.unsqueeze(0) + eps

    def sample_keyed(self, out: torch.Tensor, S: int, seed: int, keys: torch.Tensor) -> torch.Tensor:
        eps = torch.stack([keyed_normal(tuple(out.shape[1:]), seed, keys, s) for s in range(S)])
        return out.unsqueeze(0) + eps.to(device=out.device, dtype=out.dtype)

    def log_lik(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return -0.5 * (targets - out.unsqueeze(0)).square().sum()

    def output_grad(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return targets - out.unsqueeze(0)


LIKELIHOODS: dict[str, object] = {"classification": Classification(), "regression": Regression()}


def likelihood_for(name: str):
    """The likelihood object of ``LIKELIHOODS[name]`` (one-line error for an unknown name)."""
    if name not in LIKELIHOODS:
        raise ValueError(f"unknown likelihood {name!r}; valid: {', '.join(LIKELIHOODS)}")
    return LIKELIHOODS[name]


def check_fisher(fisher: str, mc_samples: int) -> int:
    """Validate ``fisher`` and ``mc_samples``; the number of label draws per example (1 for empirical)."""
    if fisher not in FISHER_TYPES:
        raise ValueError(f"unknown fisher {fisher!r}; valid: {', '.join(FISHER_TYPES)}")
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
        raise ValueError(f"mc_samples must be a positive integer, got {mc_samples!r}")
    return mc_samples if fisher == "mc" else 1


def sample_targets(
    out: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    fisher: str = "mc",
    mc_samples: int = 1,
    generator: torch.Generator | None = None,
    likelihood: str = "classification",
) -> torch.Tensor:
    """Targets ``(S, B, ...)`` whose log-likelihood the Fisher differentiates.

    ``fisher="mc"``: ``S = mc_samples`` draws from the model's predictive given the
    outputs ``out`` (classification: ``Categorical(softmax(out))`` via
    ``torch.multinomial(..., generator)``; regression: ``out + N(0, I)``).
    ``fisher="empirical"``: the labels, ``S = 1``. This is exactly what
    :func:`laplace_core.curvature.collect.collect_statistics` draws for a batch, so a test can reproduce its labels
    with a generator in the same state.
    """
    lik = likelihood_for(likelihood)
    S = check_fisher(fisher, mc_samples)
    out = out.detach()
    labels = lik.check(out, labels, fisher)
    if fisher == "empirical":
        return labels.unsqueeze(0)
    return lik.sample(out, S, generator)


def output_gradients(out: torch.Tensor, targets: torch.Tensor, likelihood: str = "classification") -> torch.Tensor:
    """``∂ log p(targets[s, k] | out[k]) / ∂ out[k]`` stacked as ``(S, *out.shape)``."""
    return likelihood_for(likelihood).output_grad(out.detach(), targets)
