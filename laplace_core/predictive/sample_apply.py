"""Running a model under one posterior draw: the delta added to the weights, or to the outputs.

A draw gives each layer a delta ``δ = F z`` (``m x n``) for ``W~ = [W, b]``. For the
structures whose ``F z`` ends in two basis products, ``δ = L C R^T``
(:class:`~laplace_core.posteriors.structures.base.ScaleFactors`: KFAC, EFB, exact-prior KFAC), there
are two exact ways to compute ``f(x; θ* + δ)`` at that layer:

* **weights**: form ``δ = (L C) R^T`` (``m²n + mn²`` multiply-adds) and add it to the
  weights in place (:func:`laplace_core.curvature.layers.perturbed`, the MAP restored from a copy);
* **inputs**: keep the MAP weights and add ``δ x~`` to the layer's output, ``x~`` being
  the layer's input columns (``[x; 1]`` for ``nn.Linear``, ``[unfold(x); 1]`` for
  ``nn.Conv2d``, one column per example and output position):
  ``δ x~ = L (C (R^T x~))``, ``r (k n + n m + m²)`` multiply-adds for ``r`` columns
  (``k`` = ``n`` less the bias column), plus the unfold. Since
  ``(W + δ) x~ = W x~ + δ x~``, both give the same numbers up to rounding.

Inputs win when a layer sees fewer columns than it has outputs, roughly ``r < m``: the
last blocks of a ResNet on small images or small batches, or the classifier of a
1000-class model at usual batch sizes (resnet18 at 64x64, batch 32: layer4's convolutions
see 128 columns for ``m = 512``, and one KFAC draw drops from 91 to about 30 GFLOP).
:func:`input_space_cheaper` decides per layer at every call, from the shape of that
call's input, so a layer runs the same way for every batch of the same shape. Every
other draw (Diag, INF, subnet: no factored form) is added to the weights, as before.
The GEMMs run in the posterior's dtype, like the weight-space delta, and the result is
cast to the layer's output dtype. Nothing of size ``(mn) x anything`` is formed; the
extra memory is ``r x n`` per input-space layer.

Layer views (:mod:`laplace_core.curvature.layers`) have input-space routes of their own:

* **conv groups** (:class:`~laplace_core.curvature.layers.GroupView`): one hook pair on the grouped
  convolution; for every factored group ``k``, ``δ_k x~_k`` with ``x~_k`` the patches of
  that group's input channels (``[unfold(x[:, group k]); 1]``, the convolution's stride,
  padding and dilation, :func:`laplace_core.curvature.hooks.group_rows`), added to the group's output
  channels; the groups run as batched products. The convolution goes one way for all its
  factored groups, the cheaper by the summed :func:`draw_costs` (a group is rarely cheaper
  in input space: ``m/g`` outputs against ``T`` columns; depthwise: one output).
* **tapped projections** (:class:`~laplace_core.curvature.layers.InProjView`, the packed q/k/v
  projection of ``nn.MultiheadAttention``; :class:`~laplace_core.curvature.layers.TapView`, a linear
  layer its parent applies with ``F.linear``): a ``TorchFunctionMode`` active inside the
  block sees every ``F.linear`` call whose weight is such a layer's parameter (by identity)
  and adds ``δ x~`` (``x~ = [x; 1]`` over the last axis, any leading shape) to its result,
  or, when the weights are cheaper for that call, calls it with ``W + δ``. Inside the mode,
  ``F.multi_head_attention_forward`` of an attention block with such a layer runs as
  :func:`laplace_core.curvature.hooks.mha_forward` (the same attention with visible ``F.linear``
  calls); the calls that one does not handle (cross-attention, separate q/k/v weights,
  ``bias_k``, zero attention, dropout in training, unbatched inputs) take the weight route,
  ``W + δ`` passed as the projection arguments of the library function.

Any other view (ConvNeXt's layer scale: never factored) takes the weight route.
"""
from __future__ import annotations

import contextlib
import inspect
import math
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn.functional as tF
from torch import nn
from torch.overrides import TorchFunctionMode

from ..curvature.hooks import group_rows, mha_forward, num_positions
from ..curvature.layers import GroupView, LayerView, is_tapped, perturbed
from ..posteriors.structures.base import ScaleFactors

__all__ = ["SAMPLE_SPACES", "input_space_cheaper", "draw_costs", "applied"]

SAMPLE_SPACES = ("auto", "weights", "inputs")
"""``auto``: the cheaper per layer and call (:func:`input_space_cheaper`); ``weights``:
always add the delta to the weights; ``inputs``: always add ``δ x~`` to the output where
the layer allows it (tests, benchmarks)."""


def draw_costs(m: int, n: int, k: int, columns: int) -> tuple[int, int]:
    """Multiply-adds to apply a factored delta ``L C R^T`` (``m x n``, ``k`` weight columns)
    ``(weights, inputs)``: ``m n (m + n)`` to form it, ``columns (k n + n m + m m)`` to apply
    it to ``columns`` input columns (plus ``columns k`` for copying them)."""
    return m * n * (m + n), columns * (k * n + n * m + m * m + k)


def input_space_cheaper(m: int, n: int, k: int, columns: int) -> bool:
    """Whether ``δ x~`` on ``columns`` columns costs fewer multiply-adds than forming ``δ``."""
    weights, inputs = draw_costs(m, n, k, columns)
    return inputs < weights


def _output_positions(module: nn.Module, x: torch.Tensor) -> tuple[int, ...] | None:
    """The output's shape less its channel/feature axis (``(B, H', W')`` for a convolution,
    ``x.shape[:-1]`` for a linear layer), i.e. where the input columns come from; ``None``
    when this layer/input cannot be handled in input space (the delta goes to the weights)."""
    if isinstance(module, nn.Linear):
        return tuple(x.shape[:-1])
    if isinstance(module, nn.Conv2d):
        if x.dim() != 4 or module.groups != 1 or module.padding_mode != "zeros" or isinstance(module.padding, str):
            return None
        return (x.shape[0], *(
            (size + 2 * p - d * (kk - 1) - 1) // s + 1
            for size, p, d, kk, s in zip(x.shape[2:], module.padding, module.dilation, module.kernel_size, module.stride)
        ))
    return None


def _input_rows(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's input columns ``x`` (without the bias entry) as rows ``(r, k)``, in the
    order of :func:`_output_positions` (``F.unfold`` for a convolution)."""
    if isinstance(module, nn.Conv2d):
        cols = tF.unfold(x, module.kernel_size, dilation=module.dilation, padding=module.padding, stride=module.stride)
        return cols.transpose(1, 2).reshape(-1, cols.shape[1])
    return x.reshape(-1, x.shape[-1])


def _rows_delta(X: torch.Tensor, f: ScaleFactors, bias: bool) -> torch.Tensor:
    """``(δ x~)^T`` for input rows ``X`` ``(r, k)`` (the bias entry of ``x~``, when there is
    one, is 1): ``((X R_{:k} + R_k) C^T) L^T``, ``(r, m)``, in the factors' dtype."""
    R, C, Lf = f.right, f.core[0] if f.core.dim() == 3 else f.core, f.left
    k = X.shape[1]
    Y = X.to(R.dtype) @ R[:k]  # (r, n): R^T x~ without the bias column ...
    if bias:
        Y = Y + R[k]  # ... whose entry of x~ is 1
    return (Y @ C.T) @ Lf.T


def _output_delta(module: nn.Module, x: torch.Tensor, positions: tuple[int, ...], f: ScaleFactors) -> torch.Tensor:
    """``δ x~`` for the layer's input ``x``, in the layer's output shape."""
    Y = _rows_delta(_input_rows(module, x), f, module.bias is not None)
    Y = Y.reshape(*positions, Y.shape[-1])
    return Y.permute(0, 3, 1, 2) if isinstance(module, nn.Conv2d) else Y


def _group_delta(conv: nn.Conv2d, x: torch.Tensor, groups: list[tuple[int, ScaleFactors]]) -> torch.Tensor:
    """``δ_k x~_k`` of the listed groups ``(k, factors)`` of a grouped convolution, in its
    output layout ``(B, m, T)`` (zero in the other groups' channels): the group rows
    ``(B, T, g, n)`` (:func:`~laplace_core.curvature.hooks.group_rows`, bias column included) times
    ``R_k``, ``C_k^T``, ``L_k^T``, one batched product over the groups each."""
    idx = [k for k, _ in groups]
    a = group_rows(conv, x)
    if len(idx) < conv.groups:
        a = a[:, :, idx]
    B, T, gs, n = a.shape
    R = torch.stack([f.right for _, f in groups])
    C = torch.stack([f.core[0] if f.core.dim() == 3 else f.core for _, f in groups])
    L = torch.stack([f.left for _, f in groups])
    A = a.permute(2, 0, 1, 3).reshape(gs, B * T, n).to(R.dtype)
    Y = torch.bmm(torch.bmm(torch.bmm(A, R), C.transpose(1, 2)), L.transpose(1, 2))  # (gs, B T, m/g)
    mg = Y.shape[-1]
    Y = Y.reshape(gs, B, T, mg).permute(1, 0, 3, 2)  # (B, gs, m/g, T)
    if gs == conv.groups:
        return Y.reshape(B, gs * mg, T)
    out = Y.new_zeros(B, conv.groups, mg, T)
    out[:, idx] = Y
    return out.reshape(B, conv.groups * mg, T)


_MHA_SIGNATURE = inspect.signature(mha_forward)


def _mha_handled(a: Mapping[str, Any]) -> bool:
    """Whether :func:`~laplace_core.curvature.hooks.mha_forward` runs this attention call (bound
    arguments of ``F.multi_head_attention_forward``)."""
    q = a["query"]
    return (q is a["key"] and q is a["value"] and isinstance(q, torch.Tensor) and q.dim() == 3
            and not a["use_separate_proj_weight"] and a["bias_k"] is None and not a["add_zero_attn"]
            and a["static_k"] is None and a["static_v"] is None and not (a["training"] and a["dropout_p"] > 0))


class _TapApply(TorchFunctionMode):
    """Applies factored draws of tapped layers at their ``F.linear`` calls (module docstring).

    ``taps``: ``id(weight parameter) -> (name, view, factors)``; ``prefer_inputs(f, k,
    columns, device)`` decides a call's route, ``delta(name)`` forms a draw's ``m x n`` delta
    (once per block), ``note(name, mode)`` records the route. An attention call whose tapped
    layers all take the weight route runs the library function with ``W + δ`` (its fused
    attention), not :func:`~laplace_core.curvature.hooks.mha_forward`."""

    def __init__(self, taps: Mapping[int, tuple[str, LayerView, ScaleFactors]], prefer_inputs: Callable,
                 delta: Callable[[str], torch.Tensor], note: Callable[[str, str], None]):
        super().__init__()
        self.taps, self.prefer_inputs, self.delta, self.note = dict(taps), prefer_inputs, delta, note

    def _shifted(self, name: str, w: torch.Tensor, b: torch.Tensor | None):
        """``(W + δ_W, b + δ_b)`` for the weight route of a call."""
        d = self.delta(name)
        k = w[0].numel()
        w2 = w + d[:, :k].reshape(w.shape).to(device=w.device, dtype=w.dtype)
        return w2, (None if b is None else b + d[:, k].to(device=b.device, dtype=b.dtype))

    def _linear(self, func, tap, args, kwargs):
        name, view, f = tap
        x = args[0] if args else kwargs["input"]
        w = args[1] if len(args) > 1 else kwargs["weight"]
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        bias = view.bias is not None
        k = x.shape[-1]
        inputs = self.prefer_inputs(f, k, x.numel() // max(k, 1), x.device)
        self.note(name, "inputs" if inputs else "weights")
        if inputs:
            out = func(x, w, b)
            d = _rows_delta(x.reshape(-1, k), f, bias).reshape(*x.shape[:-1], -1)
            return out + d.to(out.dtype)
        return func(x, *self._shifted(name, w, b))

    def _attention(self, func, args, kwargs):
        ba = _MHA_SIGNATURE.bind(*args, **kwargs)
        ba.apply_defaults()
        a = ba.arguments
        ours = [(wk, bk) for wk, bk in (("in_proj_weight", "in_proj_bias"), ("out_proj_weight", "out_proj_bias"))
                if id(a[wk]) in self.taps]
        if not ours:
            return func(*args, **kwargs)
        if _mha_handled(a) and any(self.prefer_inputs(self.taps[id(a[wk])][2], a[wk][0].numel(),
                                                       a["query"].shape[0] * a["query"].shape[1], a["query"].device)
                                   for wk, _ in ours):
            with self:  # its F.linear calls come back to this mode
                return mha_forward(*args, **kwargs)
        for wk, bk in ours:  # weight route through the library function's projection arguments
            name = self.taps[id(a[wk])][0]
            a[wk], a[bk] = self._shifted(name, a[wk], a[bk])
            self.note(name, "weights")
        return func(**a)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is tF.multi_head_attention_forward:
            return self._attention(func, args, kwargs)
        if func is tF.linear:
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            tap = self.taps.get(id(w))
            if tap is not None:
                return self._linear(func, tap, args, kwargs)
        return func(*args, **kwargs)


def _split_draw(modules: Mapping[str, nn.Module], draw: Mapping[str, Any], space: str,
                used: dict[str, str] | None) -> tuple[dict, dict, dict]:
    """``(plain, factored, views)``: the deltas added to the weights as they are, the factored
    draws of plain layers and those of layer views. ``space="weights"`` forms every factored
    delta here, so only ``plain`` is left."""
    plain = {k: v for k, v in draw.items() if not isinstance(v, ScaleFactors)}
    factored = {k: v for k, v in draw.items() if isinstance(v, ScaleFactors)}
    views = {k: factored.pop(k) for k in [k for k in factored if isinstance(modules[k], LayerView)]}
    if space == "weights":
        plain.update({k: f.matrix().reshape(f.core.shape[-2:]) for k, f in {**factored, **views}.items()})
        if used is not None:
            used.update({k: "weights" for k in views})
        factored, views = {}, {}
    return plain, factored, views


def _route_views(modules: Mapping[str, nn.Module], views: Mapping[str, ScaleFactors], plain: dict,
                 used: dict[str, str] | None) -> tuple[dict, dict]:
    """``(groups, taps)``: the factored views grouped by their grouped convolution
    (``id(conv) -> (conv, name -> (group index, factors))``) and the tapped projections
    (``id(weight) -> (name, view, factors)``); any other view's delta goes to ``plain``."""
    groups: dict[int, tuple[nn.Conv2d, dict[str, tuple[int, ScaleFactors]]]] = {}
    taps: dict[int, tuple[str, LayerView, ScaleFactors]] = {}
    for k, f in views.items():
        view = modules[k]
        if isinstance(view, GroupView):
            groups.setdefault(id(view.parent), (view.parent, {}))[1][k] = (view.index, f)
        elif is_tapped(view):
            taps[id(getattr(view.parent, view.weight_name))] = (k, view, f)
        else:  # no input-space route
            plain[k] = f.matrix().reshape(f.core.shape[-2:])
            if used is not None:
                used[k] = "weights"
    return groups, taps


class _FactoredBlock:
    """What one :func:`applied` block shares between its hooks: the factored draws
    (``every``), the deltas formed so far (once per block), the state open between a
    pre- and a post-hook (``live``: the weight-space context, or the input) and the routes
    taken (``used``)."""

    def __init__(self, modules: Mapping[str, nn.Module], every: Mapping[str, ScaleFactors], space: str,
                 used: dict[str, str] | None):
        self.modules, self.every, self.space, self.used = modules, every, space, used
        self.live: dict[Any, Any] = {}  # name -> the open weight-space context, or the input (a tuple)
        self.formed: dict[str, torch.Tensor] = {}  # name -> delta, formed once per block for every call that needs it

    def delta(self, name: str) -> torch.Tensor:
        if name not in self.formed:
            f = self.every[name]
            self.formed[name] = f.matrix().reshape(f.core.shape[-2:])
        return self.formed[name]

    def note(self, name: str, mode: str) -> None:
        if self.used is not None:
            self.used[name] = mode

    def prefer_inputs(self, f: ScaleFactors, k: int, columns: int, device) -> bool:
        return f.right.device == device and (self.space == "inputs" or input_space_cheaper(*f.core.shape[-2:], k, columns))

    def _open_weights(self, key, modules: Mapping[str, nn.Module], names) -> None:
        ctx = perturbed(modules, {k: self.delta(k) for k in names})
        ctx.__enter__()
        self.live[key] = ctx

    def layer_hooks(self, name: str, f: ScaleFactors):
        """The hook pair of a factored plain layer: inputs or weights, decided per call."""
        mod = self.modules[name]

        def pre(module, args):
            x = args[0]
            positions = _output_positions(module, x) if f.right.device == x.device else None
            m, n = f.core.shape[-2:]
            k = n - (module.bias is not None)
            columns = 0 if positions is None else math.prod(positions)
            if positions is not None and (self.space == "inputs" or input_space_cheaper(m, n, k, columns)):
                self.live[name] = (x, positions)
                mode = "inputs"
            else:
                self._open_weights(name, {name: module}, [name])
                mode = "weights"
            self.note(name, mode)

        def post(module, args, output):
            state = self.live.pop(name)
            if isinstance(state, tuple):
                return output + _output_delta(module, *state, f).to(output.dtype)
            state.__exit__(None, None, None)
            return None

        return mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)

    def group_hooks(self, conv: nn.Conv2d, members: dict[str, tuple[int, ScaleFactors]]):
        """The hook pair of a grouped convolution: all its factored groups one way per call."""
        key = ("groups", id(conv))
        bias = conv.bias is not None

        def pre(module, args):
            x = args[0]
            inputs = x.dim() == 4 and all(f.right.device == x.device for _, f in members.values())
            if inputs and self.space != "inputs":
                columns = x.shape[0] * num_positions(conv, x)
                costs = [draw_costs(*f.core.shape[-2:], f.core.shape[-1] - bias, columns) for _, f in members.values()]
                inputs = sum(c[1] for c in costs) < sum(c[0] for c in costs)
            if inputs:
                self.live[key] = (x,)
            else:
                self._open_weights(key, {k: self.modules[k] for k in members}, members)
            for k in members:
                self.note(k, "inputs" if inputs else "weights")

        def post(module, args, output):
            state = self.live.pop(key)
            if isinstance(state, tuple):
                d = _group_delta(conv, state[0], sorted(members.values(), key=lambda e: e[0]))
                return output + d.reshape(output.shape).to(output.dtype)
            state.__exit__(None, None, None)
            return None

        return conv.register_forward_pre_hook(pre), conv.register_forward_hook(post)

    def close(self) -> None:
        """Restore the weights of a forward that raised between a pre- and a post-hook."""
        for state in self.live.values():
            if not isinstance(state, tuple):
                state.__exit__(None, None, None)


@contextlib.contextmanager
def applied(
    modules: Mapping[str, nn.Module],
    draw: Mapping[str, Any],
    space: str = "auto",
    used: dict[str, str] | None = None,
) -> Iterator[None]:
    """Run ``modules``' model inside this block under ``draw``: ``name ->`` delta ``(m, n)``
    (added to the weights, as :func:`~laplace_core.curvature.layers.perturbed`) or
    :class:`ScaleFactors` with a ``(1, m, n)`` or ``(m, n)`` core (weights or inputs, per
    ``space`` and each call's input shape; layer views as in the module docstring).
    ``used`` (optional) receives ``name -> "weights" / "inputs"`` for the factored layers'
    last call. The MAP weights are restored exactly on exit, and after every weight-space
    call of a factored layer; a factored delta is formed at most once per block, however
    many batches run inside it."""
    if space not in SAMPLE_SPACES:
        raise ValueError(f"unknown sample space {space!r}; valid: {', '.join(SAMPLE_SPACES)}")
    plain, factored, views = _split_draw(modules, draw, space, used)
    groups, taps = _route_views(modules, views, plain, used)
    block = _FactoredBlock(modules, {**factored, **views}, space, used)
    handles = []
    try:
        for name, f in factored.items():
            handles.extend(block.layer_hooks(name, f))
        for conv, members in groups.values():
            handles.extend(block.group_hooks(conv, members))
        with contextlib.ExitStack() as stack:
            stack.enter_context(perturbed(modules, plain))
            if taps:
                stack.enter_context(_TapApply(taps, block.prefer_inputs, block.delta, block.note))
            yield
    finally:
        for h in handles:
            h.remove()
        block.close()
