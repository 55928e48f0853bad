"""The ``infoform`` CLI (``python -m pipelines``): ``sizes`` offline, without weights or data."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipelines.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONWARNINGS"] = "ignore"
    return subprocess.run(
        [sys.executable, "-m", "pipelines", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def param_counts(model):
    """Independent count straight from the parameters of Linear / ungrouped Conv2d modules."""
    diag = kfac = 0
    for mod in model.modules():
        if type(mod) in (nn.Linear, nn.Conv2d) and getattr(mod, "groups", 1) == 1:
            params = list(mod.parameters(recurse=False))
            m = mod.weight.shape[0]
            n = sum(p.numel() for p in params) // m
            diag += sum(p.numel() for p in params)
            kfac += m * m + n * n
    return diag, kfac


def test_sizes_json_resnet18_offline():
    torchvision = pytest.importorskip("torchvision")
    res = run_cli("sizes", "--model", "resnet18", "--rank", "100", "--norm-layers", "map", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    model = torchvision.models.resnet18(weights=None)
    diag, kfac = param_counts(model)
    meth = out["methods"]
    assert meth["diag"]["numbers"] == diag == 11_679_912  # Lee et al. 2020, Table 3
    assert meth["kfac"]["numbers"] == kfac
    assert meth["efb"]["numbers"] == meth["kfac_exact"]["numbers"] == kfac + diag
    assert round(meth["diag"]["mb"], 1) == 44.6
    assert meth["diag"]["mb"] == pytest.approx(diag * 4 / 2**20, rel=1e-12)
    # INF needs statistics: only a labelled lower bound
    assert meth["inf"]["numbers"] is None
    assert diag < meth["inf"]["lower_bound"] <= 12_317_373
    assert out["num_layers"] == 21 and len(out["excluded"]) == 20  # 20 BatchNorms stay point estimates


def test_unknown_model_is_one_line_exit_2():
    res = run_cli("sizes", "--model", "resnet1800")
    assert res.returncode == 2
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, res.stderr
    assert "unknown model 'resnet1800'" in lines[0] and "resnet18" in lines[0]
    assert res.stdout == ""


def test_sizes_table_in_process(capsys):
    assert main(["sizes", "--model", "resnet18", "--rank", "100", "--norm-layers", "map"]) == 0
    out = capsys.readouterr().out
    assert "11,679,912" in out and "44.6" in out and "lower bound" in out


def test_usage_errors_exit_2(capsys):
    assert main(["sizes"]) == 2
    assert main(["sizes", "--model", "resnet18", "--stats", "/nonexistent"]) == 2  # --stats needs --rank
    assert main(["sizes", "--model", "resnet18", "--rank", "3", "--stats", "/nonexistent/stats"]) == 2
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "--rank" in err and "cannot load statistics" in err
    with pytest.raises(SystemExit) as e:
        main(["sizes", "--model", "resnet18", "--rank", "0"])
    assert e.value.code == 2


def test_sizes_with_statistics_file(tmp_path, capsys):
    """--stats gives the exact INF count, equal to the posterior's own num_stored()."""
    lc = pytest.importorskip("laplace_core")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 5))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(2)]
    stats = lc.collect_statistics(model, batches, generator=torch.Generator().manual_seed(1))
    stats = lc.collect_statistics(model, batches, generator=torch.Generator().manual_seed(1), basis=lc.eigenbasis(stats))
    uri = str(tmp_path / "stats")
    stats.save(uri)
    assert main(["sizes", "--stats", uri, "--rank", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    post = lc.build_posterior(stats, "inf", rank=6)
    assert out["methods"]["inf"]["numbers"] == post.num_stored()
    for meth in ("diag", "kfac", "kfac_exact", "efb"):
        assert out["methods"][meth]["numbers"] == lc.build_posterior(stats, meth).num_stored(), meth


COVERAGE_MODELS = ("resnet50", "densenet121", "vit_b_16", "swin_t", "convnext_tiny", "efficientnet_b0",
                   "mobilenet_v3_large", "resnext50_32x4d", "regnet_y_400mf")


def _sizes_json(capsys, *args):
    assert main(["sizes", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", COVERAGE_MODELS)
def test_sizes_norm_layers_diag_covers_the_torchvision_zoo(capsys, name):
    """--norm-layers diag: at least 99.5% of the parameters (counted here from the model) are
    under the posterior (attention projections, grouped/depthwise convs, norm layers)."""
    torchvision = pytest.importorskip("torchvision")
    out = _sizes_json(capsys, "--model", name, "--norm-layers", "diag")
    try:
        with torch.device("meta"):
            model = torchvision.models.get_model(name, weights=None)
    except NotImplementedError:  # regnet reads tensor values in its constructor
        model = torchvision.models.get_model(name, weights=None)
    total = sum(p.numel() for p in model.parameters())
    assert out["num_weights"] >= 0.995 * total, (name, out["num_weights"] / total)
    cov = out["coverage"]
    assert cov["total_parameters"] == total and cov["weights_under_posterior"] == out["num_weights"]
    assert cov["weights_at_map"] == total - out["num_weights"] == sum(cov["at_map_by_type"].values())
    assert "BatchNorm2d" not in cov["at_map_by_type"] and "LayerNorm" not in cov["at_map_by_type"]


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "resnet152", "densenet121", "densenet161"])
def test_sizes_norm_layers_map_keeps_the_table3_counts(capsys, name):
    """``--norm-layers map`` counts exactly the Linear / Conv2d layers, as in Lee et al. (2020)
    Table 3: BatchNorm parameters are reported at MAP."""
    torchvision = pytest.importorskip("torchvision")
    out = _sizes_json(capsys, "--model", name, "--norm-layers", "map")
    with torch.device("meta"):
        model = torchvision.models.get_model(name, weights=None)
    diag, kfac = param_counts(model)
    assert out["methods"]["diag"]["numbers"] == out["num_weights"] == diag
    assert out["methods"]["kfac"]["numbers"] == kfac
    bn = sum(p.numel() for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters())
    assert out["coverage"]["at_map_by_type"] == {"BatchNorm2d": bn}


def test_sizes_default_counts_the_norm_layers_as_the_job_runs_a_model(capsys):
    """Without --norm-layers, ``sizes --model`` counts what the job runs for ``--model`` without
    ``--preset``: the custom preset's ``posterior.norm_layers`` (diag), not the papers' map."""
    from pipelines.config.load import preset_settings

    assert preset_settings("custom").posterior.norm_layers == "diag"
    assert preset_settings("imagenet-resnet50").posterior.norm_layers == "map"
    default = _sizes_json(capsys, "--model", "resnet18")
    assert default == _sizes_json(capsys, "--model", "resnet18", "--norm-layers", "diag")
    assert default["num_weights"] > _sizes_json(capsys, "--model", "resnet18", "--norm-layers", "map")["num_weights"]
    assert default["coverage"]["weights_at_map"] == 0


def test_sizes_table_lists_coverage_and_bad_norm_layers_exit_2(capsys):
    assert main(["sizes", "--model", "vit_b_16", "--norm-layers", "map"]) == 0
    text = capsys.readouterr().out
    assert "coverage: " in text and "at MAP: " in text and "LayerNorm" in text
    with pytest.raises(SystemExit) as e:
        main(["sizes", "--model", "resnet18", "--norm-layers", "full"])
    assert e.value.code == 2


def test_sizes_layers_last_counts_fc_only_and_a_bad_glob_exits_2(capsys):
    """``--layers last`` on resnet18: the posterior over ``fc`` (1000 x 513) alone, Table 3 counting
    (KFAC: 513² + 1000²); every conv is listed at MAP; a name matching nothing is one line, exit 2."""
    out = _sizes_json(capsys, "--model", "resnet18", "--layers", "last", "--norm-layers", "map")
    assert [ls["name"] for ls in out["layers"]] == ["fc"] and out["num_weights"] == 1000 * 513
    assert out["methods"]["diag"]["numbers"] == 513_000 and out["methods"]["kfac"]["numbers"] == 513**2 + 1000**2
    assert out["coverage"]["layers"] == "last" and out["coverage"]["at_map_by_type"]["Conv2d"] == 11_166_912
    assert sum(why.startswith("not in the selected") for why in out["excluded"].values()) == 20
    two = _sizes_json(capsys, "--model", "resnet18", "--layers", "layer4.1.*,fc", "--norm-layers", "map")
    assert [ls["name"] for ls in two["layers"]] == ["layer4.1.conv1", "layer4.1.conv2", "fc"]
    assert main(["sizes", "--model", "resnet18", "--layers", "head"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "'head' matches no curvature layer" in err and "fc" in err
