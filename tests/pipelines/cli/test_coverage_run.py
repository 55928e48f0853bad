"""The smoke job end to end on a ``vit_b_16``-shaped and a ``convnext_tiny``-shaped model
(``vit_tiny_test``, ``convnext_tiny_test``: torchvision's own VisionTransformer / ConvNeXt
classes cut to 32x32 images and a few channels), in one job through the audit's ``models:``
list, with ``posterior.norm_layers: diag``, as a child process beside the suite (``tests/background.py``).

Checked: every stage finishes for both models; every parameter of the attention
projections, depthwise convolutions, LayerNorms and layer scales is under the posterior, and
so are the ViT's class token and position embedding (free parameters: their exact Fisher
diagonal, issue 40), nothing is left at MAP; the stored posteriors (KFAC, and INF with its
EFB pass) hold a diagonal block for every normalisation layer and free parameter; the run
summary and the report list the coverage.
"""
from __future__ import annotations

import json
from pathlib import Path

import background  # tests/background.py: whole jobs beside the suite
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODELS = ("vit_tiny_test", "convnext_tiny_test")


@background.job("coverage_run")
def _coverage_job(base: Path):
    """The job of both models in a child process, beside the suite (``tests/background.py``)."""
    out = base / "out"
    sets = [
        "model.name=resnet50",  # the smoke preset's single model back to the default: the job takes models: alone
        "models=[{name: vit_tiny_test, weights: random}, {name: convnext_tiny_test, weights: random}]",
        "posterior.norm_layers=diag",
        "posterior.methods=[kfac, inf]",  # a factored method, and the EFB pass INF needs
        "data.limit=60", "data.per_class=6", "data.partition_size=60",
        "data.val_limit=40", "data.test_limit=40", "data.ood_limit=40",
        "curvature.num_workers=1", "curvature.batch_size=30",
        "search.num_configs=1", "search.mc_samples=2",
        "evaluate.mc_samples=2", "evaluate.num_actors=1", "evaluate.batch_size=40",
    ]
    yield
    return background.smoke_job(out, sets)


@pytest.fixture(scope="module")
def coverage_run(tmp_path_factory):
    return background.result(_coverage_job, tmp_path_factory)


def test_smoke_job_on_vit_and_convnext_shaped_models(coverage_run):
    from laplace_core.io import load_tensors
    from laplace_core.curvature.layers import find_layers
    from laplace_core.posteriors.structures.base import Posterior
    from pipelines.ingest.models import load_model

    out = coverage_run
    for name in MODELS:
        mdir = out / "models" / name
        for stage in ("curvature", "posterior", "search", "evaluate", "report"):
            assert (mdir / "stages" / f"{stage}.json").exists(), (name, stage)
        summary = json.loads((mdir / "run.json").read_text())
        cov = summary["model"]["coverage"]
        assert "under the posterior (norm layers: diag)" in cov, cov
        report = (mdir / "report.md").read_text()
        assert "under the posterior" in report
        model = load_model(name, None, 10)
        mods, infos, excluded = find_layers(model, norm_layers="diag")
        at_map = sum(p.numel() for n, m in model.named_modules() if n in excluded for p in m.parameters(recurse=False))
        assert at_map == 0  # the ViT's class token + position embedding are free parameters under the posterior
        if name == "vit_tiny_test":
            assert {"class_token", "encoder.pos_embedding"} <= set(mods)
        assert any(type(m).__name__ in ("InProjView", "GroupView") for m in mods.values())
        assert f"at MAP: {at_map:,}" in cov
        norm = [k for k, i in infos.items() if i.kind == "norm"]
        assert norm
        for method in ("kfac", "inf"):
            post = Posterior.from_state_dict(dict(zip(("tensors", "meta"), load_tensors(str(mdir / "posterior" / method)))))
            assert list(post.layers) == list(infos), (name, method)
            assert all(post.layers[k].method == "diag" for k in norm), (name, method)
            assert all(post.layers[k].method == method for k in infos if k not in norm), (name, method)
