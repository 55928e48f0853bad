"""ImageNet-C-style corruptions (Hendrycks & Dietterich 2019) of a decoded, cropped uint8 image.

Used by the distribution-shift sweep (``evaluate.shift``, :mod:`pipelines.evaluation.shift`):
the decode tasks apply one corruption at one severity to every test image after the
resize and centre crop and before ``ToTensor``/``Normalize`` (:func:`pipelines.ingest.decode.eval_transform`),
as ImageNet-C corrupts the 224 x 224 crop. Each function maps ``x`` (float64 ``[H, W, 3]``
in ``[0, 1]``, i.e. the uint8 image / 255) and the severity's parameter ``c`` to the
corrupted image in ``[0, 1]``; :func:`corrupt` returns ``floor(255 · clip(out, 0, 1) + 1e-6)``
as uint8 (truncation, as ImageNet-C's ``np.uint8`` of the float image; the ``1e-6`` keeps the
exact ``k/255`` of JPEG and pixelate at ``k``). Per-severity parameters
(severities 1..5) are ImageNet-C's:

===================  ==============================  ==========================================
name                 ``c`` for severity 1..5         definition
===================  ==============================  ==========================================
gaussian_noise       0.08, 0.12, 0.18, 0.26, 0.38    ``x + c ε``, ``ε ~ N(0, 1)`` per pixel and channel
gaussian_blur        1, 2, 3, 4, 6                   Gaussian filter of std ``c`` pixels over H and
                                                     W (edges repeated, kernel cut at ``4c``)
contrast             0.4, 0.3, 0.2, 0.1, 0.05        ``(x − μ) c + μ``, ``μ`` the per-channel mean
brightness           0.1, 0.2, 0.3, 0.4, 0.5         HSV value ``V → min(V + c, 1)``, hue and
                                                     saturation kept
jpeg_compression     25, 18, 15, 10, 7               JPEG-encode at quality ``c``, decode
pixelate             0.6, 0.5, 0.4, 0.3, 0.25        box-downsample to ``int(c W) x int(c H)``,
                                                     box-upsample back to ``W x H``
===================  ==============================  ==========================================

Brightness in closed form: with ``V = max_k x_k`` an RGB pixel is ``V`` times a function of
hue and saturation only, so changing ``V`` to ``V'`` with ``H, S`` fixed scales the pixel by
``V'/V`` (a black pixel, ``V = 0``, has ``S = H = 0`` and becomes the grey ``(V', V', V')``).

Randomness (gaussian noise) comes from :func:`corruption_rng`: a NumPy generator seeded by
SHA-256 of ``(seed, corruption, image path)``, so an image gets the same noise whichever
decode task, worker or run order it lands in (the path is relative to the split dir, as for
the MC labels' keys). The severity is not in the key: an image's noise at severity ``s`` is
``c_s ε`` with the same ``ε`` at every severity (common random numbers, so the metric-vs-severity
curve reflects the severity, not a fresh draw). Pure numpy + PIL: decode workers import no torch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
from typing import Callable

import numpy as np

from pipelines.config.choices import CORRUPTION_NAMES, SEVERITIES, check_corruption

__all__ = ["SEVERITIES", "Corruption", "CORRUPTIONS", "corruption_names", "check_corruption", "corruption_rng",
           "corrupt", "gaussian_kernel", "gaussian_filter"]


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


def _gaussian_noise(x: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    return x + rng.normal(size=x.shape, scale=c)


def _gaussian_blur(x: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    return gaussian_filter(x, c)


def _contrast(x: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    mu = x.mean(axis=(0, 1), keepdims=True)
    return (x - mu) * c + mu


def _brightness(x: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    v = x.max(axis=2, keepdims=True)
    v_new = np.minimum(v + c, 1.0)
    safe = np.where(v > 0, v, 1.0)
    return np.where(v > 0, x * (v_new / safe), v_new)


def _pil(x: np.ndarray):
    from PIL import Image

    return Image.fromarray(np.clip(np.round(x * 255.0), 0, 255).astype(np.uint8))


def _jpeg(x: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    from PIL import Image

    buf = io.BytesIO()
    _pil(x).save(buf, format="JPEG", quality=int(c))
    with Image.open(io.BytesIO(buf.getvalue())) as im:
        return np.asarray(im.convert("RGB"), dtype=np.float64) / 255.0


def _pixelate(x: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    from PIL import Image

    h, w = x.shape[:2]
    small = _pil(x).resize((max(1, int(w * c)), max(1, int(h * c))), Image.BOX)
    return np.asarray(small.resize((w, h), Image.BOX), dtype=np.float64) / 255.0


@dataclasses.dataclass(frozen=True)
class Corruption:
    """One corruption: ``fn(x, c, rng)`` on ``x`` in ``[0, 1]`` and its parameter ``c`` per severity."""

    name: str
    fn: Callable[[np.ndarray, float, np.random.Generator], np.ndarray]
    params: tuple[float, ...]
    random: bool = False


CORRUPTIONS: dict[str, Corruption] = {c.name: c for c in (
    Corruption("gaussian_noise", _gaussian_noise, (0.08, 0.12, 0.18, 0.26, 0.38), random=True),
    Corruption("gaussian_blur", _gaussian_blur, (1, 2, 3, 4, 6)),
    Corruption("contrast", _contrast, (0.4, 0.3, 0.2, 0.1, 0.05)),
    Corruption("brightness", _brightness, (0.1, 0.2, 0.3, 0.4, 0.5)),
    Corruption("jpeg_compression", _jpeg, (25, 18, 15, 10, 7)),
    Corruption("pixelate", _pixelate, (0.6, 0.5, 0.4, 0.3, 0.25)),
)}


def corruption_names() -> tuple[str, ...]:
    return tuple(CORRUPTIONS)


def corruption_rng(seed: int, name: str, path: str) -> np.random.Generator:
    """The generator of one image's corruption: keyed by ``(seed, name, path)`` (every severity)."""
    h = hashlib.sha256(f"{int(seed)}\x00{name}\x00{path}".encode()).digest()
    return np.random.default_rng(int.from_bytes(h[:16], "little"))


def corrupt(img: np.ndarray, name: str, severity: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """``img`` (uint8 ``[H, W, 3]``) under corruption ``name`` at ``severity`` (1..5): uint8 ``[H, W, 3]``.
    ``rng``: the image's generator (:func:`corruption_rng`); needed by the random corruptions."""
    check_corruption(name, severity)
    c = CORRUPTIONS[name]
    if c.random and rng is None:
        raise ValueError(f"corruption {name!r} is random: pass rng=corruption_rng(seed, name, path)")
    a = np.asarray(img)
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3:
        raise ValueError(f"corrupt needs a uint8 [H, W, 3] image, got {a.dtype} {a.shape}")
    out = c.fn(a.astype(np.float64) / 255.0, c.params[severity - 1], rng)
    # truncation as ImageNet-C's np.uint8; + 1e-6 keeps an exact k/255 (JPEG, pixelate) at k
    return np.floor(np.clip(out, 0.0, 1.0) * 255.0 + 1e-6).astype(np.uint8)
