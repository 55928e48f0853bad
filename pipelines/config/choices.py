"""The value sets the config checks settings against, owned here, below every stage.

The config layer validates names and numbers that the stages above it implement (the
predictive types of :mod:`pipelines.evaluation.predictors`, the corruptions of
:mod:`pipelines.ingest.corruptions`, Ray's GPU shares of :mod:`pipelines.distributed.cluster`).
So that ``config`` imports none of those packages (docs/design.md, "Layers"), the sets live
here and the stages import them from here; tests check that each implementation covers
exactly its set.
"""
from __future__ import annotations

__all__ = [
    "PRED_TYPES",
    "CORRUPTION_NAMES",
    "IMAGENET_C_NAMES",
    "CORRUPTION_FAMILIES",
    "SEVERITIES",
    "check_corruption",
    "RESOURCE_UNITS",
    "check_gpu_request",
]

#: Predictive types: "nn" = MC over weight samples through the network; "glm" = MC-GLM, the
#: same samples pushed through the network's Jacobian (linearised predictive).
PRED_TYPES: dict[str, str] = {
    "nn": "Monte-Carlo over weight samples, average of softmax",
    "glm": "linearised (GLM) predictive, MC-GLM: the same weight samples pushed through the Jacobian (JVP); "
           "a last-layer posterior: closed-form logit covariance, MC over the Gaussian logits",
}

#: ImageNet-C's 15 corruptions by family (Hendrycks & Dietterich 2019; ``imagecorruptions``'
#: ``get_corruption_names``), in its order.
CORRUPTION_FAMILIES: dict[str, tuple[str, ...]] = {
    "noise": ("gaussian_noise", "shot_noise", "impulse_noise"),
    "blur": ("defocus_blur", "glass_blur", "motion_blur", "zoom_blur"),
    "weather": ("snow", "frost", "fog", "brightness"),
    "digital": ("contrast", "elastic_transform", "pixelate", "jpeg_compression"),
}
#: The 15: the shift sweep's default.
IMAGENET_C_NAMES: tuple[str, ...] = tuple(n for names in CORRUPTION_FAMILIES.values() for n in names)
#: Every corruption the sweep can run, in the report's order (implemented in
#: :data:`pipelines.ingest.corruptions.CORRUPTIONS`): the 15, then gaussian_blur (one of
#: ImageNet-C's validation corruptions, kept as an extra).
CORRUPTION_NAMES: tuple[str, ...] = IMAGENET_C_NAMES + ("gaussian_blur",)
SEVERITIES = (1, 2, 3, 4, 5)


def check_corruption(name: str, severity: int) -> None:
    """``ValueError`` in one line for an unknown corruption or a severity outside 1..5."""
    if name not in CORRUPTION_NAMES:
        raise ValueError(f"unknown corruption {name!r}; valid: {', '.join(CORRUPTION_NAMES)}")
    integral = isinstance(severity, int) or type(severity).__name__.startswith(("int", "uint"))
    if isinstance(severity, bool) or not integral or severity not in SEVERITIES:
        raise ValueError(f"corruption severity must be one of {', '.join(map(str, SEVERITIES))}, got {severity!r}")


#: Ray's resources are fixed-point numbers in units of 1e-4.
RESOURCE_UNITS = 10_000


def check_gpu_request(gpus_per_actor: float) -> str | None:
    """``None`` when ``gpus_per_actor`` can be placed next to copies of itself without
    waste (0, a whole number, or ``1/k`` in Ray's resource units of 1e-4, e.g. 0.5, 0.3333,
    0.1666); else why not, in one line."""
    x = float(gpus_per_actor)
    if x == 0 or (x >= 1 and x == int(x)):
        return None
    if 0 < x < 1:
        unit = round(x * RESOURCE_UNITS)  # what Ray schedules with
        k = RESOURCE_UNITS // max(unit, 1)
        left = RESOURCE_UNITS - k * unit
        if left < k:  # less than one unit per share left over: the shares tile the GPU
            return None
        return (f"{x:g} GPUs per actor does not tile a GPU ({k} fit, {left / RESOURCE_UNITS:.4g} of each GPU "
                f"left idle); use 1/k rounded down to 4 decimals (0.5, 0.3333, 0.25, 0.1666, ...) or a whole number")
    return f"{x:g} GPUs per actor: use a whole number above 1 (Ray places a fraction only within one GPU)"
