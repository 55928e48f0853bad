"""The torchvision weights' own eval transforms of a model, or a ``timm:`` model's data config,
read as metadata (no download): what the ``custom`` preset sizes and normalises the images
with (``pipelines.ingest.plan``)."""
from __future__ import annotations

from pipelines.ingest.models import EXTRA_MODELS, is_enum_name, is_factory, resolve_weights_enum
from pipelines.ingest.timm_models import is_timm, timm_transforms

__all__ = ["default_transforms"]


def default_transforms(name: str, weights: str | None = None) -> dict[str, object] | None:
    """Image size, resize size and normalisation of the torchvision weights' own eval transforms
    (``weights`` when it is an enum name, else the architecture's ``DEFAULT`` weights): a dict with
    ``image_size``, ``resize_size``, ``mean``, ``std`` and ``source`` (the enum), or None when the
    model has no torchvision weights (a factory, an extra model). A ``timm:`` model: its data config
    (:func:`pipelines.ingest.timm_models.timm_transforms`, with a ``note``). Reads metadata only: no download."""
    import torchvision.models as tvm

    if is_timm(name):
        try:
            return timm_transforms(name)
        except ValueError:  # timm missing or an unknown name: the preflight says so in one line
            return None

    try:
        if weights is not None and is_enum_name(weights):
            enum = resolve_weights_enum(weights)
        elif is_factory(name) or name in EXTRA_MODELS:
            return None
        else:
            enum = tvm.get_model_weights(name).DEFAULT
        t = enum.transforms()
    except Exception:  # no weights registered for the name, or transforms that are not a classification preset
        return None
    crop, resize = getattr(t, "crop_size", None), getattr(t, "resize_size", None)
    if not crop or not resize:
        return None
    return {"image_size": int(crop[0]), "resize_size": int(resize[0]), "mean": tuple(float(v) for v in t.mean),
            "std": tuple(float(v) for v in t.std), "source": f"{type(enum).__name__}.{enum.name}"}
