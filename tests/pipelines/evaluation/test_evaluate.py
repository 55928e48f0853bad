"""pipelines.evaluation.evaluate on real local Ray: sharding invariance, agreement with a direct
single-process computation, and the issue's acceptance test on the bundled digits.

Data: scikit-learn digits written as a 16x16 ImageFolder and letters A-J rendered
from a system font as the OOD set (``pipelines.ingest.demo_data``), read through
``pipelines.ingest.batches.build_dataset`` (Ray Data). Model: ``demo_cnn`` trained for a few
epochs in the test (weights saved as safetensors, loaded by the actors from the URI).
Curvature: ``laplace_core.collect_statistics`` in this process (MC Fisher, EFB pass).
"""
from __future__ import annotations

import math

import pytest
import torch

import laplace_core as lc
from laplace_core.metrics.suite import MetricSuite
from laplace_core.predictive.monte_carlo import MCPredictor
from pipelines.storage.store import RunStore
from pipelines.evaluation.evaluate import evaluate
from pipelines.evaluation.predictors import MAP
from pipelines.evaluation.runtime import EvalConfig, SearchConfig
from pipelines.evaluation.search import search

METHODS = ("diag", "kfac", "efb", "inf")
SIZE = 16
NORM = (0.5, 0.5, 0.5)
TOL = 1e-12  # float64 sums in a different order: ~1e-16 relative; counts/histograms exact


@pytest.fixture(scope="module")
def digits(demo_cnn_posteriors):
    d = demo_cnn_posteriors(SIZE, METHODS, letters=True, with_basis=True, inf_rank=100)
    assert d["info"].val_accuracy > 0.9
    return d


def _data_cfg(digits, split):
    from pipelines.ingest.index import DataConfig

    if split == "ood":
        return DataConfig(root=str(digits["root"] / "letters"), split=None, unlabeled=True, image_size=SIZE,
                          resize_size=SIZE, mean=NORM, std=NORM, decode_batch_size=64)
    return DataConfig(root=str(digits["root"] / "digits"), split=split, image_size=SIZE, resize_size=SIZE,
                      mean=NORM, std=NORM, decode_batch_size=64)


def _ds(digits, split):
    from pipelines.ingest.batches import build_dataset
    from pipelines.ingest.scan import scan

    c = _data_cfg(digits, split)
    return build_dataset(scan(c), c)


def _local_xy(digits, split):
    """Valid images of a split decoded in this process (same decoder as the Ray path) and
    the number of invalid files (the letters root also holds the writer's JSON marker)."""
    from pipelines.ingest.batches import iter_local_batches
    from pipelines.ingest.scan import scan

    c = _data_cfg(digits, split)
    xs, ys, bad = [], [], 0
    for b in iter_local_batches(scan(c), c, batch_size=128):
        ok = torch.from_numpy(b["valid"])
        bad += int((~ok).sum())
        xs.append(torch.from_numpy(b["image"])[ok])
        ys.append(torch.from_numpy(b["label"])[ok])
    return torch.cat(xs), torch.cat(ys), bad


def _assert_close(a, b, path="", tol=TOL):
    """Recursive comparison: ints/str/bool exactly, floats to ``tol`` (relative, absolute near 0)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, sorted(set(a) ^ set(b)))
        for k in a:
            _assert_close(a[k], b[k], f"{path}.{k}", tol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            _assert_close(u, v, f"{path}[{i}]", tol)
    elif isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, rel_tol=tol, abs_tol=tol), (path, a, b)
    else:
        assert a == b, (path, a, b)


def _strip(res):
    return {m: {k: v for k, v in r.items() if k != "timing"} for m, r in res.items()}


def test_one_and_two_actors_and_a_killed_actor_agree_and_match_a_direct_computation(ray_session, digits, capsys):
    """1 actor, 2 actors, and 2 actors of which one exits its process after its first batch
    (``fault_marker``, ``max_failures=1``: the round starts again) give the same metrics."""
    import os

    from pipelines.storage import uris as storage

    cfg = dict(mc_samples=3, seed=11, batch_size=32, dtype="float64", torch_threads=1, cpus_per_actor=0.5)
    out1, out2 = str(digits["root"] / "run1"), str(digits["root"] / "run2")
    r1 = evaluate(digits["model"], digits["uris"], _ds(digits, "test"), _ds(digits, "ood"),
                  EvalConfig(num_actors=1, **cfg), store=RunStore.open(out1))
    r2 = evaluate(digits["model"], digits["uris"], _ds(digits, "test"), _ds(digits, "ood"),
                  EvalConfig(num_actors=2, **cfg), store=RunStore.open(out2))
    assert list(r1) == [MAP, *METHODS]
    assert all(r["status"] == "ok" for r in r1.values())
    _assert_close(_strip(r1), _strip(r2))
    marker = str(digits["root"] / "eval-fault.json")
    capsys.readouterr()
    r3 = evaluate(digits["model"], digits["uris"], _ds(digits, "test"), _ds(digits, "ood"),
                  EvalConfig(num_actors=2, max_failures=1, fault_marker=marker, **cfg))
    assert os.path.exists(marker), "the fault was not injected"
    assert "an actor died" in capsys.readouterr().out
    _assert_close(_strip(r2), _strip(r3))
    for m in r1:  # the merged accumulators themselves (sums, counts, histograms)
        a1 = storage.read_json(f"{out1}/eval/{m}/accumulators.json")
        a2 = storage.read_json(f"{out2}/eval/{m}/accumulators.json")
        p1, p2 = a1.pop("per_image"), a2.pop("per_image")  # per-image vectors: in actor order
        _assert_close(a1, a2, m)
        for side in ("inp", "out"):  # the same images, each with the same numbers, in another order
            _assert_close({k: sorted(v) for k, v in p1[side].items()}, {k: sorted(v) for k, v in p2[side].items()}, m)
        assert storage.read_json(f"{out2}/eval/{m}/metrics.json")["ece"] == r2[m]["ece"]

    # independent single-process computation: MCPredictor on the whole split at once
    from pipelines.ingest.models import load_model

    model = load_model("demo_cnn", digits["model"]["weights"], 10).to(torch.float64)
    x, y, bad = _local_xy(digits, "test")
    x_ood, _, bad_ood = _local_xy(digits, "ood")
    assert bad == 0 and r2[MAP]["skipped"]["count"] == 0
    assert r2[MAP]["ood_skipped"]["count"] == bad_ood  # invalid files are counted, not evaluated
    x, x_ood = x.to(torch.float64), x_ood.to(torch.float64)
    for m in r1:
        if m == MAP:
            with torch.no_grad():
                p, p_ood = torch.softmax(model(x), -1), torch.softmax(model(x_ood), -1)
                lp = torch.log_softmax(model(x), -1)
        else:
            pred = MCPredictor(model, lc.load_posterior(digits["uris"][m]), n_samples=3, seed=11)
            p, p_ood = pred.predict(x), pred.predict(x_ood)
            lp = pred.predict_batches_stats([x])[0][0]  # exact log-mean-exp (issue 27), no 1e-12 floor
        suite = MetricSuite.create().update(p, y, lp).update_ood(p_ood)
        direct = suite.compute()
        got = {k: r2[m][k] for k in direct}
        _assert_close(direct, got, m)
        assert r2[m]["count"] == len(y) and r2[m]["ood"]["n_out"] == len(x_ood)
        ent = -(torch.special.xlogy(p_ood, p_ood).sum(-1)) / math.log(10)
        assert r2[m]["ood_entropy_mean"] == pytest.approx(float(ent.clamp(0, 1).mean()), rel=TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_actors_sharing_a_gpu_match_a_direct_cuda_computation(ray_session, digits):
    """2 actors with half a GPU each (``gpus_per_actor=0.5``: model, posteriors and draws on
    CUDA) give the metrics of one process running the same predictors on the GPU, and the
    search runs there too. Draws come from a CUDA generator, so they differ from the CPU
    run's; the comparison is with the same device's draws."""
    from pipelines.ingest.models import load_model

    gpu_tol = 1e-9  # float64 on the GPU: the actors' batches of 32 reduce in another order than one batch
    cfg = dict(mc_samples=3, seed=11, batch_size=32, dtype="float64", torch_threads=1, cpus_per_actor=0.5,
               gpus_per_actor=0.5)
    r = evaluate(digits["model"], digits["uris"], _ds(digits, "test"), _ds(digits, "ood"),
                 EvalConfig(num_actors=2, **cfg))
    assert all(v["status"] == "ok" for v in r.values()), {m: v.get("reason") for m, v in r.items()}
    model = load_model("demo_cnn", digits["model"]["weights"], 10).to(torch.float64).cuda()
    x, y, _ = _local_xy(digits, "test")
    x_ood, _, _ = _local_xy(digits, "ood")
    x, x_ood = x.to(torch.float64).cuda(), x_ood.to(torch.float64).cuda()
    for m in r:
        if m == MAP:
            with torch.no_grad():
                p, p_ood = torch.softmax(model(x), -1), torch.softmax(model(x_ood), -1)
                lp = torch.log_softmax(model(x), -1)
        else:
            pred = MCPredictor(model, lc.load_posterior(digits["uris"][m]).to("cuda"), n_samples=3, seed=11)
            p, p_ood = pred.predict(x), pred.predict(x_ood)
            lp = pred.predict_batches_stats([x])[0][0]  # exact NLL (issue 27)
        assert p.is_cuda
        direct = MetricSuite.create().update(p, y, lp).update_ood(p_ood).compute()
        _assert_close(direct, {k: r[m][k] for k in direct}, m, gpu_tol)

    scfg = SearchConfig(configs=[(2.0, 3.0), (4.0, 3.5)], mc_samples=2, seed=0, batch_size=64, num_actors=2,
                        torch_threads=1, gpus_per_actor=0.5)
    found = search(digits["model"], digits["uris"], _ds(digits, "val"), scfg)
    assert all(row["status"] == "ok" for row in found.rows), found.rows
    assert all(found.chosen[m] is not None for m in METHODS), found.notes


def test_glm_predictive_in_evaluation_matches_glm_predictor(digits):
    """pred_type="glm": the evaluation path (fixed-size batches, accumulators) gives the
    metrics of laplace_core.predictive.glm.GLMPredictor (MC-GLM, Banerjee Alg. 4) run directly."""
    from laplace_core.predictive.glm import GLMPredictor
    from pipelines.evaluation.evaluate import evaluate_shard
    from pipelines.ingest.models import load_model

    model = load_model("demo_cnn", digits["model"]["weights"], 10).to(torch.float64)
    x, y, _ = _local_xy(digits, "test")
    x, y = x[:48].to(torch.float64), y[:48]
    posts = {m: lc.load_posterior(digits["uris"][m]) for m in ("diag", "inf")}
    cfg = EvalConfig(pred_type="glm", mc_samples=4, seed=5, batch_size=16, dtype="float64", torch_threads=1)
    acc, info = evaluate_shard(model, posts, [(x[:20], y[:20]), (x[20:], y[20:])], None, cfg)
    assert not info["failed"]
    for m, post in posts.items():
        pred = GLMPredictor(model, post, 4, 5, link="mc", variance="mc")
        p = pred.predict(x)
        f0, jv = pred.logit_directions(x)  # the exact NLL (issue 27): log-mean-exp over the 4 MC-GLM draws
        lp = torch.logsumexp(torch.log_softmax((f0[None] + jv).to(torch.float64), -1), 0) - math.log(4)
        direct = MetricSuite.create().update(p, y, lp).compute()
        got = acc[m].compute()
        _assert_close({k: direct[k] for k in ("accuracy", "nll", "brier")}, {k: got[k] for k in ("accuracy", "nll", "brier")}, m)
    with pytest.raises(ValueError, match="pred_type"):
        EvalConfig(pred_type="laplace")


def test_acceptance_digits_search_then_evaluate(ray_session, digits):
    """The issue's acceptance: search runs, every method's ECE is reported, and every
    Laplace method's mean OOD entropy (letters) is above the MAP's at the chosen (N, τ).

    Search ranges (measured on this model, see the H8 report): the Fisher of a well-trained
    small CNN is tiny, so the posterior is prior-dominated and only a band of ``τ`` is
    informative. Below ``τ ~ 10^2.5`` diag/EFB/INF accuracy collapses; above ``τ ~ 10^3.5``
    every method is indistinguishable from the MAP (accuracy and NLL equal to 3 digits,
    OOD-entropy differences at the MC-noise level, ~1e-3, of either sign). The validation
    NLL decreases monotonically in ``τ`` here (the MAP makes 4 errors in 269 validation
    images), so an NLL search picks the top of whatever range it is given; a range
    reaching ``τ = 10^5`` chooses a posterior equal to the MAP up to MC noise, and the
    comparison below would test noise. ``N`` stops at ``10^4`` because KFAC's prior
    convention (Ritter eq. 9) adds ``sqrt(N τ) (A/M ⊕ G/M)`` to the precision, which makes
    KFAC far more concentrated than the others at the same large ``N``.
    """
    out = str(digits["root"] / "acceptance")
    scfg = SearchConfig(num_configs=8, log10_n=(2.0, 4.0), log10_tau=(2.5, 3.5), mc_samples=5, seed=0,
                        batch_size=64, num_actors=2, concurrent_trials=1, torch_threads=1)  # trials < an actor's start
    found = search(digits["model"], digits["uris"], _ds(digits, "val"), scfg, store=RunStore.open(out))
    assert set(found.chosen) == set(METHODS)
    assert all(found.chosen[m] is not None for m in METHODS), found.notes
    res = evaluate(digits["model"], digits["uris"], _ds(digits, "test"), _ds(digits, "ood"),
                   EvalConfig(mc_samples=30, seed=0, num_actors=2, batch_size=64, torch_threads=1),
                   store=RunStore.open(out), hyper=found.hyper())
    assert list(res) == [MAP, *METHODS]
    for m, r in res.items():
        assert r["status"] == "ok", (m, r["reason"])
        assert math.isfinite(r["ece"]) and r["ece_variant"] == "ece_equal_width_15"
        assert 0.0 <= r["ece"] <= 1.0
    map_h = res[MAP]["ood_entropy_mean"]
    for m in METHODS:
        assert res[m]["n_data"] == found.chosen[m]["n_data"]
        assert res[m]["ood_entropy_mean"] > map_h, (m, res[m]["ood_entropy_mean"], map_h, found.chosen[m])
        # not a degenerate (noise) posterior: test accuracy stays near the MAP's
        assert res[m]["accuracy"] >= res[MAP]["accuracy"] - 0.05, (m, res[m]["accuracy"], res[MAP]["accuracy"])


def test_an_actor_that_cannot_load_a_posterior_stops_the_stage_in_one_block(ray_session, digits, capsys):
    """A posterior URI the actors cannot read (here a missing folder; in the field, an S3
    endpoint that did not reach them): the stage ends at once with a ``StageError`` naming the
    URI, on the first attempt (no retry of a deterministic failure), and no actor prints a
    traceback."""
    import time

    from pipelines.errors import StageError

    uris = {**digits["uris"], "inf": str(digits["root"] / "posterior" / "no-such-method")}
    cfg = EvalConfig(num_actors=2, mc_samples=1, batch_size=32, torch_threads=1, cpus_per_actor=0.5, max_failures=2)
    capsys.readouterr()
    t0 = time.perf_counter()
    with pytest.raises(StageError) as err:
        evaluate(digits["model"], uris, _ds(digits, "test"), None, cfg)
    msg = str(err.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    assert "EvalWorker: 2 of 2 actor(s) could not start" in msg and "FileNotFoundError" in msg, msg
    assert "no-such-method" in msg and "manifest.json not found" in msg, msg
    time.sleep(1.0)  # the actors' output reaches the driver asynchronously
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and "an actor died" not in out.out, out
    print(f"stopped after {time.perf_counter() - t0:.1f} s: {msg}")


class _Idle:
    pass


def test_actors_waiting_for_resources_are_reported(ray_session, capsys):
    """An actor that asks for more GPUs than the cluster has waits; every ``log_every_s`` the
    driver says what it asks for and what the cluster has, and the wait ends when it dies."""
    import threading

    from pipelines.evaluation.actors import actor_options, wait_for_actors

    cfg = EvalConfig(num_actors=1, gpus_per_actor=1000.0, cpus_per_actor=0.0, log_every_s=0.5)
    actor = ray_session.remote(_Idle).options(**actor_options(cfg)).remote()
    waiter = threading.Thread(target=wait_for_actors, args=([actor.__ray_ready__.remote()], cfg, "EvalWorker"),
                              daemon=True)
    waiter.start()
    waiter.join(2.0)
    assert waiter.is_alive(), "the actor cannot be placed: the wait must go on"
    ray_session.kill(actor)
    waiter.join(30.0)
    assert not waiter.is_alive()
    out = capsys.readouterr().out
    assert "[EvalWorker] 1 of 1 actor(s) not started after" in out
    assert "'num_gpus': 1000.0" in out and "set evaluate.gpus_per_actor=0" in out


def test_the_waiting_hint_names_only_a_setting_that_cannot_be_met():
    """A request that fits the cluster is not told to change its GPUs (it is slow to start)."""
    from pipelines.evaluation.actors import _waiting_hint

    assert "gpus_per_actor=0" in _waiting_hint(EvalConfig(gpus_per_actor=1.0), {"CPU": 2.0})
    assert "add GPU nodes" in _waiting_hint(EvalConfig(gpus_per_actor=4.0), {"CPU": 8.0, "GPU": 2.0})
    assert "cpus_per_actor" in _waiting_hint(EvalConfig(gpus_per_actor=0.0, cpus_per_actor=4.0), {"CPU": 2.0})
    fits = _waiting_hint(EvalConfig(gpus_per_actor=0.0, cpus_per_actor=0.5), {"CPU": 2.0})
    assert "gpus_per_actor" not in fits and "room for them" in fits


class _Unplaceable:
    def run(self, actor_index: int = 0):
        return {}


def test_actors_that_cannot_be_placed_end_the_stage_after_the_timeout(ray_session):
    """Actors that ask for more than the cluster has (here 1000 GPUs) are not waited for
    forever: after ``placement_timeout_s`` the stage ends with one line saying what was asked
    and what the cluster has."""
    from pipelines.errors import StageError
    from pipelines.evaluation.actors import run_actors

    cfg = EvalConfig(num_actors=2, gpus_per_actor=1000.0, cpus_per_actor=0.0, log_every_s=0.5,
                     placement_timeout_s=2.0)
    with pytest.raises(StageError) as err:
        run_actors(_Unplaceable, (), [], cfg)
    msg = str(err.value)
    assert "\n" not in msg and "2 of 2 actor(s) could not be placed within 2 s" in msg, msg
    assert "'num_gpus': 1000.0" in msg and "the cluster has" in msg and "placement_timeout_s" in msg, msg


def test_iter_chunks_gives_fixed_size_batches_in_order():
    from pipelines.evaluation.chunks import iter_chunks

    g = torch.Generator().manual_seed(0)
    sizes = [5, 0, 17, 3, 30, 15]  # 70 rows in uneven pieces
    xs = [torch.randn(n, 3, 2, 2, generator=g) for n in sizes]
    ys = [torch.arange(n) for n in sizes]
    chunks = list(iter_chunks(zip(xs, ys), 16, 2, dtype=torch.float64))
    assert [len(c.xs) for c in chunks] == [2, 2, 1]
    assert all(x.shape == (16, 3, 2, 2) and x.dtype == torch.float64 for c in chunks for x in c.xs)
    assert [s for c in chunks for s in c.sizes] == [16, 16, 16, 16, 6]
    real = torch.cat([x[:n] for c in chunks for x, n in zip(c.xs, c.sizes)])
    assert torch.equal(real, torch.cat(xs).to(torch.float64))
    assert torch.equal(torch.cat([y for c in chunks for y in c.ys]), torch.cat(ys))
    assert not chunks[-1].xs[0][6:].any()  # zero padding


def test_eval_accumulator_json_round_trip_and_merge():
    from pipelines.evaluation.evaluate import EvalAccumulator

    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(40, 5, generator=g, dtype=torch.float64), -1)
    y = torch.randint(0, 5, (40,), generator=g)
    q = torch.softmax(torch.randn(10, 5, generator=g, dtype=torch.float64), -1)
    cfg = EvalConfig()
    whole = EvalAccumulator.create(cfg).update(p, y).update_ood(q)
    parts = (EvalAccumulator.create(cfg).update(p[:25], y[:25]).update_ood(q[:3])).merge(
        EvalAccumulator.create(cfg).update(p[25:], y[25:]).update_ood(q[3:]))
    back = EvalAccumulator.from_json(parts.to_json())
    _assert_close(whole.compute(), back.compute())
    h = -(torch.special.xlogy(q, q).sum(-1)) / math.log(5)
    assert back.compute()["ood_entropy_mean"] == pytest.approx(float(h.mean()), rel=1e-14)


def test_actor_progress_lines(capsys, monkeypatch):
    """Actor 0 logs images (its count x num_actors), images/s and the ETA from
    ``expected_rows``; other actors log nothing; unknown totals give '?'."""
    from pipelines.evaluation import actors as ev

    clock = iter([0.0, 0.0, 10.0, 10.0, 20.0])
    monkeypatch.setattr(ev.time, "perf_counter", lambda: next(clock))
    cfg = EvalConfig(num_actors=2, log_every_s=5.0, expected_rows=(400, None))
    p0 = ev.ActorProgress("evaluate", 0, cfg)  # clock 0.0
    p0(0, 50)  # now 0.0: too early
    p0(0, 50)  # now 10.0: 2 x 100 images in 10 s -> 20 img/s, (400 - 200) / 20 = 10 s left
    p0(1, 30)  # OOD starts at 10.0; now 10.0: too early
    p0(1, 30)  # now 20.0: 2 x 60 in 10 s; no OOD total
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["[evaluate] test: ~200/400 images, 20.0/s, ETA 10s",
                   "[evaluate] ood: ~120/? images, 12.0/s, ETA ?"], out
    clock = iter([0.0, 100.0])
    p1 = ev.ActorProgress("evaluate", 1, cfg)
    p1(0, 10)
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="log_every_s must be > 0"):
        EvalConfig(log_every_s=0.0)


def test_actor_progress_is_right_after_a_slow_start_and_never_passes_the_total(capsys, monkeypatch):
    """The first line after a long start (model loading, first decode) gave
    ``~936/750 images, 936000000000.0/s, ETA 0s``: the rate counted the first batch over no
    time and the estimate (actor 0's count x actors) passed the split's size."""
    from pipelines.evaluation import actors as ev

    clock = iter([0.0, 40.0, 41.0, 75.0])
    monkeypatch.setattr(ev.time, "perf_counter", lambda: next(clock))
    cfg = EvalConfig(num_actors=4, log_every_s=30.0, expected_rows=(750, None))
    p = ev.ActorProgress("evaluate", 0, cfg)  # clock 0.0
    p(0, 117)  # 40.0: the first batch, after a 40 s start
    p(0, 117)  # 41.0
    p(0, 3)  # 75.0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["[evaluate] test: ~468/750 images, 11.7/s, ETA 24s",
                   "[evaluate] test: ~750/750 images, 12.6/s, ETA 0s"], out
