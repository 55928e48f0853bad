"""timm architectures by name (``--model timm:NAME``): built without a download, weights from a
state-dict file, the model's own data config as the transforms, one-line errors (timm missing,
unknown names with timm's close matches), and ``infoform sizes`` coverage (issue 40, acceptance 1)."""
from __future__ import annotations

import re
import sys

import pytest
import torch

from pipelines.cli.main import main
from pipelines.config.load import load_config
from pipelines.errors import PreflightError
from pipelines.ingest.models import check_weights, load_model
from pipelines.ingest.transforms import default_transforms

timm = pytest.importorskip("timm")


def _save(model, path):
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if str(path).endswith(".safetensors"):
        save_file(sd, str(path))
    else:
        torch.save(sd, str(path))
    return str(path)


def test_timm_name_builds_the_architecture_with_the_data_classes_in_eval_mode():
    m = load_model("timm:resnet10t", "random", 3)
    assert type(m).__module__.startswith("timm.") and not m.training
    assert m.fc.out_features == 3
    with torch.no_grad():
        assert m(torch.randn(2, 3, 32, 32)).shape == (2, 3)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_timm_state_dict_round_trip_infers_the_head_and_gives_the_same_logits(tmp_path, suffix):
    torch.manual_seed(0)
    net = timm.create_model("test_vit", pretrained=False, num_classes=4).eval()
    w = _save(net, tmp_path / f"vit{suffix}")
    m = load_model("timm:test_vit", w)  # num_classes from the file's head
    x = torch.randn(2, 3, 160, 160)
    with torch.no_grad():
        assert torch.equal(m(x), net(x))
    assert check_weights("timm:test_vit", w) == {"head": "head", "num_classes": 4}


def test_timm_weights_of_another_architecture_are_one_line(tmp_path):
    w = _save(timm.create_model("test_convnext", pretrained=False, num_classes=4), tmp_path / "c.safetensors")
    with pytest.raises(ValueError) as e:
        load_model("timm:test_vit", w)
    assert "weights do not fit model 'timm:test_vit'" in str(e.value) and "\n" not in str(e.value)


def test_unknown_timm_name_gets_timms_close_matches(capsys):
    with pytest.raises(ValueError, match=r"unknown timm model 'convnext_atoo'; did you mean timm:convnext_atto"):
        load_model("timm:convnext_atoo", "random")
    assert main(["sizes", "--model", "timm:vit_smal_patch16_224"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "timm:vit_small_patch16_224" in err and "timm.list_models()" in err
    cfg = load_config("smoke", ["model.name=timm:resnet10tt", "model.weights=random"])
    with pytest.raises(PreflightError, match=r"did you mean timm:resnet10t"):
        from pipelines.cli.preflight import preflight

        preflight(cfg, dry_run=True)


def test_missing_timm_is_one_line_exit_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "timm", None)  # `import timm` raises ImportError, as when not installed
    assert main(["sizes", "--model", "timm:resnet10t"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "needs timm, which is not installed: pip install 'infoform[timm]'" in err
    with pytest.raises(ValueError, match="not installed"):
        load_model("timm:resnet10t", "random", 3)


def test_transforms_come_from_the_timm_data_config_and_the_log_says_so():
    t = default_transforms("timm:vit_small_patch16_224")
    # pretrained_cfg: input 224, crop_pct 0.9 -> resize floor(224 / 0.9) = 248, mean = std = 0.5, bicubic
    assert (t["image_size"], t["resize_size"], t["mean"], t["std"]) == (224, 248, (0.5,) * 3, (0.5,) * 3)
    r = default_transforms("timm:resnet10t")  # 176 px, crop_pct 0.875 -> 201, ImageNet statistics
    assert (r["image_size"], r["resize_size"]) == (176, 201) and r["mean"] == pytest.approx((0.485, 0.456, 0.406))
    from pipelines.ingest.plan import custom_preset

    sets, why = custom_preset("timm:vit_small_patch16_224", "w.pt", "data")
    assert "data.image_size=224" in sets and "data.resize_size=248" in sets and "data.mean=[0.5, 0.5, 0.5]" in sets
    assert "timm vit_small_patch16_224's data config" in why and "bicubic, the pipeline resizes bilinearly" in why
    assert 'output="runs/vit_small_patch16_224-data"' in sets


def _coverage(name: str, norm: str, capsys) -> float:
    assert main(["sizes", "--model", name, "--norm-layers", norm]) == 0
    out = capsys.readouterr().out
    if name == "timm:vit_small_patch16_224" and norm == "map":  # what stays at MAP, and why
        assert ("at MAP in VisionTransformer: cls_token, pos_embed: parameters of no Linear, Conv or normalisation "
                "module: at MAP (--norm-layers diag puts them under their exact Fisher diagonal") in out
    elif norm == "diag":  # the free parameters (pos_embed, cls_token, gammas) too: nothing left at MAP
        assert "at MAP: 0 (none)" in out
    return float(re.search(r"coverage: ([0-9.]+)% of", out).group(1))


@pytest.mark.parametrize("name,at_map,diag", [
    ("timm:vit_small_patch16_224", 99.5, 99.9),
    ("timm:convnext_atto", 99.5, 99.9),
    ("timm:efficientnet_b0", 99.2, 99.9),
])
def test_sizes_coverage_of_timm_models(name, at_map, diag, capsys):
    """Acceptance 1: ``infoform sizes --model timm:NAME`` prints the coverage; by default as the job
    runs ``--model`` (the custom preset's norm layers: diag), which puts the norm layers and the free
    parameters (ViT's pos_embed / cls_token, ConvNeXt's gammas) under their exact Fisher diagonal;
    with ``--norm-layers map`` (Table 3's counting) EfficientNet's BatchNorms (0.79%) stay at MAP."""
    assert _coverage(name, "map", capsys) >= at_map
    assert _coverage(name, "diag", capsys) >= diag
    assert main(["sizes", "--model", name]) == 0
    out = capsys.readouterr().out
    assert "(norm layers: diag)" in out and float(re.search(r"coverage: ([0-9.]+)% of", out).group(1)) >= diag
