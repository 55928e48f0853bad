"""ImageNet-C's reference corruptions (``imagecorruptions`` 1.1.2, the port of Hendrycks &
Dietterich's code), run with a per-image generator, and the two it can no longer run.

:func:`reference` calls ``imagecorruptions.corruptions.<name>(PIL image, severity)``, the
reference itself: its draws come from NumPy's global legacy generator, so the call swaps in the
image's own :class:`numpy.random.RandomState` (:func:`pipelines.ingest.corruptions.corruption_rng`)
for its duration, under a lock, and restores the global state after (the image's generator
keeps the state it advanced to). ``imagecorruptions`` imports ``pkg_resources`` (setuptools<82).

Three corruptions are ported here because the reference cannot run them reproducibly today:

* :func:`glass_blur`: the reference's ``gaussian(..., multichannel=True)`` (removed from
  scikit-image) becomes ``channel_axis=-1``. The local shuffle keeps the reference's exact
  semantics: its tuple "swap" of two NumPy views copies ``x[h', w']`` into ``x[h, w]`` and leaves
  ``x[h', w']`` as it was; done in the reference's order, with its draws (one
  ``randint(-d, d, size=(n, 2))`` per iteration is the same stream as ``n`` calls of
  ``size=(2,)``), on packed Python integers instead of per-pixel NumPy calls.
* :func:`fog`: ``np.float_`` (removed in NumPy 2) becomes ``np.float64``; the diamond-square
  plasma fractal draws from the image's generator.
* :func:`impulse_noise`: scikit-image's ``random_noise`` no longer reads the global generator
  (it seeds a fresh PCG64 from the OS when given none), so the reference's salt-and-pepper call
  gets an explicit ``rng``, a PCG64 seeded by four 32-bit draws of the image's generator.

The tests (tests/pipelines/ingest/test_imagenet_c.py) compare each byte for byte with a copy of
the reference's source patched at exactly those calls.
"""
from __future__ import annotations

import threading
import warnings

import numpy as np

__all__ = ["GLASS_BLUR", "FOG", "IMPULSE_NOISE", "reference", "glass_blur", "fog", "impulse_noise",
           "plasma_fractal"]

#: (sigma, max_delta, iterations) per severity, as the reference.
GLASS_BLUR = ((0.7, 1, 2), (0.9, 2, 1), (1, 2, 3), (1.1, 3, 2), (1.5, 4, 2))
#: (strength, wibble decay) per severity, as the reference.
FOG = ((1.5, 2), (2., 2), (2.5, 1.7), (2.5, 1.5), (3., 1.4))
#: salt-and-pepper fraction per severity, as the reference.
IMPULSE_NOISE = (.03, .06, .09, 0.17, 0.27)

_LOCK = threading.Lock()


def _module():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pkg_resources' deprecation warning
        from imagecorruptions import corruptions
    return corruptions


def reference(name: str, a: np.ndarray, severity: int, rs: np.random.RandomState | None) -> np.ndarray:
    """``imagecorruptions.corruptions.<name>`` of the uint8 image ``a``, its global draws taken
    from ``rs`` (a fresh, unused generator where ``rs`` is None: the deterministic ones)."""
    from PIL import Image

    fn = getattr(_module(), name)
    rs = np.random.RandomState(0) if rs is None else rs
    with _LOCK:
        saved = np.random.get_state()
        np.random.set_state(rs.get_state())
        try:
            out = fn(Image.fromarray(a), severity)
        finally:
            rs.set_state(np.random.get_state())
            np.random.set_state(saved)
    return np.asarray(out)


def _gaussian(x: np.ndarray, sigma: float) -> np.ndarray:
    from skimage.filters import gaussian

    return gaussian(x, sigma=sigma, channel_axis=-1)


def _local_shuffle(x: np.ndarray, delta: int, iterations: int, rs: np.random.RandomState) -> np.ndarray:
    """The reference's loop ``x[h, w] = x[h + dy, w + dx]`` for h, w descending from the far
    edge minus ``delta`` to ``delta + 1``, ``(dx, dy)`` drawn per pixel, ``iterations`` times."""
    h_, w_ = x.shape[:2]
    hs, ws = np.arange(h_ - delta, delta, -1), np.arange(w_ - delta, delta, -1)
    if not len(hs) or not len(ws):
        return x
    hh, ww = np.repeat(hs, len(ws)), np.tile(ws, len(hs))
    p = ((x[..., 0].astype(np.int64) << 16) | (x[..., 1].astype(np.int64) << 8) | x[..., 2]).ravel().tolist()
    for _ in range(iterations):
        d = rs.randint(-delta, delta, size=(len(hh), 2))
        dst, src = (hh * w_ + ww).tolist(), ((hh + d[:, 1]) * w_ + ww + d[:, 0]).tolist()
        for i, j in zip(dst, src):
            p[i] = p[j]
    q = np.asarray(p, dtype=np.int64).reshape(h_, w_)
    return np.stack([(q >> 16) & 255, (q >> 8) & 255, q & 255], axis=-1).astype(np.uint8)


def glass_blur(a: np.ndarray, severity: int, rs: np.random.RandomState) -> np.ndarray:
    """ImageNet-C's glass blur of the uint8 image ``a`` (values on 0..255, float)."""
    sigma, delta, iterations = GLASS_BLUR[severity - 1]
    x = np.uint8(_gaussian(np.asarray(a) / 255., sigma) * 255)
    x = _local_shuffle(x, delta, iterations, rs)
    return np.clip(_gaussian(x / 255., sigma), 0, 1) * 255


def plasma_fractal(mapsize: int, wibbledecay: float, rs: np.random.RandomState) -> np.ndarray:
    """The reference's diamond-square height map on ``[0, 1]``, ``mapsize`` a power of two."""
    assert mapsize & (mapsize - 1) == 0
    m = np.empty((mapsize, mapsize), dtype=np.float64)
    m[0, 0] = 0
    step, wibble = mapsize, 100

    def wibbled_mean(arr):
        return arr / 4 + wibble * rs.uniform(-wibble, wibble, arr.shape)

    while step >= 2:
        corner = m[0:mapsize:step, 0:mapsize:step]
        square = corner + np.roll(corner, shift=-1, axis=0)
        square += np.roll(square, shift=-1, axis=1)
        m[step // 2:mapsize:step, step // 2:mapsize:step] = wibbled_mean(square)
        dr = m[step // 2:mapsize:step, step // 2:mapsize:step]
        ul = m[0:mapsize:step, 0:mapsize:step]
        left = (dr + np.roll(dr, 1, axis=0)) + (ul + np.roll(ul, -1, axis=1))
        m[0:mapsize:step, step // 2:mapsize:step] = wibbled_mean(left)
        top = (dr + np.roll(dr, 1, axis=1)) + (ul + np.roll(ul, -1, axis=0))
        m[step // 2:mapsize:step, 0:mapsize:step] = wibbled_mean(top)
        step //= 2
        wibble /= wibbledecay
    m -= m.min()
    return m / m.max()


def fog(a: np.ndarray, severity: int, rs: np.random.RandomState) -> np.ndarray:
    """ImageNet-C's fog of the uint8 image ``a`` (values on 0..255, float)."""
    strength, decay = FOG[severity - 1]
    h, w = a.shape[:2]
    map_size = 1 << (int(max(a.shape)) - 1).bit_length()
    x = np.asarray(a) / 255.
    max_val = x.max()
    x += strength * plasma_fractal(map_size, decay, rs)[:h, :w][..., np.newaxis]
    return np.clip(x * max_val / (max_val + strength), 0, 1) * 255


def impulse_noise(a: np.ndarray, severity: int, rs: np.random.RandomState) -> np.ndarray:
    """ImageNet-C's salt-and-pepper noise of the uint8 image ``a``, its generator explicit."""
    from skimage.util import random_noise

    gen = np.random.default_rng(rs.randint(0, 2**32, size=4, dtype=np.uint64))
    x = random_noise(np.asarray(a) / 255., mode="s&p", amount=IMPULSE_NOISE[severity - 1], rng=gen)
    return np.clip(x, 0, 1) * 255
