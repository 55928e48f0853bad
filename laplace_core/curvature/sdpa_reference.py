"""``F.scaled_dot_product_attention`` in plain autograd ops, for forward-mode AD (``torch.func.jvp``):
the fused CPU kernels have no forward-mode derivative (timm's ``Attention`` calls it;
:func:`laplace_core.curvature.hooks.reference_attention` runs it as :func:`sdpa_reference`)."""
from __future__ import annotations

import math

import torch

__all__ = ["sdpa_reference"]


def sdpa_reference(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``softmax(q k^T · scale + mask) v`` with ``F.scaled_dot_product_attention``'s arguments
    (boolean masks: True = may attend; ``scale`` default ``1/√E``); dropout must be off."""
    if dropout_p > 0:
        raise ValueError("the reference attention needs eval mode (dropout off)")
    L, S, E = query.shape[-2], key.shape[-2], query.shape[-1]
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        r = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(r, -3), value.repeat_interleave(r, -3)
    scores = (query @ key.transpose(-2, -1)) * (1.0 / math.sqrt(E) if scale is None else scale)
    if is_causal:
        scores = scores.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=query.device).tril(), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return torch.softmax(scores, dim=-1) @ value
