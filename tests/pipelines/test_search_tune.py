"""The search on Ray Tune (pipelines.evaluation.tune): the paper's protocol exactly, ASHA at a
fraction of its cost, retries and resumption.

Data: ``tiny_cnn`` (3 classes) on 192 random 8x8 images, labels = the model's own argmax
with 30% replaced at random (so the NLL of a configuration depends on ``(N, τ)``); diag and
KFAC posteriors from an MC Fisher; real local Ray (``ray_session``), 2 trials at once, 0.5 CPU
each. Ground truth: ``search_shard``, the loop the data-parallel search ran, in this process
on the whole split (every configuration, every example).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pipelines.evaluation.runtime import SearchConfig
from pipelines.evaluation.search import search, search_shard
from pipelines.evaluation.trials import sample_configs

N_EXAMPLES = 192
METHODS = ("diag", "kfac")
METRICS = ("nll", "ece", "accuracy", "brier")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from safetensors.torch import save_file

    import laplace_core as lc
    from pipelines.ingest.models import tiny_cnn

    root = tmp_path_factory.mktemp("tune")
    torch.manual_seed(0)
    model = tiny_cnn(3).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_EXAMPLES, 3, 8, 8, generator=g)
    with torch.no_grad():
        y = model(x).argmax(1)
    flip = torch.rand(N_EXAMPLES, generator=g) < 0.3
    y[flip] = torch.randint(0, 3, (int(flip.sum()),), generator=g)
    weights = str(root / "tiny.safetensors")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, weights)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, N_EXAMPLES, 16)]
    stats = lc.collect_statistics(model, batches, fisher="mc", generator=torch.Generator().manual_seed(1))
    uris, posts = {}, {}
    for m in METHODS:
        posts[m] = lc.build_posterior(stats, m)
        uris[m] = str(root / "posterior" / m)
        posts[m].save(uris[m])
    rows = [{"image": x[i].numpy(), "label": int(y[i]), "path": f"{i}.png", "valid": True} for i in range(N_EXAMPLES)]
    return {"model": {"name": "tiny_cnn", "weights": weights, "num_classes": 3}, "uris": uris, "rows": rows,
            "root": root, "net": model, "posts": posts, "batches": batches}


def _cfg(**kw) -> SearchConfig:
    base = dict(num_actors=2, batch_size=8, chunk_size=8, mc_samples=2, cpus_per_actor=0.5, torch_threads=1, seed=3,
                num_configs=24, log10_n=(0.0, 4.0), log10_tau=(-2.0, 3.0),
                method_ranges=(("kfac", None, (-1.0, 4.0)),))
    base.update(kw)
    return SearchConfig(**base)


@pytest.fixture(scope="module")
def full(ray_session, data):
    """``scheduler: none, algorithm: random``: every configuration on the whole split."""
    ds = ray_session.data.from_items(data["rows"], override_num_blocks=3)
    return search(data["model"], data["uris"], ds, _cfg(), output=str(data["root"] / "full"))


def test_random_without_scheduler_is_the_paper_protocol_exactly(full, data):
    """Acceptance 1: the same configurations (ids, log10 N, log10 τ) as ``sample_configs``
    and, per configuration, the objective values of the hand-written loop to 1e-12."""
    cfg = _cfg()
    # one chunk of the whole split: an example's prediction does not depend on the chunking
    ref = search_shard(data["net"], data["posts"], data["batches"], dataclasses.replace(cfg, chunk_size=N_EXAMPLES))
    for m in METHODS:
        rows = sorted((r for r in full.rows if r["method"] == m), key=lambda r: r["config_id"])
        assert [(r["config_id"], r["log10_n"], r["log10_tau"]) for r in rows] == [
            (c.config_id, c.log10_n, c.log10_tau) for c in sample_configs(cfg, m)]
        assert not ref["failed"][m]
        for r in rows:
            want = ref["acc"][m][r["config_id"]].compute()
            assert r["status"] == "ok" and r["count"] == r["images"] == N_EXAMPLES
            for k in METRICS:
                assert r[k] == pytest.approx(want[k], rel=1e-12, abs=1e-15), (m, r["config_id"], k)
        best = min(rows, key=lambda r: (r["nll"], r["config_id"]))
        assert full.chosen[m]["config_id"] == best["config_id"]
    want_map = ref["map"].compute()
    assert all(full.map[k] == pytest.approx(want_map[k], rel=1e-12) for k in METRICS)
    assert full.info["image_samples"] == full.info["image_samples_full"] == 2 * 24 * N_EXAMPLES * 2
    assert full.info["chunks"] == N_EXAMPLES // 8 and full.info["wall_s"] > 0


def test_asha_evaluates_a_quarter_and_chooses_among_complete_configurations(ray_session, full, data):
    """ASHA (grace period one chunk of 8 images, reduction factor 4) on 24 configurations per
    method evaluates at most a quarter of the full search's image-samples; it chooses among
    the configurations evaluated on the whole split, whose objective is the full search's.
    (Within 1% of the full search's best is NOT asserted: on this data, 8-image rungs are too
    noisy and the chosen diag configuration is 51% worse; see the issue's report.)"""
    import pyarrow.parquet as pq

    ds = ray_session.data.from_items(data["rows"], override_num_blocks=3)
    out = str(data["root"] / "asha")
    res = search(data["model"], data["uris"], ds, _cfg(scheduler="asha"), output=out)
    assert res.info["image_samples"] <= full.info["image_samples_full"] / 4, res.info
    for m in METHODS:
        rows = {r["config_id"]: r for r in full.rows if r["method"] == m}
        best = min(r["nll"] for r in rows.values())
        got = res.chosen[m]
        assert got is not None
        assert rows[got["config_id"]]["nll"] >= best
        complete = [r for r in res.rows if r["method"] == m and r["status"] == "ok"]
        assert got["nll"] == min(r["nll"] for r in complete)
        assert got["nll"] == pytest.approx(rows[got["config_id"]]["nll"], rel=1e-12)  # chosen among complete ones
        t = pq.read_table(f"{out}/eval/{m}/search.parquet").to_pylist()
        assert len(t) == 24 and {r["status"] for r in t} <= {"ok", "stopped"}
        assert any(r["status"] == "stopped" for r in t)
        for r in t:  # the images each configuration was evaluated on: whole chunks, all of them when "ok"
            assert r["images"] % 8 == 0 and (r["images"] == N_EXAMPLES) == (r["status"] == "ok"), r
    assert res.info["stopped"]["diag"] > 0 and res.info["scheduler"] == "asha"
