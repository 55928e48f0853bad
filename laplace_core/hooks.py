"""Capture layer inputs ``a`` and output gradients ``g`` for the registered layers.

For every layer of :func:`laplace_core.layers.find_layers` (``nn.Linear`` and
``nn.Conv2d`` with ``groups == 1``) one forward pass records

* the module's input ``x`` (a reference to the tensor autograd saves anyway), from
  which :func:`layer_inputs` builds the rows ``a_{k,t}`` of ``W~ = [W, b]``'s input
  (conv: ``F.unfold`` patches in ``weight.reshape(m, -1)`` order, plus a ones
  column when there is a bias), shape ``(B, T, n)``;
* the gradient edge of the module's output, and a **tensor hook** on that output
  that stores ``∂ loss / ∂ out`` during the backward pass; :func:`layer_output_grads`
  turns it into rows ``g_{k,t}`` of shape ``(B, T, m)``.

Why tensor hooks and gradient edges, not module full-backward hooks (DESIGN §5):
torchvision ResNets apply ``ReLU(inplace=True)`` right after a layer's output (or
after the BatchNorm that follows it); an in-place op rebases the output tensor's
history, which breaks ``register_full_backward_hook`` and makes
``torch.autograd.grad(loss, out)`` return the gradient of the *post*-ReLU value.
A hook registered on the tensor before the in-place op, and the edge
``(grad_fn, output_nr)`` taken at forward time, both keep referring to the
pre-in-place value. :meth:`Capture.backward` differentiates with respect to those
edges only, so autograd never computes weight gradients (``.grad`` is untouched).

A module called twice in one forward pass (weight sharing) has no single
``(a, g)`` pair per example; it raises a ``ValueError`` naming the layer.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge

__all__ = [
    "Capture",
    "capture",
    "conv_padding",
    "layer_inputs",
    "layer_output_grads",
    "num_positions",
]


# --------------------------------------------------------------------------- layouts
def conv_padding(module: nn.Conv2d) -> tuple[int, int, int, int]:
    """Explicit ``(left, right, top, bottom)`` zero padding of a Conv2d.

    Integer/tuple padding is symmetric. ``'valid'`` is zero. ``'same'`` (stride 1
    only, as in PyTorch) pads ``dilation * (k - 1)`` per dimension, the odd extra
    element on the right/bottom, which is what ``nn.Conv2d`` does.
    """
    pad = module.padding
    if isinstance(pad, str):
        if pad == "valid":
            return (0, 0, 0, 0)
        if pad == "same":
            out = []
            for d, k in ((module.dilation[1], module.kernel_size[1]), (module.dilation[0], module.kernel_size[0])):
                total = d * (k - 1)
                out += [total // 2, total - total // 2]
            return (out[0], out[1], out[2], out[3])
        raise ValueError(f"unknown conv padding {pad!r}; valid: 'same', 'valid' or integers")
    ph, pw = pad
    return (pw, pw, ph, ph)


def num_positions(module: nn.Module, x: torch.Tensor) -> int:
    """``T``: positions per example (conv: output pixels; Linear: product of the
    middle dimensions of a ``(B, *, in)`` input, 1 for a ``(B, in)`` input)."""
    if isinstance(module, nn.Conv2d):
        l, r, t, b = conv_padding(module)
        H, W = x.shape[-2] + t + b, x.shape[-1] + l + r
        (kh, kw), (sh, sw), (dh, dw) = module.kernel_size, module.stride, module.dilation
        return ((H - dh * (kh - 1) - 1) // sh + 1) * ((W - dw * (kw - 1) - 1) // sw + 1)
    T = 1
    for s in x.shape[1:-1]:
        T *= int(s)
    return T


def layer_inputs(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Rows ``a_{k,t}`` of the layer input, shape ``(B, T, n)``.

    Linear: ``x`` of shape ``(B, *, in)`` becomes ``(B, T, in)``. Conv2d:
    ``F.unfold`` patches ``(B, c_in*kh*kw, T)`` (the order of
    ``weight.reshape(m, -1)``), returned transposed as a view ``(B, T, c_in*kh*kw)``.
    With a bias a ones column is appended (then the result is contiguous).
    ``x`` must be batched (4-D for conv, at least 2-D for Linear).
    """
    if isinstance(module, nn.Conv2d):
        if x.dim() != 4:
            raise ValueError(f"Conv2d input must be 4-D (B, C, H, W) for curvature capture, got shape {tuple(x.shape)}")
        return _conv_rows(module, x)
    elif isinstance(module, nn.Linear):
        if x.dim() < 2:
            raise ValueError(f"Linear input must be batched (B, *, in) for curvature capture, got shape {tuple(x.shape)}")
        rows = x.reshape(x.shape[0], -1, x.shape[-1])
    else:
        raise ValueError(f"layer_inputs: unsupported module type {type(module).__name__}")
    if module.bias is not None:
        ones = rows.new_ones(rows.shape[0], rows.shape[1], 1)
        rows = torch.cat([rows, ones], dim=2)
    return rows


def _conv_rows(module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Contiguous patch rows ``(B, T, n)`` of a Conv2d input, bias column included."""
    pads = conv_padding(module)
    if any(pads):
        x = F.pad(x, pads)
    B, C, H, W = x.shape
    (kh, kw), (sh, sw), (dh, dw) = module.kernel_size, module.stride, module.dilation
    Ho = (H - dh * (kh - 1) - 1) // sh + 1
    Wo = (W - dw * (kw - 1) - 1) // sw + 1
    sB, sC, sH, sW = x.stride()
    windows = x.as_strided((B, Ho, Wo, C, kh, kw), (sB, sH * sh, sW * sw, sC, sH * dh, sW * dw), x.storage_offset())
    k = C * kh * kw
    if module.bias is None:
        return windows.reshape(B, Ho * Wo, k)
    rows = x.new_empty(B, Ho * Wo, k + 1)
    rows[:, :, :k].view(B, Ho, Wo, C, kh, kw).copy_(windows)
    rows[:, :, k] = 1
    return rows


def layer_output_grads(module: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """Rows ``g_{k,t}`` of the output gradient, shape ``(B, T, m)``.

    Conv2d: ``(B, m, H', W')`` becomes the view ``(B, m, T).transpose(1, 2)``.
    Linear: ``(B, *, m)`` becomes ``(B, T, m)``.
    """
    if isinstance(module, nn.Conv2d):
        return g.reshape(g.shape[0], g.shape[1], -1).transpose(1, 2)
    return g.reshape(g.shape[0], -1, g.shape[-1])


# --------------------------------------------------------------------------- capture
class Capture:
    """Per-forward record of inputs, output edges and output gradients.

    After a forward pass under :func:`capture`:

    * ``inputs[name]``: the module's input tensor (detached), e.g. ``(B, C, H, W)``;
    * ``edges[name]``: the gradient edge of the module's output;
    * after :meth:`backward`, ``grads[name]``: ``∂ output_sum / ∂ out`` with the
      output's shape (zeros for a layer that does not influence the output).

    :meth:`clear` (called automatically at the start of each forward of the root
    module) forgets everything, so one capture serves many batches.
    """

    def __init__(self, modules: Mapping[str, nn.Module]):
        self.modules: dict[str, nn.Module] = dict(modules)
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs_meta: dict[str, tuple[torch.Size, torch.dtype, torch.device]] = {}
        self.edges: dict[str, object] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self._order: list[str] = []

    def clear(self) -> None:
        self.inputs.clear()
        self.outputs_meta.clear()
        self.edges.clear()
        self.grads.clear()
        self._order.clear()

    # called by the forward hook
    def _record(self, name: str, module: nn.Module, args: tuple, out) -> None:
        if name in self.inputs:
            raise ValueError(
                f"layer {name!r} was called twice in one forward pass (weight sharing); "
                "per-example curvature needs one call per layer"
            )
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"layer {name!r} returned {type(out).__name__}, expected a tensor")
        x = args[0]
        self.inputs[name] = x.detach()
        self._order.append(name)
        if not out.requires_grad:
            # parameters frozen after find_layers or forward under no_grad: no gradient
            return
        self.outputs_meta[name] = (out.shape, out.dtype, out.device)
        self.edges[name] = get_gradient_edge(out)

        def hook(grad, _name=name):
            self.grads[_name] = grad

        out.register_hook(hook)

    @property
    def names(self) -> list[str]:
        """Layers seen in the last forward, in call order."""
        return list(self._order)

    def missing(self) -> list[str]:
        """Registered layers that were not called in the last forward pass."""
        return [k for k in self.modules if k not in self.inputs]

    def backward(self, outputs: torch.Tensor, grad_outputs: torch.Tensor | None = None, *, retain_graph: bool = False) -> dict[str, torch.Tensor]:
        """Back-propagate ``grad_outputs`` from ``outputs`` to the layer outputs only.

        Uses ``torch.autograd.grad`` with the recorded gradient edges as inputs:
        weight gradients are never formed and ``.grad`` attributes stay untouched.
        The tensor hooks fill ``grads``; layers that do not influence ``outputs`` get
        zeros. Returns ``grads`` (name -> tensor of the layer output's shape).
        """
        self.grads.clear()
        names = self.names
        no_grad = [k for k in names if k not in self.edges]
        if no_grad:
            raise ValueError(
                f"output of layer {no_grad[0]!r} does not require grad (frozen parameters or torch.no_grad?)"
            )
        res = torch.autograd.grad(
            outputs,
            inputs=[self.edges[k] for k in names],
            grad_outputs=grad_outputs,
            retain_graph=retain_graph,
            allow_unused=True,
        )
        for k, r in zip(names, res):
            if k not in self.grads:
                # the hook did not fire: the layer does not reach ``outputs``
                shape, dtype, device = self.outputs_meta[k]
                self.grads[k] = r if r is not None else torch.zeros(shape, dtype=dtype, device=device)
        return self.grads


@contextlib.contextmanager
def capture(model: nn.Module, modules: Mapping[str, nn.Module]) -> Iterator[Capture]:
    """Install forward hooks on ``modules`` (and a pre-hook on ``model`` that clears
    the record at every forward); remove them all on exit, also on error."""
    cap = Capture(modules)
    handles = [model.register_forward_pre_hook(lambda mod, args: cap.clear())]
    try:
        for name, mod in modules.items():
            handles.append(mod.register_forward_hook(lambda mod, args, out, _n=name: cap._record(_n, mod, args, out)))
        yield cap
    finally:
        for h in handles:
            h.remove()
