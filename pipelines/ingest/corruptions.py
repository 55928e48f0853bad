"""ImageNet-C's corruptions (Hendrycks & Dietterich 2019) of a decoded, cropped uint8 image.

Used by the distribution-shift sweep (``evaluate.shift``, :mod:`pipelines.evaluation.shift`):
the decode tasks apply one corruption at one severity to every test image after the
resize and centre crop and before ``ToTensor``/``Normalize`` (:func:`pipelines.ingest.decode.eval_transform`),
as ImageNet-C corrupts the 224 x 224 crop. The reference is ``imagecorruptions`` 1.1.2 (the port
of ImageNet-C's code): every one of its 15 corruptions, at its parameters, gives the reference's
bytes (tests/pipelines/ingest/test_imagenet_c.py). :func:`corrupt` returns ``np.uint8`` of the
corrupted image on 0..255 (truncation, as the reference's ``corrupt``).

Who computes what:

* here, faster than the reference and byte-identical to it: gaussian_noise (``x + c ε``),
  contrast (``(x − μ) c + μ``, ``μ`` the per-channel mean), jpeg_compression (PIL JPEG at
  quality ``c``), pixelate (box-downsample by ``c``, nearest-upsample back);
* :mod:`pipelines.ingest.imagenet_c`: glass_blur, fog and impulse_noise, the reference's
  algorithm with its calls that no longer run (or no longer take the global generator) fixed;
* the reference itself (:func:`pipelines.ingest.imagenet_c.reference`), with the image's
  generator: shot_noise, defocus_blur, motion_blur, zoom_blur, snow, frost (its textures ship
  with the package), brightness (scikit-image's HSV round trip), elastic_transform.

``gaussian_blur`` (a Gaussian filter of std ``c`` = 1, 2, 3, 4, 6 pixels, edges repeated) is
kept as an extra: it is one of ImageNet-C's validation corruptions, not of the 15, and is not in
the default sweep. The families (noise, blur, weather, digital) are ImageNet-C's.

Randomness comes from :func:`corruption_rng`: a legacy NumPy ``RandomState`` (the reference
draws from NumPy's global legacy generator) seeded by SHA-256 of ``(seed, corruption, image
path)``, so an image gets the same draws whichever decode task, worker or run order it lands
in (the path is relative to the split dir, as for the MC labels' keys). The severity is not in
the key: an image's noise at severity ``s`` is ``c_s ε`` with the same ``ε`` at every severity
(common random numbers, so the metric-vs-severity curve reflects the severity, not a fresh draw).
Decode workers import no torch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
from typing import Callable

import numpy as np

from pipelines.config.choices import CORRUPTION_FAMILIES, CORRUPTION_NAMES, SEVERITIES, check_corruption
from pipelines.ingest import imagenet_c

__all__ = ["SEVERITIES", "PARAMS", "Corruption", "CORRUPTIONS", "corruption_names", "check_corruption",
           "corruption_rng", "corrupt", "gaussian_kernel", "gaussian_filter"]

#: ImageNet-C's parameter per severity 1..5 (imagecorruptions 1.1.2), for the corruptions computed
#: here; the others' are in :mod:`pipelines.ingest.imagenet_c` or the reference.
PARAMS: dict[str, tuple[float, ...]] = {
    "gaussian_noise": (0.08, 0.12, 0.18, 0.26, 0.38),
    "gaussian_blur": (1, 2, 3, 4, 6),
    "contrast": (0.4, 0.3, 0.2, 0.1, 0.05),
    "jpeg_compression": (25, 18, 15, 10, 7),
    "pixelate": (0.6, 0.5, 0.4, 0.3, 0.25),
}


def gaussian_kernel(sigma: float, truncate: float = 4.0) -> np.ndarray:
    """Normalised 1-D Gaussian weights ``exp(−k²/2σ²)`` for ``|k| <= int(truncate σ + 0.5)``."""
    r = int(truncate * float(sigma) + 0.5)
    k = np.arange(-r, r + 1, dtype=np.float64)
    w = np.exp(-0.5 * (k / float(sigma)) ** 2)
    return w / w.sum()


def gaussian_filter(x: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian filter of ``x`` ``[H, W, C]`` over H and W, edges repeated ("nearest")."""
    w = gaussian_kernel(sigma)
    r = (len(w) - 1) // 2
    out = x.astype(np.float64)
    for axis in (0, 1):
        pad = [(0, 0)] * out.ndim
        pad[axis] = (r, r)
        p = np.pad(out, pad, mode="edge")
        n = out.shape[axis]
        acc = np.zeros_like(out)
        for j, wj in enumerate(w):
            acc += wj * np.take(p, np.arange(j, j + n), axis=axis)
        out = acc
    return out


def _x(a: np.ndarray) -> np.ndarray:
    return np.asarray(a) / 255.


def _gaussian_noise(a: np.ndarray, severity: int, rng) -> np.ndarray:
    x = _x(a)
    return np.clip(x + rng.normal(size=x.shape, scale=PARAMS["gaussian_noise"][severity - 1]), 0, 1) * 255


def _gaussian_blur(a: np.ndarray, severity: int, rng) -> np.ndarray:
    return np.clip(gaussian_filter(_x(a), PARAMS["gaussian_blur"][severity - 1]), 0, 1) * 255


def _contrast(a: np.ndarray, severity: int, rng) -> np.ndarray:
    x = _x(a)
    means = np.mean(x, axis=(0, 1), keepdims=True)
    return np.clip((x - means) * PARAMS["contrast"][severity - 1] + means, 0, 1) * 255


def _jpeg(a: np.ndarray, severity: int, rng) -> np.ndarray:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "JPEG", quality=PARAMS["jpeg_compression"][severity - 1])
    with Image.open(io.BytesIO(buf.getvalue())) as im:
        return np.asarray(im)


def _pixelate(a: np.ndarray, severity: int, rng) -> np.ndarray:
    from PIL import Image

    c, (h, w) = PARAMS["pixelate"][severity - 1], a.shape[:2]
    small = Image.fromarray(a).resize((int(w * c), int(h * c)), Image.BOX)
    return np.asarray(small.resize((w, h), Image.NEAREST))


def _reference(name: str) -> Callable:
    return lambda a, severity, rng: imagenet_c.reference(name, a, severity, rng)


@dataclasses.dataclass(frozen=True)
class Corruption:
    """One corruption: ``fn(a, severity, rng)`` of the uint8 image ``a``, on 0..255; where it is
    computed (``"here"``, ``"port"``: :mod:`pipelines.ingest.imagenet_c`, ``"reference"``)."""

    name: str
    fn: Callable[[np.ndarray, int, np.random.RandomState | None], np.ndarray]
    family: str
    source: str
    random: bool = False


_FNS = {
    "gaussian_noise": (_gaussian_noise, "here", True),
    "shot_noise": (_reference("shot_noise"), "reference", True),
    "impulse_noise": (imagenet_c.impulse_noise, "port", True),
    "defocus_blur": (_reference("defocus_blur"), "reference", False),
    "glass_blur": (imagenet_c.glass_blur, "port", True),
    "motion_blur": (_reference("motion_blur"), "reference", True),
    "zoom_blur": (_reference("zoom_blur"), "reference", False),
    "snow": (_reference("snow"), "reference", True),
    "frost": (_reference("frost"), "reference", True),
    "fog": (imagenet_c.fog, "port", True),
    "brightness": (_reference("brightness"), "reference", False),
    "contrast": (_contrast, "here", False),
    "elastic_transform": (_reference("elastic_transform"), "reference", True),
    "pixelate": (_pixelate, "here", False),
    "jpeg_compression": (_jpeg, "here", False),
    "gaussian_blur": (_gaussian_blur, "here", False),
}
_FAMILY = {n: f for f, names in CORRUPTION_FAMILIES.items() for n in names}

CORRUPTIONS: dict[str, Corruption] = {
    n: Corruption(n, _FNS[n][0], _FAMILY.get(n, "extra"), _FNS[n][1], _FNS[n][2]) for n in CORRUPTION_NAMES
}


def corruption_names() -> tuple[str, ...]:
    return tuple(CORRUPTIONS)


def corruption_rng(seed: int, name: str, path: str) -> np.random.RandomState:
    """The generator of one image's corruption: keyed by ``(seed, name, path)`` (every severity)."""
    h = hashlib.sha256(f"{int(seed)}\x00{name}\x00{path}".encode()).digest()
    return np.random.RandomState(np.frombuffer(h[:16], dtype="<u4"))


def corrupt(img: np.ndarray, name: str, severity: int, rng: np.random.RandomState | None = None) -> np.ndarray:
    """``img`` (uint8 ``[H, W, 3]``) under corruption ``name`` at ``severity`` (1..5): uint8 ``[H, W, 3]``.
    ``rng``: the image's generator (:func:`corruption_rng`); needed by the random corruptions."""
    check_corruption(name, severity)
    c = CORRUPTIONS[name]
    if c.random and rng is None:
        raise ValueError(f"corruption {name!r} is random: pass rng=corruption_rng(seed, name, path)")
    a = np.asarray(img)
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3:
        raise ValueError(f"corrupt needs a uint8 [H, W, 3] image, got {a.dtype} {a.shape}")
    return np.uint8(c.fn(np.ascontiguousarray(a), int(severity), rng))  # truncation, as the reference
