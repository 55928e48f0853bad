"""Capture layer inputs ``a`` and output gradients ``g`` for the registered layers.

For every layer of :func:`laplace_core.curvature.layers.find_layers` (``nn.Linear``, ``nn.Conv2d``
and the layer views: conv groups, attention projections) one forward pass records

* the module's input ``x`` (a reference to the tensor autograd saves anyway), from
  which :func:`layer_inputs` builds the rows ``a_{k,t}`` of ``W~ = [W, b]``'s input
  (conv: ``F.unfold`` patches in ``weight.reshape(m, -1)`` order, plus a ones
  column when there is a bias), shape ``(B, T, n)``;
* the gradient edge of the module's output, and a **tensor hook** on that output
  that stores ``∂ loss / ∂ out`` during the backward pass; :func:`layer_output_grads`
  turns it into rows ``g_{k,t}`` of shape ``(B, T, m)``.

Why tensor hooks and gradient edges, not module full-backward hooks (docs/design.md §5):
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

Layer views (:mod:`laplace_core.curvature.layers`): the ``g`` groups of a grouped convolution
share one forward hook on the convolution and one output edge; each group's rows are
its channel slices of that input and output gradient. *Tapped* layers (the packed
q/k/v projection of ``nn.MultiheadAttention``, its ``out_proj``, Swin's ``qkv`` /
``proj``) are applied with ``F.linear`` by their parent, so no module hook fires: a
``TorchFunctionMode`` active during the capture sees every ``F.linear`` call whose
weight is a tapped parameter (by identity) and records its input and output edge like a
module hook would. Their inputs are ``(B·w, ..., n)`` with the examples outermost
(Swin's windows of one image follow each other), so rows are ``x.reshape(B, -1, n)``
with ``B`` the model input's batch size; the same for an ``nn.Linear`` module called on such
inputs (timm's Swin). timm's norm + activation layers are recorded at their ``drop``'s input. ``F.multi_head_attention_forward`` itself is
replaced, under the mode only, by :func:`mha_forward` (same signature, same numbers:
self-attention, batch-major ``F.linear`` calls on ``(N, L, E)``), because the mode
could not see the calls inside the library function.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.overrides import TorchFunctionMode

from .layers import GroupView, LayerKind, ScaleView, affine_output_child, is_free, is_tapped, layer_kind
from .norm_rows import norm_grads
from .sdpa_reference import sdpa_reference

__all__ = [
    "Capture",
    "capture",
    "conv_output_hw",
    "conv_padding",
    "layer_inputs",
    "layer_output_grads",
    "group_output_grads",
    "group_rows",
    "mha_forward",
    "norm_grads",
    "num_positions",
    "reference_attention",
    "rows_from_windows",
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
    if layer_kind(module) is LayerKind.CONV2D:
        l, r, t, b = conv_padding(module)
        Ho, Wo = conv_output_hw(module, x.shape[-2] + t + b, x.shape[-1] + l + r)
        return Ho * Wo
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
    kind = layer_kind(module)
    if kind is LayerKind.CONV2D:
        if x.dim() != 4:
            raise ValueError(f"Conv2d input must be 4-D (B, C, H, W) for curvature capture, got shape {tuple(x.shape)}")
        if isinstance(module, GroupView):
            x = x[:, module.channels]
        return _conv_rows(module, x)
    elif kind is LayerKind.LINEAR:
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
    Ho, Wo = conv_output_hw(module, H, W)
    sB, sC, sH, sW = x.stride()
    windows = x.as_strided((B, Ho, Wo, C, kh, kw), (sB, sH * sh, sW * sw, sC, sH * dh, sW * dw), x.storage_offset())
    return rows_from_windows(windows, module.bias is not None)


def conv_output_hw(module, H: int, W: int) -> tuple[int, int]:
    """``(Ho, Wo)`` of a convolution over an already padded ``H x W`` input."""
    (kh, kw), (sh, sw), (dh, dw) = module.kernel_size, module.stride, module.dilation
    return (H - dh * (kh - 1) - 1) // sh + 1, (W - dw * (kw - 1) - 1) // sw + 1


def rows_from_windows(windows: torch.Tensor, bias: bool) -> torch.Tensor:
    """Rows ``(B, Ho·Wo, k)`` of patch windows ``(B, Ho, Wo, *patch)``, a ones column added for a bias."""
    B, Ho, Wo = windows.shape[:3]
    k = math.prod(windows.shape[3:])
    if not bias:
        return windows.reshape(B, Ho * Wo, k)
    rows = windows.new_empty(B, Ho * Wo, k + 1)
    rows[:, :, :k].view(windows.shape).copy_(windows)
    rows[:, :, k] = 1
    return rows


def group_rows(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Patch rows of every group of a grouped ``Conv2d`` at once, ``(B, T, g, n)``: entry
    ``[:, :, k]`` is :func:`layer_inputs` of group ``k``'s :class:`~laplace_core.curvature.layers.GroupView`
    (its input channels' patches, then the ones column when there is a bias)."""
    pads = conv_padding(conv)
    if any(pads):
        x = F.pad(x, pads)
    B, C, H, W = x.shape
    g = conv.groups
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
    Ho, Wo = conv_output_hw(conv, H, W)
    sB, sC, sH, sW = x.stride()
    windows = x.as_strided((B, Ho, Wo, C, kh, kw), (sB, sH * sh, sW * sw, sC, sH * dh, sW * dw), x.storage_offset())
    cg = C // g
    k = cg * kh * kw
    rows = x.new_empty(B, Ho * Wo, g, k + (conv.bias is not None))
    rows[..., :k].view(B, Ho, Wo, g, cg, kh, kw).copy_(windows.unflatten(3, (g, cg)))
    if conv.bias is not None:
        rows[..., k] = 1
    return rows


def group_output_grads(conv: nn.Conv2d, g: torch.Tensor) -> torch.Tensor:
    """Output-gradient rows of every group at once, ``(B, T, g, m/g)`` (a view)."""
    B = g.shape[0]
    return g.reshape(B, conv.groups, conv.out_channels // conv.groups, -1).permute(0, 3, 1, 2)


def layer_output_grads(module: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """Rows ``g_{k,t}`` of the output gradient, shape ``(B, T, m)``.

    Conv2d: ``(B, m, H', W')`` becomes the view ``(B, m, T).transpose(1, 2)``; a conv group
    (:class:`~laplace_core.curvature.layers.GroupView`) takes its output channels of the whole
    convolution's gradient first. Linear: ``(B, *, m)`` becomes ``(B, T, m)``.
    """
    if layer_kind(module) is LayerKind.CONV2D:
        if isinstance(module, GroupView):
            g = g[:, module.rows]
        return g.reshape(g.shape[0], g.shape[1], -1).transpose(1, 2)
    return g.reshape(g.shape[0], -1, g.shape[-1])


# --------------------------------------------------------------------------- attention
def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def mha_forward(query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias, bias_k, bias_v,
                add_zero_attn, dropout_p, out_proj_weight, out_proj_bias, training=True, key_padding_mask=None,
                need_weights=True, attn_mask=None, use_separate_proj_weight=False, q_proj_weight=None,
                k_proj_weight=None, v_proj_weight=None, static_k=None, static_v=None, average_attn_weights=True,
                is_causal=False):
    """``F.multi_head_attention_forward`` for batched self-attention (``query is key is
    value``, ``(L, N, E)``), written with two batch-major ``F.linear`` calls that the capture
    can see: ``qkv = F.linear(x, W_in, b_in)`` on ``x = query^T`` ``(N, L, E)`` and
    ``F.linear(o, W_out, b_out)`` on the heads' concatenated outputs ``(N, L, E)``;
    ``softmax(q k^T / √d + masks) v`` per head in between. Anything else (cross-attention,
    separate projections, bias_k/v, zero attention, dropout in training) raises ``ValueError``."""
    if not (query is key and key is value):
        raise ValueError("attention in_proj capture supports self-attention only (query is key is value)")
    if use_separate_proj_weight or bias_k is not None or add_zero_attn or static_k is not None or static_v is not None:
        raise ValueError("attention in_proj capture does not support separate projections, bias_k/v, "
                         "add_zero_attn or static keys")
    if training and dropout_p > 0:
        raise ValueError("attention in_proj capture needs eval mode (dropout off)")
    if query.dim() != 3:
        raise ValueError(f"attention in_proj capture needs batched input (L, N, E), got shape {tuple(query.shape)}")
    L, N, E = query.shape
    if E != embed_dim_to_check:
        raise ValueError(f"attention input has embedding size {E}, expected {embed_dim_to_check}")
    H = num_heads
    d = E // H
    qkv = F.linear(query.transpose(0, 1), in_proj_weight, in_proj_bias)  # (N, L, 3E)
    q, k, v = qkv.unflatten(-1, (3, H, d)).permute(2, 0, 3, 1, 4)  # each (N, H, L, d)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)  # (N, H, L, L)
    am = _float_mask(attn_mask, scores.dtype)
    if am is not None:
        scores = scores + (am.view(N, H, L, L) if am.dim() == 3 else am)
    elif is_causal:
        scores = scores + torch.full((L, L), float("-inf"), dtype=scores.dtype, device=scores.device).triu_(1)
    kp = _float_mask(key_padding_mask, scores.dtype)
    if kp is not None:
        scores = scores + kp.view(N, 1, 1, L)
    attn = torch.softmax(scores, dim=-1)
    o = (attn @ v).permute(0, 2, 1, 3).reshape(N, L, E)
    out = F.linear(o, out_proj_weight, out_proj_bias).transpose(0, 1)  # (L, N, E)
    if not need_weights:
        return out, None
    return out, (attn.mean(1) if average_attn_weights else attn)


class _Tap(TorchFunctionMode):
    """Sees ``F.linear(x, W, b)`` for the tapped weights (by identity) and records them;
    runs ``F.multi_head_attention_forward`` as :func:`mha_forward` (``cap`` None: only that)."""

    def __init__(self, cap: "Capture | None", by_weight: Mapping[int, str]):
        super().__init__()
        self.cap, self.by_weight = cap, dict(by_weight)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward:
            with self:
                return mha_forward(*args, **kwargs)
        if func is F.scaled_dot_product_attention and self.cap is None:
            return sdpa_reference(*args, **kwargs)
        out = func(*args, **kwargs)
        if func is F.linear:
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            name = self.by_weight.get(id(w))
            if name is not None and self.cap is not None:
                self.cap._record_tap(name, args[0] if args else kwargs["input"], out)
        return out


@contextlib.contextmanager
def reference_attention(model: nn.Module) -> Iterator[None]:
    """Inside the block, ``nn.MultiheadAttention`` runs :func:`mha_forward` and
    ``F.scaled_dot_product_attention`` (timm's attention) :func:`~laplace_core.curvature.sdpa_reference.sdpa_reference`
    (plain autograd ops, forward-mode AD included) instead of their fused kernels.
    ``torch.func.jvp`` needs it: the fused kernels have no forward-mode derivative."""
    with _Tap(None, {}):
        yield


# --------------------------------------------------------------------------- capture
class Capture:
    """Per-forward record of inputs, output edges and output gradients.

    After a forward pass under :func:`capture`:

    * ``inputs[name]``: the layer's input tensor (detached), e.g. ``(B, C, H, W)`` (a conv
      group: the whole convolution's input; a tapped linear: ``(B, T, n)``);
    * ``edges[source]``: the gradient edge of each hooked output (a module's, or a tapped
      ``F.linear``'s); the groups of one convolution share one source;
    * after :meth:`backward`, ``grads[name]``: ``∂ output_sum / ∂ out`` with the
      output's shape (zeros for a layer that does not influence the output).

    :meth:`clear` (called automatically at the start of each forward of the root
    module) forgets everything, so one capture serves many batches. Free parameters
    (:class:`~laplace_core.curvature.layers.FreeView`) are not captured; forwards inside
    :meth:`paused` (their ``torch.func`` gradients) record and clear nothing.
    """

    def __init__(self, modules: Mapping[str, nn.Module]):
        self.modules: dict[str, nn.Module] = {k: m for k, m in modules.items() if not is_free(m)}
        self.off = False
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs_meta: dict[str, tuple[torch.Size, torch.dtype, torch.device]] = {}
        self.edges: dict[str, object] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.batch_size: int | None = None
        self._src_grads: dict[str, torch.Tensor] = {}
        self._src_of: dict[str, str] = {}
        self._order: list[str] = []

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards inside the block are not recorded (and do not clear the record)."""
        self.off = True
        try:
            yield
        finally:
            self.off = False

    def clear(self) -> None:
        self.inputs.clear()
        self.outputs_meta.clear()
        self.edges.clear()
        self.grads.clear()
        self._src_grads.clear()
        self._src_of.clear()
        self._order.clear()

    def _start(self, src: str, names: list[str], x: torch.Tensor, out) -> bool:
        for name in names:
            if name in self.inputs:
                raise ValueError(
                    f"layer {name!r} was called twice in one forward pass (weight sharing); "
                    "per-example curvature needs one call per layer"
                )
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"layer {names[0]!r} returned {type(out).__name__}, expected a tensor")
        for name in names:
            self.inputs[name] = x
            self._src_of[name] = src
            self._order.append(name)
        return out.requires_grad  # False: parameters frozen after find_layers or forward under no_grad

    def _hook_output(self, src: str, out: torch.Tensor, shape_fn=None) -> None:
        shape = out.shape if shape_fn is None else shape_fn(out).shape
        self.outputs_meta[src] = (shape, out.dtype, out.device)
        self.edges[src] = get_gradient_edge(out)

        def hook(grad, _src=src):
            self._src_grads[_src] = grad if shape_fn is None else shape_fn(grad)

        out.register_hook(hook)

    # called by the forward hooks
    def _record(self, name: str, module: nn.Module, args: tuple, out, names: list[str] | None = None) -> None:
        if self.off:
            return
        x, B, rows = args[0].detach(), self.batch_size, None
        if isinstance(module, nn.Linear) and B and x.dim() > 2 and x.shape[0] != B and x.shape[0] % B == 0:
            rows = lambda t: t.reshape(B, -1, t.shape[-1])  # noqa: E731 (timm Swin's windows, example-major)
        if self._start(name, names or [name], x if rows is None else rows(x), out):
            self._hook_output(name, out, rows)

    def _record_tap(self, name: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.off:
            return
        B = self.batch_size
        if B is None or x.dim() < 2 or x.shape[0] % B:
            raise ValueError(f"layer {name!r}: F.linear input of shape {tuple(x.shape)} does not split into "
                             f"the batch's {B} examples")
        if self._start(name, [name], x.detach().reshape(B, -1, x.shape[-1]), out):
            self._hook_output(name, out, lambda t: t.reshape(B, -1, t.shape[-1]))

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
        self._src_grads.clear()
        names = self.names
        no_grad = [k for k in names if self._src_of[k] not in self.edges]
        if no_grad:
            raise ValueError(
                f"output of layer {no_grad[0]!r} does not require grad (frozen parameters or torch.no_grad?)"
            )
        srcs = list(dict.fromkeys(self._src_of[k] for k in names))
        res = torch.autograd.grad(
            outputs,
            inputs=[self.edges[s] for s in srcs],
            grad_outputs=grad_outputs,
            retain_graph=retain_graph,
            allow_unused=True,
        )
        for s, r in zip(srcs, res):
            if s not in self._src_grads:
                # the hook did not fire: the layer does not reach ``outputs``
                shape, dtype, device = self.outputs_meta[s]
                self._src_grads[s] = r.reshape(shape) if r is not None else torch.zeros(shape, dtype=dtype, device=device)
        for k in names:
            self.grads[k] = self._src_grads[self._src_of[k]]
        return self.grads


def _split_hooks(cap: Capture, name: str, layer, held: dict) -> list:
    """Hooks of a layer whose input and output edge are two modules' tensors: a layer scale (input:
    its block's output; edge: the parent's output) or timm's norm + act (input: the module's; edge:
    its ``drop``'s input, the affine output before the activation)."""
    if isinstance(layer, ScaleView):
        return [layer.parent.block.register_forward_hook(lambda m, args, out: held.__setitem__(name, out.detach())),
                layer.parent.register_forward_hook(lambda m, args, out: cap._record(name, m, (held.pop(name),), out))]
    return [layer.register_forward_pre_hook(lambda m, args: held.__setitem__(name, args[0])),
            affine_output_child(layer).register_forward_pre_hook(
                lambda m, args: cap._record(name, layer, (held.pop(name),), args[0]))]


@contextlib.contextmanager
def capture(model: nn.Module, modules: Mapping[str, nn.Module]) -> Iterator[Capture]:
    """Install forward hooks on ``modules`` (one per convolution for its groups), a
    ``F.linear`` tap for the tapped layers, and a pre-hook on ``model`` that clears the
    record at every forward; remove them all on exit, also on error."""
    cap = Capture(modules)

    def pre(mod, args):
        if cap.off:
            return
        cap.clear()
        cap.batch_size = int(args[0].shape[0]) if args and isinstance(args[0], torch.Tensor) and args[0].dim() else None

    handles = [model.register_forward_pre_hook(pre)]
    taps: dict[int, str] = {}
    groups: dict[int, tuple[nn.Module, list[str]]] = {}
    block_out: dict[str, torch.Tensor] = {}
    for name, layer in cap.modules.items():
        if isinstance(layer, ScaleView) or affine_output_child(layer) is not None:
            handles.extend(_split_hooks(cap, name, layer, block_out))
        elif is_tapped(layer):
            taps[id(getattr(layer.parent, layer.weight_name))] = name
        elif isinstance(layer, GroupView):
            groups.setdefault(id(layer.parent), (layer.parent, []))[1].append(name)
        else:
            groups[id(layer)] = (layer, [name])
    mode = _Tap(cap, taps) if taps else None
    try:
        for mod, names in groups.values():
            src = names[0] if len(names) == 1 else f"{names[0]}#source"
            handles.append(mod.register_forward_hook(
                lambda m, args, out, _s=src, _n=names: cap._record(_s, m, args, out, _n)))
        if mode is not None:
            with mode:
                yield cap
        else:
            yield cap
    finally:
        for h in handles:
            h.remove()
