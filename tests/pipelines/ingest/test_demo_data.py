"""Offline demo data (sklearn digits as an ImageFolder, rendered letters A-J) and the small CNN.
No Ray."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from laplace_core.curvature.layers import find_layers
from pipelines.ingest import demo_data as dd

pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def digits_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo") / "digits"
    info = dd.write_digits_imagefolder(root, size=32, seed=0)
    assert info["written"] is True
    return root


def test_digits_files_split_and_counts(digits_root):
    from sklearn.datasets import load_digits

    target = load_digits().target
    per_class = np.bincount(target, minlength=10)
    files = {s: sorted(digits_root.glob(f"{s}/*/*.jpg")) for s in dd.SPLITS}
    assert sum(len(v) for v in files.values()) == len(target) == 1797
    names = [f.name for v in files.values() for f in v]
    assert len(set(names)) == 1797  # every digit exactly once, named by its index
    for c in range(10):
        n = {s: len(list((digits_root / s / f"digit_{c}").glob("*.jpg"))) for s in dd.SPLITS}
        assert sum(n.values()) == per_class[c]
        assert n["test"] == round(per_class[c] * 0.15) and n["val"] == round(per_class[c] * 0.15)
        # the label folder matches sklearn's target for every file
        for s in dd.SPLITS:
            for f in (digits_root / s / f"digit_{c}").glob("*.jpg"):
                assert target[int(f.stem)] == c
    marker = json.loads((digits_root / dd.DIGITS_MARKER).read_text())
    assert marker["counts"]["train"]["digit_3"] == len(list((digits_root / "train/digit_3").glob("*.jpg")))


def test_digits_jpegs_decode_to_the_source_pixels(digits_root):
    from sklearn.datasets import load_digits

    images = load_digits().images
    f = next((digits_root / "val" / "digit_7").glob("*.jpg"))
    with Image.open(f) as img:
        assert img.mode == "RGB" and img.size == (32, 32)
        arr = np.asarray(img.convert("L"), dtype=np.float64)
    # 4x4 block means recover the 8x8 source up to JPEG/resampling error (scale 0..255)
    blocks = arr.reshape(8, 4, 8, 4).mean(axis=(1, 3))
    src = images[int(f.stem)] * 255 / 16
    assert np.abs(blocks - src).mean() < 20, np.abs(blocks - src).mean()
    x, y, classes = dd.load_imagefolder(digits_root, "val")
    assert classes == list(dd.DIGIT_CLASSES)
    assert x.shape == (len(y), 3, 32, 32) and x.dtype == torch.float32
    assert -1.0 <= float(x.min()) and float(x.max()) <= 1.0


def test_digits_idempotent_and_config_checked(digits_root):
    before = {p: p.stat().st_mtime_ns for p in digits_root.rglob("*.jpg")}
    again = dd.write_digits_imagefolder(digits_root, size=32, seed=0)
    assert again["written"] is False
    assert {p: p.stat().st_mtime_ns for p in digits_root.rglob("*.jpg")} == before
    with pytest.raises(ValueError, match="another root"):
        dd.write_digits_imagefolder(digits_root, size=32, seed=1)
    assert not list(digits_root.glob(".staging-*"))


def test_digits_split_is_deterministic(tmp_path, digits_root):
    dd.write_digits_imagefolder(tmp_path / "d2", size=8, seed=0)
    a = sorted(p.relative_to(digits_root).as_posix() for p in digits_root.rglob("*.jpg"))
    b = sorted(p.relative_to(tmp_path / "d2").as_posix() for p in (tmp_path / "d2").rglob("*.jpg"))
    assert a == b


def test_letters_ood(tmp_path):
    info = dd.write_letters_ood(tmp_path / "letters", size=32, n_per_letter=6, seed=0)
    assert info["written"] and info["classes"] == list("ABCDEFGHIJ")
    x, y, classes = dd.load_imagefolder(tmp_path / "letters")
    assert classes == list("ABCDEFGHIJ") and x.shape == (60, 3, 32, 32)
    assert torch.bincount(y).tolist() == [6] * 10
    # a glyph was drawn: some pixels bright, background dark
    assert float((x > 0.5).float().mean()) > 0.02 and float((x < -0.9).float().mean()) > 0.3
    assert dd.write_letters_ood(tmp_path / "letters", size=32, n_per_letter=6, seed=0)["written"] is False
    # same seed, same images
    dd.write_letters_ood(tmp_path / "l2", size=32, n_per_letter=6, seed=0)
    x2, _, _ = dd.load_imagefolder(tmp_path / "l2")
    assert torch.equal(x, x2)


def test_small_cnn_layers():
    model = dd.small_cnn(10, seed=0)
    _, infos, excluded = find_layers(model)
    assert {k: v.shape for k, v in infos.items()} == {
        "conv1": (16, 28), "conv2": (32, 144), "conv3": (32, 289), "fc1": (64, 513), "fc2": (10, 65)
    }
    assert list(excluded) == ["bn2"]
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert torch.equal(dd.small_cnn(10, seed=0).conv1.weight, model.conv1.weight)


def test_train_small_cnn_accuracy_and_cache(digits_root, tmp_path):
    cache = tmp_path / "cache"
    model, info = dd.train_small_cnn(digits_root, epochs=3, seed=0, cache_path=cache, num_threads=1)
    assert not info.cached and info["val_accuracy"] == info.val_accuracy
    assert info.val_accuracy > 0.8, info
    assert not model.training
    # independent check of the reported accuracy
    x, y, _ = dd.load_imagefolder(digits_root, "val")
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).double().mean().item()
    assert acc == pytest.approx(info.val_accuracy, abs=1e-12)
    assert (cache / "small_cnn.safetensors").exists() and (cache / "small_cnn.json").exists()
    model2, info2 = dd.train_small_cnn(digits_root, epochs=3, seed=0, cache_path=cache)
    assert info2.cached and info2.val_accuracy == info.val_accuracy
    sd1, sd2 = model.state_dict(), model2.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    with pytest.raises(ValueError, match="write_digits_imagefolder"):
        dd.train_small_cnn(tmp_path, epochs=1)
