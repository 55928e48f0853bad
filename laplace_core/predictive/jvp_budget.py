"""How much of a batch and how many MC-GLM directions go through one ``vmap``-ed JVP.

A ``vmap`` over ``k`` directions of a JVP on ``b`` examples holds about ``PARAM_COPIES``
weight-sized tensors per direction (the draws, their stack, the tangents and vmap's batched
weights) and the activations with their tangents of ``k x b`` forward passes. Measured on a
resnet18 at 224 px on the CPU (11.7 M weights, 47 MB; module outputs 33.5 MiB per example):
each direction added ~225 MB at one example, and ``k = 10`` directions on the search's
batches of 64 put two search actors at 9.7 and 11.0 GB, which Ray's memory monitor killed
on a 24 GB node.

:func:`forward_with_bytes` measures the bytes of every module's output per example during
the forward the predictive runs anyway; :func:`jvp_plan` keeps the directions' weights
within half of a byte budget (:data:`JVP_BYTES`) and fills the rest with examples. Every
example's linearised logits depend on that example alone (eval mode) and direction ``t``
on ``(seed, t)`` alone, so the split changes no result beyond float rounding (resnet18, batch
64, K = 10: peak +1.02 GiB instead of +9.02, 105 instead of 114 ms per example-direction, the
probabilities within 6e-8; ``benchmarks/glm_memory.py``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["JVP_BYTES", "PARAM_COPIES", "forward_with_bytes", "jvp_plan"]

#: The default budget of one ``vmap``-ed JVP, in bytes.
JVP_BYTES = 2 << 30
#: Weight-sized tensors held per direction (measured on resnet18: ~4.8).
PARAM_COPIES = 5


def _tensor_bytes(out: Any) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, (tuple, list)):
        return sum(_tensor_bytes(o) for o in out)
    if isinstance(out, dict):
        return sum(_tensor_bytes(o) for o in out.values())
    return 0


def forward_with_bytes(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(model(x), bytes of all module outputs per example)`` in one forward (no grad)."""
    total = [0]

    def hook(_mod, _inp, out):
        total[0] += _tensor_bytes(out)

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with torch.no_grad():
            out = model(x)
    finally:
        for h in handles:
            h.remove()
    return out, max(1, total[0] // max(1, x.shape[0]))


def jvp_plan(n_samples: int, chunk: int, batch: int, bytes_per_example: int, param_bytes: int,
             budget: int = JVP_BYTES) -> tuple[int, int]:
    """``(directions per JVP, examples per JVP)``: at most ``chunk`` directions, whose
    ``PARAM_COPIES x param_bytes`` each take at most half of ``budget``; then as many
    examples as fit in the rest at ``bytes_per_example`` per example and direction, rounded
    down to a divisor of ``batch`` (the actors' fixed-size batches,
    :mod:`pipelines.evaluation.chunks`, stay fixed-size inside the JVP); at least one of each,
    whatever the budget."""
    per_direction = PARAM_COPIES * max(0, param_bytes)
    k = max(1, min(chunk, n_samples, (budget // 2) // max(1, per_direction)))
    rest = budget - k * per_direction
    b = max(1, min(batch, rest // (k * max(1, bytes_per_example))))
    while batch % b:  # a divisor of the batch: every JVP has the same shape, whichever rows an example lands in
        b -= 1
    return k, b
