"""Which modules carry a posterior, and the ``W~ = [W, b]`` view of their parameters.

docs/design.md §1: curvature covers the weights and biases of every ``nn.Linear`` and every
``nn.Conv2d``, and the linear maps inside attention blocks. The registry below is
explicit; any other module that owns parameters (BatchNorm, ...) stays a point estimate
and is listed in ``excluded`` with the reason, never silently dropped.

A curvature *layer* is either the module itself (``nn.Linear``, ``nn.Conv2d`` with
``groups == 1``) or a **layer view** (:class:`LayerView`) on part of a module's
parameters, with the same ``.weight`` / ``.bias`` interface (tensors sliced from the
owning parameters along dim 0, so in-place updates reach the module):

* :class:`GroupView` ``<conv>.group<k>``: group ``k`` of a grouped / depthwise
  ``nn.Conv2d`` (``groups = g > 1``) is its own ``m/g x (n/g·kh·kw + 1)`` layer, with
  its own ``A`` (from input channels ``k·c_in/g ..``) and ``G`` (output channels
  ``k·m/g ..``): a grouped convolution is exactly ``g`` independent convolutions.
* :class:`InProjView` ``<mha>.in_proj``: the packed q/k/v input projection
  (``in_proj_weight``, ``in_proj_bias``, ``3E x (E + 1)``) of an
  ``nn.MultiheadAttention``, a linear map applied at every sequence position
  (KFAC-expand over the positions, Eschenhagen et al. 2023).
* :class:`TapView` ``<linear>``: an ``nn.Linear`` whose weight its parent applies with
  ``F.linear`` instead of calling the module (``nn.MultiheadAttention.out_proj``,
  torchvision Swin's ``qkv`` / ``proj``).

The views of the last two kinds are *tapped*: :mod:`laplace_core.curvature.hooks` sees their
``F.linear`` calls through a ``TorchFunctionMode`` (module hooks never fire for them).

**Normalisation layers** (``find_layers(model, norm_layers="diag")``; the default
``"map"`` leaves them at MAP, the papers' protocol, so Table 3's counts stay as they are):
the affine ``weight`` / ``bias`` of ``nn.BatchNorm1d/2d/3d`` (eval mode, running
statistics), ``nn.LayerNorm`` (one normalised dimension; torchvision's ``LayerNorm2d``
included) and ``nn.GroupNorm``, and ConvNeXt's layer scale (:class:`ScaleView`
``<block>.layer_scale``), kind ``"norm"``: ``W~ = [γ, β]`` is ``C x 2`` (``C x 1``
without a bias). They get only the exact Fisher diagonal, and a **diagonal** posterior
block whatever the method chosen for the other layers (see
:mod:`laplace_core.posteriors.build`).

**Free parameters** (also under ``norm_layers="diag"``): the trainable parameters of a module
that is no Linear / Conv / attention / normalisation layer (timm's ViT ``pos_embed`` /
``cls_token`` / ``dist_token``, ``LayerScale.gamma``, ConvNeXt blocks' ``gamma``, Swin's
``relative_position_bias_table``, ...): one :class:`FreeView` ``<module>.<parameter>`` each, kind
``"norm"`` with ``W~`` = the parameter as ``weight.reshape(shape[0], -1)``. They have no layer input
and output to form a Fisher from: their per-example gradients come from ``torch.func``
(:mod:`laplace_core.curvature.free_grads`), for the exact diagonal and its diagonal block.

``W~`` has shape ``m x n``: ``m`` = output channels/features, ``n`` = fan-in
(``c_in * kh * kw`` for a conv, in ``weight.reshape(m, -1)`` order, which is also
``F.unfold``'s patch order) plus one column when there is a bias.
"""
from __future__ import annotations

import contextlib
from enum import Enum
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

from ..names import NORM_LAYER_MODES
from .layer_selection import select_layers
from .statistics import LayerInfo

__all__ = [
    "LayerKind",
    "LAYER_REGISTRY",
    "TAPPING_PARENTS",
    "LayerView",
    "GroupView",
    "InProjView",
    "TapView",
    "NORM_LAYER_MODES",
    "NORM_TYPES",
    "ScaleView",
    "FreeView",
    "affine_output_child",
    "is_free",
    "check_norm_layers",
    "is_tapped",
    "layer_kind",
    "owner_params",
    "find_layers",
    "DESELECTED",
    "get_matrix",
    "perturbed",
]


class LayerKind(str, Enum):
    LINEAR = "linear"
    CONV2D = "conv2d"
    NORM = "norm"


NORM_TYPES: tuple[type, ...] = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm)
_LAYER_SCALE_PARENTS = frozenset({("torchvision.models.convnext", "CNBlock")})


def _linear_ok(m: nn.Module) -> str | None:
    return None


def _conv_ok(m: nn.Module) -> str | None:
    assert isinstance(m, nn.Conv2d)
    if m.padding_mode != "zeros":
        return f"padding_mode={m.padding_mode!r} is not supported"
    return None  # 'same'/'valid' padding is resolved by the hooks; groups > 1 become GroupViews


# exact type -> (kind, check returning a reason when unsupported)
LAYER_REGISTRY: dict[type, tuple[LayerKind, Callable[[nn.Module], str | None]]] = {
    nn.Linear: (LayerKind.LINEAR, _linear_ok),
    nn.modules.linear.NonDynamicallyQuantizableLinear: (LayerKind.LINEAR, _linear_ok),
    nn.Conv2d: (LayerKind.CONV2D, _conv_ok),
}

# Parents that apply their child ``nn.Linear``s' weights with ``F.linear`` instead of calling
# the modules: (module path, class name). Their children become TapViews.
TAPPING_PARENTS: frozenset[tuple[str, str]] = frozenset({
    ("torch.nn.modules.activation", "MultiheadAttention"),
    ("torchvision.models.swin_transformer", "ShiftedWindowAttention"),
})


def _tapping_parent(mod: nn.Module) -> bool:
    return (type(mod).__module__, type(mod).__name__) in TAPPING_PARENTS


class LayerView:
    """Part of a module's parameters seen as one ``W~ = [W, b]`` layer.

    ``parent`` owns the parameters ``parent.<weight_name>`` / ``parent.<bias_name>``
    (``bias_name`` None: no bias); the view's ``weight`` / ``bias`` are their rows
    ``rows`` (dim 0), as views, so in-place updates (:func:`perturbed`) write through to
    the module. ``parent_name`` is the parent's qualified name in the model.
    """

    kind: LayerKind = LayerKind.LINEAR
    tapped: bool = False

    def __init__(self, parent: nn.Module, parent_name: str, weight_name: str, bias_name: str | None, rows: slice):
        self.parent = parent
        self.parent_name = parent_name
        self.weight_name = weight_name
        self.bias_name = bias_name if getattr(parent, bias_name or "", None) is not None else None
        self.rows = rows

    @property
    def weight(self) -> torch.Tensor:
        return getattr(self.parent, self.weight_name)[self.rows]

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.bias_name is None else getattr(self.parent, self.bias_name)[self.rows]

    def parameters(self, recurse: bool = False) -> Iterator[torch.Tensor]:
        yield getattr(self.parent, self.weight_name)
        if self.bias_name is not None:
            yield getattr(self.parent, self.bias_name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.parent_name!r}, rows={self.rows.start}:{self.rows.stop})"


class GroupView(LayerView):
    """Group ``index`` of a grouped ``nn.Conv2d`` (``groups = g``): output channels
    ``rows = [k m/g, (k+1) m/g)``, input channels ``channels = [k c/g, (k+1) c/g)``;
    its weight is ``(m/g, c/g, kh, kw)``, a convolution of its own."""

    kind = LayerKind.CONV2D

    def __init__(self, parent: nn.Conv2d, parent_name: str, index: int):
        g = parent.groups
        mg, cg = parent.out_channels // g, parent.in_channels // g
        super().__init__(parent, parent_name, "weight", "bias", slice(index * mg, (index + 1) * mg))
        self.index = index
        self.channels = slice(index * cg, (index + 1) * cg)
        for a in ("kernel_size", "stride", "padding", "dilation", "padding_mode"):
            setattr(self, a, getattr(parent, a))


class InProjView(LayerView):
    """The packed q/k/v input projection of an ``nn.MultiheadAttention``
    (``in_proj_weight`` ``3E x E``, ``in_proj_bias``): a linear map at every position."""

    tapped = True

    def __init__(self, parent: nn.MultiheadAttention, parent_name: str):
        super().__init__(parent, parent_name, "in_proj_weight", "in_proj_bias", slice(None))


class TapView(LayerView):
    """An ``nn.Linear`` whose parent applies it with ``F.linear`` (never calling it)."""

    tapped = True

    def __init__(self, module: nn.Linear, name: str):
        super().__init__(module, name, "weight", "bias", slice(None))


class ScaleView(LayerView):
    """ConvNeXt's layer scale: ``y = layer_scale ∘ block(x)`` (``layer_scale`` ``C x 1 x 1``),
    a ``C x 1`` ``W~`` of kind ``"norm"``. Its input is the output of ``parent.block``, its
    output gradient that of the parent block (the residual sum only adds to ``y``)."""

    kind = LayerKind.NORM

    def __init__(self, parent: nn.Module, parent_name: str):
        super().__init__(parent, parent_name, "layer_scale", None, slice(None))


class FreeView(LayerView):
    """A trainable parameter ``parent.<param_name>`` of a module that is no curvature layer, as a
    ``W~`` of kind ``"norm"`` (``weight`` is the whole parameter, ``W~ = weight.reshape(shape[0], -1)``,
    no bias): not captured by hooks, its per-example gradients come from ``torch.func``."""

    kind = LayerKind.NORM

    def __init__(self, parent: nn.Module, parent_name: str, param_name: str):
        super().__init__(parent, parent_name, param_name, None, slice(None))


def is_free(layer) -> bool:
    """Whether ``layer`` is a :class:`FreeView` (no module hooks: gradients by ``torch.func``)."""
    return isinstance(layer, FreeView)


def _free_views(mod: nn.Module, name: str) -> list[tuple[str, FreeView]]:
    """``(layer name, view)`` for each trainable parameter of at least one dimension ``mod`` owns."""
    return [(f"{name}.{k}" if name else k, FreeView(mod, name, k))
            for k, p in mod.named_parameters(recurse=False) if p.requires_grad and p.dim() >= 1]


def check_norm_layers(norm_layers: str) -> str:
    """``norm_layers`` if valid, else a one-line ``ValueError`` naming the valid values."""
    if norm_layers not in NORM_LAYER_MODES:
        raise ValueError(f"unknown norm_layers {norm_layers!r}; valid: {', '.join(NORM_LAYER_MODES)}")
    return norm_layers


def affine_output_child(mod: nn.Module) -> nn.Module | None:
    """timm's norm + activation layers (``timm.layers.norm_act``: ``BatchNormAct2d``, ``GroupNormAct``,
    ``LayerNormAct(2d)``) normalise, then call ``drop`` and ``act``: their affine output is the input
    of ``drop`` (the hooks take the output gradient there). None for any other module."""
    if type(mod).__module__ == "timm.layers.norm_act" and isinstance(getattr(mod, "drop", None), nn.Module):
        return mod.drop
    return None


def _norm_reason(mod: nn.Module) -> str | None:
    """Why a normalisation module cannot get a diagonal posterior (None: it can)."""
    if next(mod.children(), None) is not None and affine_output_child(mod) is None:
        return f"{type(mod).__name__} calls modules of its own after normalising (point estimate)"
    if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)) and mod.running_mean is None:
        return "BatchNorm without running statistics normalises with batch statistics (no per-example Fisher)"
    if isinstance(mod, nn.LayerNorm) and len(mod.normalized_shape) != 1:
        return f"LayerNorm over {len(mod.normalized_shape)} dimensions is not supported (one normalised dimension)"
    if mod.weight is None:
        return "normalisation layer without an affine weight"
    return None


def is_tapped(layer) -> bool:
    """Whether ``layer`` is seen through its ``F.linear`` calls rather than module hooks."""
    return bool(getattr(layer, "tapped", False))


def layer_kind(layer) -> LayerKind:
    """``LINEAR`` or ``CONV2D`` for a registered module or a :class:`LayerView`."""
    if isinstance(layer, LayerView):
        return layer.kind
    if isinstance(layer, NORM_TYPES):
        return LayerKind.NORM
    if isinstance(layer, nn.Conv2d):
        return LayerKind.CONV2D
    if isinstance(layer, nn.Linear):
        return LayerKind.LINEAR
    raise ValueError(f"unsupported layer type {type(layer).__name__}")


def owner_params(layer, name: str) -> tuple[nn.Module, str, str, str | None, slice]:
    """``(owning module, its qualified name, weight attribute, bias attribute or None, rows)``:
    where ``layer``'s ``W~`` lives in the full parameters (e.g. ``functional_call`` keys
    ``f"{owner}.{attr}"``; rows ``rows`` of dim 0). ``name`` is the layer's own name."""
    if isinstance(layer, LayerView):
        return layer.parent, layer.parent_name, layer.weight_name, layer.bias_name, layer.rows  # type: ignore[return-value]
    return layer, name, "weight", ("bias" if layer.bias is not None else None), slice(None)  # type: ignore[return-value]


def _info(name: str, module, kind: LayerKind) -> LayerInfo:
    w = module.weight
    m = w.shape[0]
    n = int(w[0].numel()) + (1 if module.bias is not None else 0)
    return LayerInfo(
        name=name,
        kind=kind.value,
        out_features=int(m),
        in_features=n,
        has_bias=module.bias is not None,
        weight_shape=tuple(int(s) for s in w.shape),
    )


def _register(modules: dict, infos: dict, name: str, layer, kind: LayerKind) -> None:
    modules[name] = layer
    infos[name] = _info(name, layer, kind)


def find_layers(model: nn.Module, norm_layers: str = "map",
                layers="all") -> tuple[dict[str, object], dict[str, LayerInfo], dict[str, str]]:
    """Return ``(layers, infos, excluded)`` in ``model.named_modules()`` order.

    ``layers``/``infos`` map qualified names of supported layers (modules, or
    :class:`LayerView`s named ``<conv>.group<k>``, ``<mha>.in_proj``,
    ``<block>.layer_scale``); ``excluded`` maps names of other modules that directly own
    trainable parameters to a reason. Modules whose parameters are frozen
    (``requires_grad=False``) are excluded too. ``norm_layers="diag"`` adds the
    normalisation layers (kind ``"norm"``, module docstring) and the free parameters
    (:class:`FreeView` ``<module>.<parameter>``); ``"map"`` excludes them.
    ``layers``: ``"all"``, ``"last"`` or names / globs (:func:`laplace_core.curvature.layer_selection.select_layers`,
    resolved over the curvature layers above); the layers it leaves out are point estimates,
    in ``excluded`` under their owning module's name (under the view's name when only some
    views of a module are left out).
    """
    check_norm_layers(norm_layers)
    modules: dict[str, object] = {}
    infos: dict[str, LayerInfo] = {}
    excluded: dict[str, str] = {}
    tappers = {id(mod) for _, mod in model.named_modules() if _tapping_parent(mod)}
    parent_of = {id(child): id(mod) for _, mod in model.named_modules() for child in mod.children()}
    for name, mod in model.named_modules():
        own = [p for p in mod.parameters(recurse=False)]
        if not own:
            continue
        if isinstance(mod, nn.MultiheadAttention):
            reason = _mha_reason(mod)
            if reason is not None:
                excluded[name] = reason
            elif not all(p.requires_grad for p in own):
                excluded[name] = "parameters are frozen (requires_grad=False)"
            else:
                _register(modules, infos, f"{name}.in_proj" if name else "in_proj", InProjView(mod, name), LayerKind.LINEAR)
            continue
        if norm_layers == "diag" and (isinstance(mod, NORM_TYPES) or (
                (type(mod).__module__, type(mod).__name__) in _LAYER_SCALE_PARENTS and len(own) == 1)):
            scale = not isinstance(mod, NORM_TYPES)
            reason = None if scale else _norm_reason(mod)
            if reason is None and not all(p.requires_grad for p in own):
                reason = "parameters are frozen (requires_grad=False)"
            if reason is not None:
                excluded[name] = reason
                continue
            lname = (f"{name}.layer_scale" if name else "layer_scale") if scale else name
            _register(modules, infos, lname, ScaleView(mod, name) if scale else mod, LayerKind.NORM)
            continue
        entry = LAYER_REGISTRY.get(type(mod))
        free = _free_views(mod, name) if entry is None and norm_layers == "diag" else []
        for lname, view in free:
            _register(modules, infos, lname, view, LayerKind.NORM)
        if entry is None and not free:
            excluded[name] = f"{type(mod).__name__} is not in the layer registry (point estimate)"
        if entry is None:
            continue
        kind, check = entry
        reason = check(mod)
        if reason is not None:
            excluded[name] = reason
            continue
        if not all(p.requires_grad for p in own):
            excluded[name] = "parameters are frozen (requires_grad=False)"
            continue
        if kind is LayerKind.CONV2D and mod.groups > 1:
            for k in range(mod.groups):
                _register(modules, infos, f"{name}.group{k}" if name else f"group{k}", GroupView(mod, name, k), kind)
            continue
        _register(modules, infos, name, TapView(mod, name) if parent_of.get(id(mod)) in tappers else mod, kind)
    if layers != "all":
        modules, infos = _restrict(modules, infos, excluded, select_layers(list(modules), layers))
    return modules, infos, excluded


DESELECTED = "not in the selected posterior layers (point estimate at MAP)"
"""The ``excluded`` reason of a curvature layer that a ``layers`` selection leaves out."""


def _restrict(modules: dict, infos: dict, excluded: dict[str, str],
              keep: tuple[str, ...]) -> tuple[dict[str, object], dict[str, LayerInfo]]:
    """``modules`` / ``infos`` restricted to ``keep``; the rest recorded in ``excluded``."""
    kept = set(keep)
    owner = {k: owner_params(mod, k)[1] for k, mod in modules.items()}
    partly = {owner[k] for k in kept}
    reason = DESELECTED
    for k in modules:
        if k not in kept:
            excluded[k if owner[k] in partly else owner[k]] = reason
    return {k: modules[k] for k in keep}, {k: infos[k] for k in keep}


def _mha_reason(mod: nn.MultiheadAttention) -> str | None:
    """Why an ``nn.MultiheadAttention``'s in-projection cannot be covered (None: it can)."""
    if not mod._qkv_same_embed_dim or mod.in_proj_weight is None:
        return "MultiheadAttention with separate q/k/v projections (kdim/vdim) is not supported"
    if mod.bias_k is not None or mod.add_zero_attn:
        return "MultiheadAttention with add_bias_kv / add_zero_attn is not supported"
    return None


def get_matrix(module: nn.Module) -> torch.Tensor:
    """``W~`` (m x n): weight flattened to ``(m, -1)`` with the bias as last column."""
    w = module.weight.detach().reshape(module.weight.shape[0], -1)
    if module.bias is not None:
        w = torch.cat([w, module.bias.detach().reshape(-1, 1)], dim=1)
    return w


@contextlib.contextmanager
def perturbed(modules: Mapping[str, nn.Module], deltas: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Temporarily add ``deltas[name]`` (``W~``-shaped) to each named layer's parameters.

    ``delta`` is ``m x n``: columns ``[:n-1]`` (or all, without a bias) go to the
    flattened weight, the last to the bias; added in place (``W + δ`` elementwise, no
    ``W~`` concatenation). The MAP values are restored exactly (saved copies, not
    subtraction) on exit.
    """
    saved = {}
    try:
        with torch.no_grad():
            for name, delta in deltas.items():
                mod = modules[name]
                w = mod.weight
                saved[name] = (w.detach().clone(), None if mod.bias is None else mod.bias.detach().clone())
                d = delta.to(device=w.device, dtype=w.dtype)
                k = w[0].numel()
                w.add_(d[:, :k].reshape(w.shape))
                if mod.bias is not None:
                    mod.bias.add_(d[:, k])
        yield
    finally:
        with torch.no_grad():
            for name, (w, b) in saved.items():
                mod = modules[name]
                mod.weight.copy_(w)
                if b is not None:
                    mod.bias.copy_(b)
