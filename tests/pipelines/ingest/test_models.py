"""pipelines.ingest.models: registry, state-dict files (torch / safetensors, local / S3), errors."""
from __future__ import annotations

import io

import pytest
import torch

from pipelines.ingest.models import load_model, model_names, read_state_dict, resolve_weights_enum


def _same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as e:
        load_model("resnet19")
    msg = str(e.value)
    assert "resnet19" in msg and "resnet18" in msg and "densenet121" in msg
    assert "\n" not in msg


def test_registry_contains_torchvision_and_demo():
    names = model_names()
    assert {"resnet18", "resnet50", "densenet121", "demo_cnn"} <= set(names)


def test_random_init_eval_mode_and_num_classes():
    m = load_model("resnet18", num_classes=3)
    assert not m.training and all(not mod.training for mod in m.modules())
    assert m.fc.out_features == 3
    with torch.no_grad():
        assert m(torch.randn(2, 3, 32, 32)).shape == (2, 3)


def test_torch_file_roundtrip_and_num_classes_inferred(tmp_path):
    torch.manual_seed(0)
    ref = load_model("resnet18", num_classes=7)
    p = tmp_path / "w.pt"
    torch.save({"state_dict": ref.state_dict()}, p)
    got = load_model("resnet18", weights=str(p))  # num_classes inferred from fc.weight
    assert got.fc.out_features == 7 and _same_params(ref, got) and not got.training


def test_safetensors_file_and_ddp_prefix(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(1)
    ref = load_model("resnet18", num_classes=4)
    p = tmp_path / "w.safetensors"
    save_file({f"module.{k}": v.contiguous() for k, v in ref.state_dict().items()}, str(p))
    got = load_model("resnet18", weights=str(p), num_classes=4)
    assert _same_params(ref, got)


def test_shape_mismatch_names_key_and_shapes(tmp_path):
    ref = load_model("resnet18", num_classes=7)
    p = tmp_path / "w.pt"
    torch.save(ref.state_dict(), p)
    with pytest.raises(ValueError) as e:
        load_model("resnet18", weights=str(p), num_classes=5)
    msg = str(e.value)
    assert "fc.weight" in msg and "(7, 512)" in msg and "(5, 512)" in msg and "\n" not in msg


def test_missing_and_unexpected_keys(tmp_path):
    sd = load_model("resnet18", num_classes=3).state_dict()
    missing = dict(sd)
    del missing["layer1.0.conv1.weight"]
    p = tmp_path / "missing.pt"
    torch.save(missing, p)
    with pytest.raises(ValueError, match="missing key 'layer1.0.conv1.weight'"):
        load_model("resnet18", weights=str(p), num_classes=3)
    extra = dict(sd)
    extra["head.bias"] = torch.zeros(3)
    p2 = tmp_path / "extra.pt"
    torch.save(extra, p2)
    with pytest.raises(ValueError, match="unexpected key 'head.bias'"):
        load_model("resnet18", weights=str(p2), num_classes=3)


class _Foo:
    pass


def test_pickled_object_rejected(tmp_path):
    p = tmp_path / "evil.pt"
    torch.save({"x": _Foo()}, p)
    with pytest.raises(ValueError, match="weights_only"):
        load_model("resnet18", weights=str(p))


def test_a_whole_pickled_model_is_one_line_asking_for_its_state_dict(tmp_path):
    """torch.save(model) instead of its state dict (a new user's mistake): torch's refusal is a
    paragraph with ANSI codes that advises loading with weights_only=False; ours names the class
    and the way out in one line."""
    p = tmp_path / "whole.pt"
    torch.save(load_model("resnet18", None, 4), p)
    with pytest.raises(ValueError) as e:
        load_model("resnet18", weights=str(p), num_classes=4)
    msg = str(e.value)
    assert "\n" not in msg and "\x1b" not in msg and "weights_only=False" not in msg
    assert "holds a pickled torchvision.models.resnet.ResNet" in msg and "model.state_dict()" in msg


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        read_state_dict(str(tmp_path / "nope.pt"))


def test_weights_enum_resolves_without_download():
    w = resolve_weights_enum("ResNet50_Weights.IMAGENET1K_V2")
    assert w.name == "IMAGENET1K_V2" and len(w.meta["categories"]) == 1000
    with pytest.raises(ValueError, match="unknown torchvision weights"):
        resolve_weights_enum("ResNet50_Weights.NOPE")
    with pytest.raises(ValueError, match="do not belong to model 'resnet18'"):
        load_model("resnet18", weights="ResNet50_Weights.IMAGENET1K_V2")
    with pytest.raises(ValueError, match="1000 classes"):
        load_model("resnet50", weights="ResNet50_Weights.IMAGENET1K_V2", num_classes=10)


def test_demo_cnn():
    pytest.importorskip("pipelines.ingest.demo_data")
    m = load_model("demo_cnn", num_classes=5)
    assert not m.training


def test_s3_weights(request, tmp_path):
    try:
        endpoint = request.getfixturevalue("moto_s3")
    except pytest.FixtureLookupError:
        pytest.skip("moto_s3 fixture (tests/pipelines/conftest.py) not available")
    import s3fs

    from pipelines.storage.uris import StorageOptions

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
    bucket = "models-test"
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    ref = load_model("resnet18", num_classes=2)
    buf = io.BytesIO()
    torch.save(ref.state_dict(), buf)
    with fs.open(f"{bucket}/r18.pt", "wb") as f:
        f.write(buf.getvalue())
    fs.invalidate_cache()
    got = load_model("resnet18", weights=f"s3://{bucket}/r18.pt", options=StorageOptions(endpoint))
    assert _same_params(ref, got)


def test_model_coverage_lists_the_layers_a_selection_leaves_at_map():
    """posterior.layers: the run's coverage line names the selected layers and those left at
    MAP (first and last few of many); the default ("all") line is unchanged."""
    from laplace_core.curvature.layer_selection import LayerSelectionError
    from pipelines.ingest.models import model_coverage

    cov = model_coverage("resnet18", 10, "map", "last")
    assert cov["weights_under_posterior"] == 10 * 513 and len(cov["at_map_layers"]) == 20
    assert cov["at_map_layers"][0] == "conv1" and cov["at_map_layers"][-1] == "layer4.1.conv2"
    assert "layers: last = fc; curvature layers at MAP: conv1, layer1.0.conv1, layer1.0.conv2, ..., " in cov["summary"]
    assert cov["summary"].count("(20)") == 1
    full = model_coverage("resnet18", 10)
    assert full["at_map_layers"] == [] and "(norm layers: map); at MAP: 9,600 (BatchNorm2d 9,600)" in full["summary"]
    with pytest.raises(LayerSelectionError, match="'head' matches no curvature layer"):
        model_coverage("resnet18", 10, "map", ["head"])
