"""timm architectures by name: ``"timm:NAME"`` (``--model timm:convnext_atto``, ``models[].name``).

timm (PyTorch Image Models, ``pip install 'infoform[timm]'``) is optional: it is imported only
when a ``timm:`` name is used, and a missing timm is a one-line ``ValueError`` saying how to
install it. :func:`build_timm` builds ``timm.create_model(NAME, pretrained=False,
num_classes=...)``: never a download; the weights come from a state-dict file
(:func:`pipelines.ingest.models.load_model`). An unknown name gets timm's close matches
(``difflib`` over ``timm.list_models()``).

:func:`timm_transforms` reads the model's own data config (``timm.data.resolve_data_config``
over its ``pretrained_cfg``: input size, interpolation, crop percentage, mean/std) as the
run's image size, resize size (``floor(size / crop_pct)``, timm's eval resize) and
normalisation; the pipeline resizes bilinearly whatever timm's interpolation says (the
returned ``note`` says so, for the log).
"""
from __future__ import annotations

import difflib
import math
import warnings

from torch import nn

__all__ = ["TIMM_PREFIX", "is_timm", "timm_arch", "check_timm_name", "build_timm", "timm_transforms"]

TIMM_PREFIX = "timm:"


def is_timm(name: str) -> bool:
    """``"timm:NAME"``: an architecture from timm's registry."""
    return isinstance(name, str) and name.startswith(TIMM_PREFIX)


def timm_arch(name: str) -> str:
    """``"timm:convnext_atto"`` -> ``"convnext_atto"``."""
    return name[len(TIMM_PREFIX):]


def _import_timm(name: str):
    try:
        import timm
    except ImportError:
        raise ValueError(f"model {name!r} needs timm, which is not installed: pip install 'infoform[timm]'") from None
    return timm


def check_timm_name(name: str):
    """The ``timm`` module when ``name`` is ``timm:<a model in timm's registry>``; otherwise a
    one-line ``ValueError`` (timm missing, or an unknown name with timm's close matches)."""
    timm = _import_timm(name)
    arch = timm_arch(name)
    if not arch or not timm.is_model(arch):
        names = timm.list_models()
        close = difflib.get_close_matches(arch, names, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(TIMM_PREFIX + c for c in close)}? " if close else ""
        raise ValueError(f"unknown timm model {arch!r}; {hint}({len(names)} names in timm.list_models(), "
                         "e.g. timm:resnet50, timm:vit_small_patch16_224, timm:convnext_tiny)")
    return timm


def build_timm(name: str, num_classes: int | None = None) -> nn.Module:
    """``timm.create_model(NAME, pretrained=False[, num_classes=...])``: random weights, no download."""
    timm = check_timm_name(name)
    kwargs = {} if num_classes is None else {"num_classes": int(num_classes)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return timm.create_model(timm_arch(name), pretrained=False, **kwargs)


def timm_transforms(name: str) -> dict[str, object]:
    """The eval transforms of timm model ``name`` from its data config (metadata; the model is
    built on the meta device): ``image_size``, ``resize_size``, ``mean``, ``std``, ``source``
    and ``note`` (how the pipeline applies them)."""
    import torch

    timm = check_timm_name(name)
    from timm.data import resolve_data_config

    try:
        with torch.device("meta"):
            model = build_timm(name)
    except NotImplementedError:
        model = build_timm(name)
    cfg = resolve_data_config({}, model=model)
    size = int(cfg["input_size"][-1])
    crop_pct = float(cfg.get("crop_pct") or 1.0)
    resize = int(math.floor(size / crop_pct))
    interp = str(cfg.get("interpolation") or "bilinear")
    note = (f"timm {timm_arch(name)}'s data config (timm {timm.__version__}): input {size} px, crop_pct {crop_pct:g} "
            f"(resize {resize}), mean {tuple(round(float(v), 4) for v in cfg['mean'])}, "
            f"std {tuple(round(float(v), 4) for v in cfg['std'])}")
    if interp != "bilinear":
        note += f"; its interpolation is {interp}, the pipeline resizes bilinearly"
    return {"image_size": size, "resize_size": resize, "mean": tuple(float(v) for v in cfg["mean"]),
            "std": tuple(float(v) for v in cfg["std"]), "source": f"timm {timm_arch(name)}", "note": note}
