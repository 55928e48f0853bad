"""Model loading for the pipelines: torchvision classifiers plus the project's demo net.

``load_model(name, weights, num_classes)`` returns an ``nn.Module`` in ``eval()``
mode (docs/design.md §1: curvature is fitted with running BN statistics, no dropout).

Names come from an explicit registry: every torchvision *classification* model
(``torchvision.models.list_models(module=torchvision.models)``) and the extra
entries of :data:`EXTRA_MODELS` (``"demo_cnn"`` -> ``pipelines.ingest.demo_data.small_cnn``,
imported lazily). An unknown name raises a one-line ``ValueError`` listing the
ResNet/DenseNet names (and pointing at the full list).

A user's own model is a factory string ``"package.module:callable"``: any importable
callable returning an ``nn.Module``, called as ``callable()`` or, when ``num_classes`` is
given, ``callable(num_classes=num_classes)`` (:func:`resolve_factory`). The module must be
importable where the job runs (a top-level module not found on the path is looked for in the
working directory). A missing
module or attribute, a factory that raises or one that returns something other than an
``nn.Module`` give a one-line ``ValueError``. ``"timm:NAME"`` is timm's architecture NAME
(:mod:`pipelines.ingest.timm_models`; optional, never downloads), with the state-dict weights below.

``weights`` is one of

* ``None`` or ``"random"`` — random initialisation (tests, shape-only tools; ``--weights random``:
  a test run of the pipeline);
* a torchvision weights enum name such as ``"ResNet50_Weights.IMAGENET1K_V2"`` —
  resolved with ``torchvision.models.get_weight`` (downloads in real use);
* a local path or URI (``s3://bucket/key``; the run's storage options, ``options=``, or
  ``AWS_ENDPOINT_URL_S3`` for S3-compatible stores, see :mod:`pipelines.storage.uris`)
  of a state dict: ``.safetensors`` is read with
  ``safetensors.torch.load``; anything else with
  ``torch.load(..., weights_only=True, map_location="cpu")`` (never unpickles
  arbitrary objects). Checkpoints wrapped as ``{"state_dict": ...}`` /
  ``{"model": ...}`` and DDP ``module.`` prefixes are unwrapped.

Missing / unexpected keys and shape mismatches raise a one-line ``ValueError``
naming the first three of each (and both shapes); a file that is neither safetensors nor a
torch file (a text file, say) says so in words. :func:`check_weights` does the same match on
the meta device (no memory, nothing loaded): the job's preflight, before Ray starts.
"""
from __future__ import annotations

import io
import re
from typing import TYPE_CHECKING, Callable, Mapping

import torch
from torch import nn

from pipelines.ingest.factory import build_factory, is_factory, resolve_factory
from pipelines.ingest.timm_models import build_timm, is_timm

if TYPE_CHECKING:
    from pipelines.storage.uris import StorageOptions

__all__ = [
    "EXTRA_MODELS",
    "tiny_cnn",
    "model_names",
    "resolve_weights_enum",
    "read_state_dict",
    "check_state_dict",
    "state_dict_mismatch",
    "check_weights",
    "RANDOM_WEIGHTS",
    "load_model",
    "model_coverage",
    "vit_tiny_test",
    "convnext_tiny_test",
    "vit_tiny_timm_test",
    "is_factory",
    "resolve_factory",
    "build_meta",
]


def _demo_cnn(num_classes: int | None) -> nn.Module:
    from pipelines.ingest import demo_data  # lazy: written by another module, pulls in data deps

    if num_classes is None:
        return demo_data.small_cnn()
    return demo_data.small_cnn(num_classes=num_classes)


def tiny_cnn(num_classes: int | None = None) -> nn.Module:
    """A few-hundred-weight conv net for pipeline tests and benchmarks (any image size >= 4).

    conv(3->4, 3x3) - BN - ReLU - conv(4->6, 3x3, stride 2) - ReLU - avgpool(2x2) - Linear(24 -> C).
    The BatchNorm is a point estimate (listed in ``excluded``); the convs and the
    Linear carry curvature.
    """
    c = 3 if num_classes is None else int(num_classes)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(24, c),
    )


def vit_tiny_test(num_classes: int | None = None) -> nn.Module:
    """A ``vit_b_16``-shaped torchvision ``VisionTransformer`` cut down for tests: 32x32 images,
    8x8 patches (16 tokens + class token), 1 encoder block, 2 heads, width 16, MLP 32.
    Its attention (``nn.MultiheadAttention``: packed q/k/v projection and ``out_proj``) and
    LayerNorms are the real ones."""
    from torchvision.models import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
                             num_classes=10 if num_classes is None else int(num_classes))


def convnext_tiny_test(num_classes: int | None = None) -> nn.Module:
    """A ``convnext_tiny``-shaped torchvision ``ConvNeXt`` cut down for tests: two stages of one
    block (widths 8 and 16), so depthwise 7x7 convolutions, ``LayerNorm2d`` and layer scales."""
    from torchvision.models import ConvNeXt
    from torchvision.models.convnext import CNBlockConfig

    return ConvNeXt([CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 1)],
                    num_classes=10 if num_classes is None else int(num_classes))


def vit_tiny_timm_test(num_classes: int | None = None) -> nn.Module:
    """timm's ``VisionTransformer`` cut down for tests (needs timm): 32x32 images, 8x8 patches, 1 block,
    2 heads, width 16; its ``Attention`` (fused ``qkv``, ``F.scaled_dot_product_attention``) is timm's."""
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2, mlp_ratio=2,
                             num_classes=10 if num_classes is None else int(num_classes))


# name -> builder(num_classes or None). torchvision names are resolved separately.
EXTRA_MODELS: dict[str, Callable[[int | None], nn.Module]] = {
    "demo_cnn": _demo_cnn,
    "tiny_cnn": tiny_cnn,
    "vit_tiny_test": vit_tiny_test,
    "convnext_tiny_test": convnext_tiny_test,
    "vit_tiny_timm_test": vit_tiny_timm_test,
}

_ENUM_RE = re.compile(r"^[A-Za-z0-9_]+_Weights\.[A-Za-z0-9_]+$")


def _torchvision_names() -> list[str]:
    import torchvision.models as tvm

    return list(tvm.list_models(module=tvm))


def model_names() -> list[str]:
    """Every valid ``name``: torchvision classification models plus :data:`EXTRA_MODELS`."""
    return sorted(set(_torchvision_names()) | set(EXTRA_MODELS))


def _unknown_model(name: str) -> ValueError:
    common = [n for n in _torchvision_names() if n.startswith(("resnet", "densenet", "wide_resnet", "resnext"))]
    return ValueError(
        f"unknown model {name!r}; valid ResNet/DenseNet names: {', '.join(sorted(common))}; "
        f"also {', '.join(sorted(EXTRA_MODELS))}, every torchvision classification model "
        f"(pipelines.ingest.models.model_names()) and package.module:callable (a factory of your own)"
    )


def resolve_weights_enum(name: str):
    """``"ResNet50_Weights.IMAGENET1K_V2"`` -> the torchvision ``WeightsEnum`` member.

    Does not download anything. Raises ``ValueError`` for an unknown enum name.
    """
    import torchvision.models as tvm

    try:
        return tvm.get_weight(name)
    except (ValueError, KeyError, AttributeError) as e:
        raise ValueError(f"unknown torchvision weights {name!r} ({e})") from None


def is_enum_name(weights: str) -> bool:
    return bool(_ENUM_RE.match(weights)) and "/" not in weights


def _read_bytes(uri: str, options: StorageOptions | None) -> bytes:
    from pipelines.storage import uris as storage

    try:
        return storage.read_bytes(uri, options)
    except FileNotFoundError:
        raise ValueError(f"weights file not found: {uri}") from None


def _unwrap(obj) -> dict[str, torch.Tensor]:
    if isinstance(obj, Mapping):
        for key in ("state_dict", "model", "model_state_dict"):
            inner = obj.get(key)
            if isinstance(inner, Mapping) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
                obj = inner
                break
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError("weights file does not hold a state dict (a mapping of parameter names to tensors)")
    sd = dict(obj)
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


def _is_safetensors(data: bytes) -> bool:
    """safetensors: an 8-byte little-endian header length, then a JSON header."""
    if len(data) < 10:
        return False
    n = int.from_bytes(data[:8], "little")
    return 0 < n <= len(data) - 8 and data[8:9] == b"{"


def _not_weights(uri: str, data: bytes) -> ValueError:
    """A one-line ``ValueError`` for a file that is neither safetensors nor a torch file, in words."""
    how = ("give a state dict saved with torch.save(model.state_dict(), path) (or a .safetensors file)")
    if not data:
        return ValueError(f"weights file {uri} is empty, not weights; {how}")
    head = data[:4096]
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and sum(c.isprintable() or c in "\n\r\t" for c in text) >= 0.95 * len(text):
        first = " ".join(text.split())[:40]
        return ValueError(f"weights file {uri} is a text file ({first!r}...), not weights; {how}")
    return ValueError(f"weights file {uri} is neither a safetensors file nor a torch.save file; {how}")


def read_state_dict(uri: str, *, options: StorageOptions | None = None) -> dict[str, torch.Tensor]:
    """Read a state dict from a local path or fsspec URI (``.safetensors`` or a torch file,
    told apart by their first bytes). torch files are read with ``weights_only=True`` (no
    arbitrary unpickling); a file that is neither (a text file, say) is a one-line
    ``ValueError`` that says so in words."""
    data = _read_bytes(uri, options)
    if _is_safetensors(data) or (uri.endswith(".safetensors") and not data.startswith(b"PK")):
        from safetensors.torch import load as st_load

        try:
            return _unwrap(st_load(data))
        except Exception as e:  # safetensors raises its own error type
            if isinstance(e, ValueError) and "state dict" in str(e):
                raise
            if not _is_safetensors(data):
                raise _not_weights(uri, data) from None
            raise ValueError(f"cannot read safetensors weights {uri}: {e}") from None
    if not (data.startswith(b"PK\x03\x04") or data[:1] == b"\x80"):  # zip (torch.save) or a legacy pickle
        raise _not_weights(uri, data)
    try:
        obj = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:
        raise ValueError(_unpickle_line(uri, e)) from None
    return _unwrap(obj)


_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def _unpickle_line(uri: str, e: Exception) -> str:
    """What ``torch.load(weights_only=True)`` refused, in one line: a pickled object (e.g. a whole
    model saved with ``torch.save(model)``) names its class and asks for the state dict; torch's
    own advice (load with ``weights_only=False``, i.e. run the file's code) is not repeated."""
    found = _GLOBAL.search(str(e))
    if found:
        return (f"cannot read weights {uri}: it holds a pickled {found[1]}, not only tensors (a whole model saved "
                "with torch.save(model)?), and infoform reads weights with torch.load(weights_only=True), never "
                "running a file's code: save model.state_dict() (torch.save or safetensors) and pass that file")
    return f"cannot read weights {uri} with torch.load(weights_only=True): {' '.join(str(e).split())[:300]}"


def _some(keys: list[str], k: int = 3) -> str:
    """The first ``k`` quoted keys, and how many more."""
    more = f" and {len(keys) - k} more" if len(keys) > k else ""
    return ", ".join(repr(x) for x in keys[:k]) + more


def state_dict_mismatch(own: Mapping[str, tuple], sd: Mapping[str, torch.Tensor]) -> str | None:
    """One line naming missing keys, unexpected keys and shape mismatches of ``sd`` against the
    model's ``own`` key -> shape (first three of each, model order), or None when they match."""
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shapes = [k for k in own if k in sd and tuple(sd[k].shape) != tuple(own[k])]
    parts = []
    if missing:
        k = missing[0]
        parts.append(f"weights are missing key {k!r} (expected shape {tuple(own[k])})"
                     + (f"; also missing {_some(missing[1:])}" if len(missing) > 1 else "")
                     + f" ({len(missing)} of the model's {len(own)} keys"
                     + ("; none of them is in the file: weights of another architecture?)" if len(missing) == len(own)
                        else ")"))
    if shapes:
        k = shapes[0]
        parts.append(f"shape mismatch for {k!r}: weights have {tuple(sd[k].shape)}, model expects {tuple(own[k])}"
                     + (f"; also for {_some(shapes[1:])}" if len(shapes) > 1 else ""))
    if unexpected:
        k = unexpected[0]
        parts.append(f"weights have unexpected key {k!r} (shape {tuple(sd[k].shape)})"
                     + (f"; also {_some(unexpected[1:])}" if len(unexpected) > 1 else ""))
    return "; ".join(parts) or None


def check_state_dict(model: nn.Module, sd: Mapping[str, torch.Tensor], name: str | None = None) -> None:
    """Raise a one-line ``ValueError`` unless ``sd`` matches ``model.state_dict()`` exactly
    (same keys, same shapes), naming the first three missing / unexpected / mismatched keys."""
    why = state_dict_mismatch({k: tuple(v.shape) for k, v in model.state_dict().items()}, sd)
    if why:
        raise ValueError((f"weights do not fit model {name!r}: " if name else "") + why)


def _last_linear(model: nn.Module) -> str | None:
    last = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            last = name
    return last


def _infer_num_classes(model: nn.Module, sd: Mapping[str, torch.Tensor]) -> int | None:
    """Output size of the model's last Linear layer as stored in ``sd`` (or None)."""
    last = _last_linear(model)
    w = None if last is None else sd.get(f"{last}.weight")
    return None if w is None else int(w.shape[0])


def _check_enum_fits(name: str, enum, weights: str) -> None:
    import torchvision.models as tvm

    if name in EXTRA_MODELS or is_timm(name):
        raise ValueError(f"model {name!r} has no torchvision weights; pass a state-dict file")
    expected = tvm.get_model_weights(name)
    if not isinstance(enum, expected):
        raise ValueError(f"weights {weights!r} do not belong to model {name!r} (expected {expected.__name__}.*)")


def _build(name: str, num_classes: int | None, weights_enum=None) -> nn.Module:
    if name in EXTRA_MODELS or is_timm(name):
        if weights_enum is not None:
            raise ValueError(f"model {name!r} has no torchvision weights; pass a state-dict file")
        return build_timm(name, num_classes) if is_timm(name) else EXTRA_MODELS[name](num_classes)
    import torchvision.models as tvm

    if name not in _torchvision_names():
        raise _unknown_model(name)
    kwargs = {}
    if num_classes is not None:
        kwargs["num_classes"] = int(num_classes)
    return tvm.get_model(name, weights=weights_enum, **kwargs)


#: ``weights: random`` — random initialisation on purpose (a test run of the pipeline, said in the log).
RANDOM_WEIGHTS = "random"


def _fit_state_dict(name: str, sd: Mapping[str, torch.Tensor], num_classes: int | None, build) -> nn.Module:
    """``build(name, num_classes)`` with the classifier size of ``sd`` when ``num_classes`` is None,
    checked against ``sd`` (one-line ``ValueError`` naming what does not fit)."""
    model = build(name, num_classes)
    if num_classes is None:
        inferred = _infer_num_classes(model, sd)
        if inferred is not None and inferred != model.get_submodule(_last_linear(model)).out_features:
            model = build(name, inferred)
    check_state_dict(model, sd, name)
    return model


def load_model(
    name: str,
    weights: str | None = None,
    num_classes: int | None = None,
    *,
    options: StorageOptions | None = None,
) -> nn.Module:
    """Build model ``name``, load ``weights`` and return it in ``eval()`` mode on CPU.

    ``num_classes=None`` means the architecture's default, or, with a state-dict
    file, the output size of the file's last Linear layer. A factory string
    ``"package.module:callable"`` builds the model by calling it (see the module docstring);
    its state dict, if given, must fit the returned model exactly. ``weights="random"``
    (:data:`RANDOM_WEIGHTS`) is a random initialisation, as ``None``.
    """
    if weights == RANDOM_WEIGHTS:
        weights = None
    if is_factory(name):
        if weights is not None and is_enum_name(weights):
            raise ValueError(f"model {name!r} is a factory; give a state-dict file, not torchvision weights {weights!r}")
        model = build_factory(name, num_classes)
        if weights is not None:
            sd = read_state_dict(weights, options=options)
            check_state_dict(model, sd, name)
            model.load_state_dict(sd, strict=True)
        return model.eval()
    if name not in EXTRA_MODELS and not is_timm(name) and name not in _torchvision_names():
        raise _unknown_model(name)
    if weights is None:
        model = _build(name, num_classes)
    elif is_enum_name(weights):
        enum = resolve_weights_enum(weights)
        _check_enum_fits(name, enum, weights)
        n_cat = len(enum.meta.get("categories") or [])
        if num_classes is not None and n_cat and int(num_classes) != n_cat:
            raise ValueError(f"{weights} has {n_cat} classes, num_classes={num_classes} was requested")
        model = _build(name, None, enum)
    else:
        sd = read_state_dict(weights, options=options)
        model = _fit_state_dict(name, sd, num_classes, _build)
        model.load_state_dict(sd, strict=True)
    return model.eval()


def build_meta(name: str, num_classes: int | None) -> nn.Module:
    """The model's shapes without memory: built on the ``meta`` device where its constructor allows."""
    if is_factory(name):
        return build_factory(name, num_classes)
    try:
        with torch.device("meta"):
            return _build(name, num_classes)
    except NotImplementedError:  # constructors that read tensor values (regnet)
        return _build(name, num_classes)


def check_weights(name: str, weights: str, num_classes: int | None = None, *,
                  options: StorageOptions | None = None) -> dict[str, object]:
    """Read the state-dict file ``weights`` and match it against model ``name`` (built on the
    meta device: no memory, no download) as :func:`load_model` would, without loading it.
    Returns ``{"head": name of the last Linear layer or None, "num_classes": its outputs}``;
    one-line ``ValueError`` for a file that is not weights or weights that do not fit."""
    sd = read_state_dict(weights, options=options)
    model = _fit_state_dict(name, sd, num_classes, build_meta)
    head = _last_linear(model)
    return {"head": head, "num_classes": None if head is None else int(model.get_submodule(head).out_features)}


def _few(names: list[str], k: int = 6) -> str:
    """``a, b, c`` or, for more than ``k`` names, the first and last few and the count."""
    if len(names) <= k:
        return ", ".join(names) or "none"
    return ", ".join(names[: k // 2] + ["..."] + names[-(k // 2):]) + f" ({len(names)})"


def model_size_report(name: str, num_classes: int | None = None, norm_layers: str = "map", layers="all",
                      rank: int | None = None):
    """:func:`laplace_core.posteriors.sizes.model_sizes` of model ``name`` built without weights (``meta`` device)."""
    from laplace_core.posteriors.sizes import model_sizes

    model = build_meta(name, num_classes)
    return model_sizes(model, rank=rank, norm_layers=norm_layers, layers=layers)


def model_coverage(name: str, num_classes: int | None = None, norm_layers: str = "map", layers="all") -> dict:
    """:attr:`laplace_core.posteriors.sizes.SizeReport.coverage` of model ``name`` (built without weights,
    on the ``meta`` device where its constructor allows): weights under the posterior, weights
    left at MAP and their module types, plus ``summary``, the same in one line, and
    ``at_map_layers``, the curvature layers a ``layers`` selection leaves at MAP (empty for
    ``"all"``). ``ValueError`` (one line) for a selection that matches no layer."""
    from laplace_core.curvature.layers import DESELECTED
    from laplace_core.posteriors.sizes import model_sizes

    model = build_meta(name, num_classes) if not is_factory(name) else _build(name, num_classes)
    rep = model_sizes(model, norm_layers=norm_layers, layers=layers)
    cov = rep.coverage
    cov["at_map_layers"] = [k for k, why in rep.excluded.items() if why == DESELECTED]  # model order
    by = ", ".join(f"{k} {v:,}" for k, v in cov["at_map_by_type"].items()) or "none"
    sel = "" if cov["layers"] == "all" else (f", layers: {cov['layers']} = {_few([ls.name for ls in rep.layers])}; "
                                             f"curvature layers at MAP: {_few(cov['at_map_layers'])}")
    cov["summary"] = (f"{100 * cov['fraction']:.2f}% of {cov['total_parameters']:,} parameters under the posterior "
                      f"(norm layers: {norm_layers}{sel}); at MAP: {cov['weights_at_map']:,} ({by})")
    return cov
