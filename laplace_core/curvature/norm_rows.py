"""Per-example gradients of a normalisation layer's affine ``W~ = [γ, β]`` from its input and
output gradient (:func:`norm_grads`, re-exported by :mod:`laplace_core.curvature.hooks`)."""
from __future__ import annotations

import torch
from torch import nn

from .layers import ScaleView

__all__ = ["norm_grads"]


def _channel_dim(layer) -> int:
    """Axis of the affine parameters in the layer's input: 1 for BatchNorm / GroupNorm /
    torchvision's ``LayerNorm2d`` / the layer scale, the last axis for ``nn.LayerNorm``."""
    if isinstance(layer, nn.LayerNorm) and not type(layer).__name__.endswith("2d"):  # timm's LayerNorm(Act)2d: NCHW
        return -1
    return 1


def _normalised(layer, x: torch.Tensor) -> torch.Tensor:
    """``x̂``, the value the affine weight multiplies (eval mode: running statistics)."""
    if isinstance(layer, ScaleView):
        return x  # the block's output
    if isinstance(layer, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return (x - layer.running_mean.reshape(shape)) * torch.rsqrt(layer.running_var.reshape(shape) + layer.eps)
    if isinstance(layer, nn.GroupNorm):
        xg = x.reshape(x.shape[0], layer.num_groups, -1)
        mean = xg.mean(-1, keepdim=True)
        var = xg.var(-1, unbiased=False, keepdim=True)
        return ((xg - mean) * torch.rsqrt(var + layer.eps)).reshape(x.shape)
    if isinstance(layer, nn.LayerNorm):
        d = _channel_dim(layer)
        mean = x.mean(d, keepdim=True)
        var = x.var(d, unbiased=False, keepdim=True)
        return (x - mean) * torch.rsqrt(var + layer.eps)
    raise ValueError(f"norm_grads: unsupported layer type {type(layer).__name__}")


def norm_grads(layer, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-example gradients ``(B, C, n)`` of a normalisation layer's ``W~ = [γ, β]``.

    ``y = γ ∘ x̂ + β`` along the channel axis, so ``∂/∂γ_c = Σ_t g_{t,c} x̂_{t,c}`` and
    ``∂/∂β_c = Σ_t g_{t,c}`` over the positions ``t`` of one example (``x̂``: the input
    normalised with the running statistics for BatchNorm, per example for LayerNorm /
    GroupNorm, the block output for a layer scale). ``x`` is the layer's input, ``g`` the
    gradient of its output; exact (the eval-mode ``x̂`` does not depend on ``γ``, ``β``)."""
    d = _channel_dim(layer)
    xh = _normalised(layer, x.to(g.dtype))
    gc = g.movedim(d, 1).reshape(g.shape[0], g.shape[d], -1)  # (B, C, T)
    cols = [(gc * xh.movedim(d, 1).reshape(gc.shape)).sum(-1)]
    if layer.bias is not None:
        cols.append(gc.sum(-1))
    return torch.stack(cols, -1)
