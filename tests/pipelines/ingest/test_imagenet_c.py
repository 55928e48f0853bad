"""All 15 ImageNet-C corruptions against the reference, ``imagecorruptions`` 1.1.2, byte for byte
at every severity: the reference as installed where it runs reproducibly, and a copy of its
source patched at exactly the calls that no longer run (glass_blur's ``multichannel=True``,
fog's ``np.float_``) or no longer read the global generator (impulse_noise's ``random_noise``).
Both sides draw from the same per-image generator. Pure numpy/PIL/scikit-image, no Ray."""
from __future__ import annotations

import importlib.util
import sys
import types
import warnings

import numpy as np
import pytest
from PIL import Image

from pipelines.config.choices import CORRUPTION_FAMILIES, IMAGENET_C_NAMES
from pipelines.ingest.corruptions import CORRUPTIONS, SEVERITIES, corrupt, corruption_rng

#: the patches, each with how often it must occur in the reference's source
PATCHES = (
    ("multichannel=True", "channel_axis=-1", 3),  # glass_blur (twice), gaussian_blur
    ("np.float_)", "np.float64)", 1),  # fog's plasma_fractal
    ("mode='s&p', amount=c)",
     "mode='s&p', amount=c, rng=np.random.default_rng(np.random.randint(0, 2**32, size=4, dtype=np.uint64)))", 1),
)
PATCHED = ("glass_blur", "fog", "impulse_noise")


def _reference_module():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from imagecorruptions import corruptions
    return corruptions


@pytest.fixture(scope="module")
def patched():
    """The reference's source with :data:`PATCHES` applied, as a module beside the original."""
    ref = _reference_module()
    src = open(importlib.util.find_spec("imagecorruptions.corruptions").origin).read()
    for old, new, count in PATCHES:
        assert src.count(old) == count, old
        src = src.replace(old, new)
    mod = types.ModuleType("imagecorruptions.corruptions")  # resource_filename resolves frost's files
    mod.__dict__["__package__"] = "imagecorruptions"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(src, ref.__file__ + " (patched)", "exec"), mod.__dict__)
    return mod


def _images():
    rng = np.random.default_rng(7)
    noise = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
    noise[0, 0], noise[0, 1] = 0, 255  # a black and a white pixel
    yy, xx = np.mgrid[0:33, 0:37]
    smooth = np.stack([yy * 7, xx * 6, (yy + xx) * 3], axis=-1).clip(0, 255).astype(np.uint8)
    return [noise, smooth]


def _run_reference(fn, img, severity, rs):
    saved = np.random.get_state()
    np.random.set_state(rs.get_state())
    try:
        return np.uint8(fn(Image.fromarray(img), severity))
    finally:
        np.random.set_state(saved)


def test_the_sweep_offers_imagenet_c_15_by_family():
    import imagecorruptions

    assert IMAGENET_C_NAMES == tuple(imagecorruptions.get_corruption_names("common"))
    for family, names in CORRUPTION_FAMILIES.items():
        assert names == tuple(imagecorruptions.get_corruption_names(family))
        assert all(CORRUPTIONS[n].family == family for n in names)
    assert set(CORRUPTIONS) - set(IMAGENET_C_NAMES) == {"gaussian_blur"}


@pytest.mark.parametrize("name", IMAGENET_C_NAMES)
def test_each_corruption_is_the_reference_byte_for_byte(name, patched):
    fn = getattr(patched if name in PATCHED else _reference_module(), name)
    for k, img in enumerate(_images()):
        for severity in SEVERITIES:
            expect = _run_reference(fn, img, severity, corruption_rng(0, name, f"img{k}"))
            before = np.random.get_state()[1].copy()
            got = corrupt(img, name, severity, corruption_rng(0, name, f"img{k}"))
            assert np.array_equal(np.random.get_state()[1], before)  # the global generator is left alone
            assert got.dtype == np.uint8 and got.shape == img.shape
            diff = np.flatnonzero(got != expect)
            assert diff.size == 0, f"{name} severity {severity} image {k}: {diff.size} bytes differ"
    if CORRUPTIONS[name].random:  # another image path, another draw
        img = _images()[0]
        assert not np.array_equal(corrupt(img, name, 3, corruption_rng(0, name, "a")),
                                  corrupt(img, name, 3, corruption_rng(0, name, "b")))


def test_the_unpatched_reference_fails_exactly_where_we_port():
    ref, img = _reference_module(), _images()[0]
    with pytest.raises(TypeError, match="multichannel"):
        ref.glass_blur(Image.fromarray(img), 1)
    with pytest.raises(AttributeError, match="float_"):
        ref.fog(Image.fromarray(img), 1)
    np.random.seed(0)
    a = ref.impulse_noise(Image.fromarray(img), 3)
    np.random.seed(0)
    assert not np.array_equal(a, ref.impulse_noise(Image.fromarray(img), 3))  # not reproducible as shipped
    assert "imagecorruptions.corruptions" in sys.modules
