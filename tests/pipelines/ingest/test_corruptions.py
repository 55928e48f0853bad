"""ImageNet-C corruptions (pipelines.ingest.corruptions) computed here, each against its
definition (the reference comparison is tests/pipelines/ingest/test_imagenet_c.py), and their
place in decoding (after the crop, before ToTensor/Normalize). Pure numpy/PIL, no Ray."""
from __future__ import annotations

import colorsys
import io

import numpy as np
import pytest
from PIL import Image

from pipelines.ingest.corruptions import CORRUPTIONS, PARAMS as IMPL_PARAMS, SEVERITIES, corrupt, corruption_rng, gaussian_filter
from pipelines.ingest.decode import decode_image, eval_transform

PARAMS = {  # Hendrycks & Dietterich (2019), per severity 1..5
    "gaussian_noise": (0.08, 0.12, 0.18, 0.26, 0.38),
    "gaussian_blur": (1, 2, 3, 4, 6),
    "contrast": (0.4, 0.3, 0.2, 0.1, 0.05),
    "jpeg_compression": (25, 18, 15, 10, 7),
    "pixelate": (0.6, 0.5, 0.4, 0.3, 0.25),
}


def _image(h=24, w=20, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _quantise(x):  # ImageNet-C's: np.uint8 (truncation) of the clipped image on 0..255
    return np.uint8(np.clip(x, 0, 1) * 255)


def test_the_per_severity_parameters_are_imagenet_c():
    assert IMPL_PARAMS == PARAMS
    assert SEVERITIES == (1, 2, 3, 4, 5)


@pytest.mark.parametrize("severity", SEVERITIES)
def test_gaussian_noise_has_the_severity_sigma_and_is_keyed_by_path(severity):
    sigma = PARAMS["gaussian_noise"][severity - 1]
    img = np.full((64, 64, 3), 128, dtype=np.uint8)  # mid grey: little clipping at every severity
    rng = corruption_rng(0, "gaussian_noise", "n01/a.JPEG")
    out = corrupt(img, "gaussian_noise", severity, rng)
    # the definition, with the same generator: x + sigma * N(0, 1), clipped, truncated
    eps = corruption_rng(0, "gaussian_noise", "n01/a.JPEG").normal(size=img.shape)
    assert np.array_equal(out, _quantise(128 / 255 + sigma * eps))
    # the empirical std of the noise is the severity's sigma, after clipping to [0, 1] (12,288
    # draws: 5% is ~7 standard errors of a std estimate), against 10^6 independent draws
    d = out.astype(np.float64) / 255
    big = _quantise(128 / 255 + sigma * np.random.default_rng(99).normal(size=10**6)) / 255
    assert d.std() == pytest.approx(big.std(), rel=0.05)
    if severity <= 2:  # no clipping to speak of: the std is sigma itself
        assert d.std() == pytest.approx(sigma, rel=0.05)
    again = corrupt(img, "gaussian_noise", severity, corruption_rng(0, "gaussian_noise", "n01/a.JPEG"))
    other = corrupt(img, "gaussian_noise", severity, corruption_rng(0, "gaussian_noise", "n01/b.JPEG"))
    assert np.array_equal(out, again) and not np.array_equal(out, other)
    if severity > 1:  # common random numbers: the same epsilon, scaled by the severity's sigma
        lower = corrupt(img, "gaussian_noise", severity - 1, corruption_rng(0, "gaussian_noise", "n01/a.JPEG"))
        assert np.abs(lower.astype(int) - 128).sum() < np.abs(out.astype(int) - 128).sum()
    with pytest.raises(ValueError, match="is random: pass rng="):
        corrupt(img, "gaussian_noise", severity)


@pytest.mark.parametrize("severity", SEVERITIES)
def test_gaussian_blur_is_the_nearest_mode_gaussian_filter(severity):
    from scipy.ndimage import gaussian_filter as scipy_gaussian

    sigma = PARAMS["gaussian_blur"][severity - 1]
    img = _image(30, 26)
    x = img / 255.0
    ref = scipy_gaussian(x, sigma=(sigma, sigma, 0), mode="nearest", truncate=4.0)
    np.testing.assert_allclose(gaussian_filter(x, sigma), ref, rtol=0, atol=1e-12)
    out = corrupt(img, "gaussian_blur", severity)
    assert np.abs(out.astype(int) - _quantise(ref).astype(int)).max() <= 1  # floor at float ties only
    assert (out == _quantise(ref)).mean() > 0.99


@pytest.mark.parametrize("severity", SEVERITIES)
def test_contrast_shrinks_towards_the_channel_mean(severity):
    c = PARAMS["contrast"][severity - 1]
    img = _image()
    x = img / 255.0
    mu = x.reshape(-1, 3).mean(0)
    ref = (x - mu) * c + mu
    np.testing.assert_allclose(CORRUPTIONS["contrast"].fn(img, severity, None) / 255, np.clip(ref, 0, 1),
                               rtol=0, atol=1e-15)
    assert np.array_equal(corrupt(img, "contrast", severity), _quantise(ref))


@pytest.mark.parametrize("severity", SEVERITIES)
def test_brightness_adds_to_the_hsv_value(severity):
    """The reference's scikit-image HSV round trip, against colorsys: within 1 (float ties)."""
    c = (0.1, 0.2, 0.3, 0.4, 0.5)[severity - 1]
    img = _image(12, 10)
    img[0, 0] = 0  # a black pixel (V = 0)
    img[0, 1] = 255  # a white one (V clipped at 1)
    x = img / 255.0
    ref = np.empty_like(x)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            h, s, v = colorsys.rgb_to_hsv(*x[i, j])
            ref[i, j] = colorsys.hsv_to_rgb(h, s, min(v + c, 1.0))
    got = corrupt(img, "brightness", severity).astype(int)
    assert np.abs(got - _quantise(ref).astype(int)).max() <= 1 and (got == _quantise(ref)).mean() > 0.9


@pytest.mark.parametrize("severity", SEVERITIES)
def test_jpeg_compression_is_a_jpeg_round_trip_at_the_severity_quality(severity):
    q = PARAMS["jpeg_compression"][severity - 1]
    img = _image(32, 32)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=q)
    ref = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    assert np.array_equal(corrupt(img, "jpeg_compression", severity), ref)


@pytest.mark.parametrize("severity", SEVERITIES)
def test_pixelate_box_downsamples_and_nearest_upsamples(severity):
    f = PARAMS["pixelate"][severity - 1]
    img = _image(40, 32)
    small = Image.fromarray(img).resize((int(32 * f), int(40 * f)), Image.BOX)
    ref = np.asarray(small.resize((32, 40), Image.NEAREST))
    assert np.array_equal(corrupt(img, "pixelate", severity), ref)


def test_bad_names_and_severities_are_one_line_errors():
    with pytest.raises(ValueError, match="unknown corruption 'spatter'; valid: gaussian_noise, shot_noise"):
        corrupt(_image(), "spatter", 1)
    with pytest.raises(ValueError, match="severity must be one of 1, 2, 3, 4, 5, got 6"):
        corrupt(_image(), "contrast", 6)


def test_decoding_corrupts_the_crop_before_normalising():
    """decode_image with a corruption = corrupt(the uint8 crop), then ToTensor and Normalize."""
    img = _image(40, 48, seed=3)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    data = buf.getvalue()
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    got, err = decode_image(data, 32, 36, mean, std, corrupt=lambda a: corrupt(a, "contrast", 3))
    assert err == ""
    crop = np.round(eval_transform(Image.fromarray(img), 32, 36, (0, 0, 0), (1, 1, 1)) * 255).astype(np.uint8)
    expect = corrupt(crop.transpose(1, 2, 0), "contrast", 3).transpose(2, 0, 1).astype(np.float32) / np.float32(255)
    expect = (expect - np.float32(mean).reshape(3, 1, 1)) / np.float32(std).reshape(3, 1, 1)
    np.testing.assert_array_equal(got, expect.astype(np.float32))


def test_the_shift_sweep_config_is_validated_in_one_line():
    from pipelines.config.choices import IMAGENET_C_NAMES
    from pipelines.config.load import load_config
    from pipelines.config.schema import ConfigError

    assert load_config("smoke", []).evaluate.shift is None  # no sweep unless asked for
    sh = load_config("smoke", ["evaluate.shift.severities=[1, 3]"]).evaluate.shift
    assert sh.severities == (1, 3) and sh.corruptions == IMAGENET_C_NAMES and len(sh.corruptions) == 15
    with pytest.raises(ConfigError) as e:
        load_config("smoke", ["evaluate.shift={corruptions: [gaussian_noise, spatter]}"])
    assert str(e.value).count("\n") == 0 and "unknown corruption 'spatter'; valid: gaussian_noise" in str(e.value)
    with pytest.raises(ConfigError, match="severity must be one of 1, 2, 3, 4, 5, got 0"):
        load_config("smoke", ["evaluate.shift.severities=[0]"])
    with pytest.raises(ConfigError, match="listed twice"):
        load_config("smoke", ["evaluate.shift.severities=[2, 2]"])
    assert load_config("smoke", ["posterior.methods=[temperature, inf]"]).posterior.methods == ("temperature", "inf")


def test_the_config_names_exactly_the_implemented_corruptions():
    """The config validates against ``pipelines.config.choices`` (below the stages); the
    implementation here must cover exactly that set, in its order."""
    from pipelines.config.choices import CORRUPTION_NAMES

    assert tuple(CORRUPTIONS) == CORRUPTION_NAMES
