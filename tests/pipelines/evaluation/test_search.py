"""pipelines.evaluation.search: deterministic configurations, failures marked not raised, objectives.

Tiny problem: ``tiny_cnn`` (3 classes) on 8x8 random images whose third channel is
identically zero, so the Fisher of the first conv's weights on that channel is exactly
0 and ``τ = 0`` makes the diag and INF precisions singular. Real local Ray
(``ray_session``), 2 actors at 0.5 CPU.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipelines.storage.store import RunStore
from pipelines.evaluation.runtime import SearchConfig
from pipelines.evaluation.search import choose, search, TABLE_COLUMNS
from pipelines.evaluation.trials import sample_configs

METHODS = ("diag", "kfac", "efb", "inf")
N_EXAMPLES = 48


# --------------------------------------------------------------------------- no Ray
def test_configs_are_deterministic_from_the_seed():
    cfg = SearchConfig(num_configs=100, log10_n=(1.0, 5.0), log10_tau=(-3.0, 2.0), seed=7)
    a, b = sample_configs(cfg), sample_configs(SearchConfig(num_configs=100, log10_n=(1.0, 5.0),
                                                            log10_tau=(-3.0, 2.0), seed=7))
    assert a == b and len(a) == 100
    assert [c.config_id for c in a] == list(range(100))
    assert all(1.0 <= c.log10_n <= 5.0 and -3.0 <= c.log10_tau <= 2.0 for c in a)
    # independent re-derivation of the documented rule
    u = np.random.default_rng(7).random((100, 2))
    assert [c.log10_n for c in a] == pytest.approx(list(1.0 + 4.0 * u[:, 0]), abs=0, rel=1e-15)
    assert [c.log10_tau for c in a] == pytest.approx(list(-3.0 + 5.0 * u[:, 1]), abs=0, rel=1e-15)
    c = sample_configs(SearchConfig(num_configs=100, log10_n=(1.0, 5.0), log10_tau=(-3.0, 2.0), seed=8))
    assert c != a
    assert a[0].n_data == 10.0 ** a[0].log10_n and a[0].prior_precision == 10.0 ** a[0].log10_tau


def test_bad_settings_are_one_line_errors():
    with pytest.raises(ValueError, match="objective"):
        SearchConfig(objective="acc")
    with pytest.raises(ValueError, match="log10_tau"):
        SearchConfig(log10_tau=(2.0, 1.0))
    with pytest.raises(ValueError, match="accuracy_floor"):
        SearchConfig(accuracy_floor=1.5)
    with pytest.raises(ValueError, match="configs"):
        SearchConfig(configs=((1.0, math.nan),))
    with pytest.raises(ValueError, match="max_failures must be an int >= 0"):
        SearchConfig(max_failures=-1)


def test_method_ranges_map_the_same_draws_onto_a_method_s_own_ranges():
    cfg = SearchConfig(num_configs=50, log10_n=(1.0, 5.0), log10_tau=(-3.0, 2.0), seed=7,
                       method_ranges=(("kfac", None, (0.0, 6.0)), ("efb", (2.0, 3.0), (-1.0, -1.0))))
    common = sample_configs(cfg)
    assert common == sample_configs(cfg, "diag") == sample_configs(SearchConfig(
        num_configs=50, log10_n=(1.0, 5.0), log10_tau=(-3.0, 2.0), seed=7))  # no override: as before
    u = np.random.default_rng(7).random((50, 2))
    kfac, efb = sample_configs(cfg, "kfac"), sample_configs(cfg, "efb")
    assert [c.config_id for c in kfac] == [c.config_id for c in common]
    assert [c.log10_n for c in kfac] == [c.log10_n for c in common]  # None keeps the common range
    assert [c.log10_tau for c in kfac] == pytest.approx(list(6.0 * u[:, 1]), abs=0, rel=1e-15)
    assert [c.log10_n for c in efb] == pytest.approx(list(2.0 + u[:, 0]), abs=0, rel=1e-15)
    assert {c.log10_tau for c in efb} == {-1.0}
    assert cfg.ranges("kfac") == ((1.0, 5.0), (0.0, 6.0)) and cfg.ranges("inf") == ((1.0, 5.0), (-3.0, 2.0))
    # explicit configurations override every range
    ex = SearchConfig(configs=((1.0, 2.0),), method_ranges=(("kfac", (5.0, 6.0), None),))
    assert sample_configs(ex, "kfac") == sample_configs(ex)
    with pytest.raises(ValueError, match="'kfac' appears twice"):  # the one check (also the config's)
        SearchConfig(method_ranges=(("kfac", None, None), ("kfac", None, (0.0, 1.0))))
    with pytest.raises(ValueError, match=r"method_ranges\[kfac\].log10_tau must be finite with low <= high"):
        SearchConfig(method_ranges=(("kfac", None, (3.0, 1.0)),))
    with pytest.raises(ValueError, match="entries must be"):
        SearchConfig(method_ranges=("kfac",))


def test_search_shard_scores_each_method_at_its_own_configurations(tiny):
    """Without Ray: ``search_shard`` under ``method_ranges`` gives every method the accumulators
    of a search over exactly that method's configurations."""
    from laplace_core.posteriors.structures.base import load_posterior
    from pipelines.evaluation.search import search_shard
    from pipelines.ingest.models import tiny_cnn
    from safetensors.torch import load_file

    model = tiny_cnn(3).eval()
    model.load_state_dict(load_file(tiny["model"]["weights"]))
    posts = {m: load_posterior(tiny["uris"][m]) for m in ("diag", "kfac")}
    x = torch.stack([torch.as_tensor(r["image"]) for r in tiny["rows"]])
    y = torch.tensor([r["label"] for r in tiny["rows"]])
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, N_EXAMPLES, 16)]
    cfg = _cfg(num_configs=3, log10_n=(1.0, 2.0), log10_tau=(0.0, 1.0), method_ranges=(("kfac", None, (3.0, 4.0)),))
    both = search_shard(model, posts, batches, cfg)
    for m in posts:
        alone = search_shard(model, {m: posts[m]}, batches, cfg, configs=sample_configs(cfg, m))
        assert both["acc"][m].keys() == alone["acc"][m].keys() == {0, 1, 2}
        for cid, a in alone["acc"][m].items():
            assert both["acc"][m][cid].compute() == a.compute(), (m, cid)
    # and the two methods' configurations really differ (kfac at τ >= 10^3)
    assert all(c.log10_tau >= 3.0 for c in sample_configs(cfg, "kfac"))
    assert all(c.log10_tau <= 1.0 for c in sample_configs(cfg, "diag"))


def test_method_ranges_in_the_run_config():
    from pipelines.config.schema import ConfigError
    from pipelines.config.load import load_config

    cfg = load_config("smoke", ["search.method_ranges=[{method: kfac, log10_tau: [-2, 6]}]"])
    (r,) = cfg.search.method_ranges
    assert (r.method, r.log10_n, r.log10_tau) == ("kfac", None, (-2.0, 6.0))
    s = SearchConfig.from_spec(cfg.search)
    assert s.ranges("kfac") == (cfg.search.log10_n, (-2.0, 6.0)) and s.ranges("diag") == (
        cfg.search.log10_n, cfg.search.log10_tau)
    with pytest.raises(ConfigError, match="search.method_ranges: unknown method 'kfc'; valid: diag"):
        load_config("smoke", ["search.method_ranges=[{method: kfc}]"])
    with pytest.raises(ConfigError, match="'kfac' appears twice"):
        load_config("smoke", ["search.method_ranges=[{method: kfac}, {method: kfac}]"])
    with pytest.raises(ConfigError, match=r"search.method_ranges\[inf\].log10_n must be finite with low <= high"):
        load_config("smoke", ["search.method_ranges=[{method: inf, log10_n: [4, 1]}]"])


def test_choose_rules():
    rows = [
        {"config_id": 0, "status": "ok", "nll": 0.5, "ece": 0.01, "accuracy": 0.6},
        {"config_id": 1, "status": "ok", "nll": 0.3, "ece": 0.05, "accuracy": 0.9},
        {"config_id": 2, "status": "failed", "nll": math.nan, "ece": math.nan, "accuracy": math.nan},
        {"config_id": 3, "status": "ok", "nll": 0.4, "ece": 0.03, "accuracy": 0.8},
    ]
    assert choose(rows, "nll")[0]["config_id"] == 1
    assert choose(rows, "ece")[0]["config_id"] == 0
    assert choose(rows, "ece", 0.7)[0]["config_id"] == 3
    best, why = choose(rows, "ece", 0.95)
    assert best is None and "floor" in why
    assert choose(rows[2:3], "nll")[0] is None


def test_a_later_predictive_is_chosen_only_when_better_by_more_than_the_tie():
    """``pred_types: [nn, glm]`` on the demo: both predictives at the MAP limit score 0.04748 (nn) and
    0.04746 (glm), a tie within MC noise, and the GLM costs ~3x in the evaluation: nn is chosen. A
    GLM better by more than ``PRED_TIE_NATS`` (1e-4 nats) is chosen; ECE keeps the plain minimum."""
    from pipelines.evaluation.search import PRED_TIE_NATS

    def row(pt, cid, nll, ece=0.02):
        return {"pred_type": pt, "config_id": cid, "status": "ok", "nll": nll, "ece": ece, "accuracy": 0.97}

    tie = [row("nn", 0, 0.04748), row("nn", 1, 0.0484), row("glm", 0, 0.04746), row("glm", 1, 0.0483)]
    assert (choose(tie, "nll")[0]["pred_type"], choose(tie, "nll")[0]["config_id"]) == ("nn", 0)
    better = [row("nn", 0, 0.1876), row("glm", 0, 0.1876 - 2 * PRED_TIE_NATS)]
    assert choose(better, "nll")[0]["pred_type"] == "glm"
    edge = [row("nn", 0, 0.2), row("glm", 0, 0.2 - PRED_TIE_NATS / 2)]
    assert choose(edge, "nll")[0]["pred_type"] == "nn"
    assert choose([row("nn", 0, 0.2, ece=0.03), row("glm", 0, 0.2, ece=0.029)], "ece")[0]["pred_type"] == "glm"
    first_failed = [dict(row("nn", 0, math.nan), status="failed"), row("glm", 0, 0.3)]
    assert choose(first_failed, "nll")[0]["pred_type"] == "glm"


# --------------------------------------------------------------------------- Ray
@pytest.fixture(scope="module")
def tiny(tiny_cnn_posteriors):
    """Weights file, posterior URIs and a validation set (rows with image/label/path/valid);
    input channel 2 is dead (exact zeros in the Fisher of conv 0)."""
    return tiny_cnn_posteriors(N_EXAMPLES, METHODS, dead_channel=True, with_basis=True, inf_rank=8)


def _cfg(**kw) -> SearchConfig:
    # one trial at a time: a trial here scores fewer images than an actor takes to start, and with
    # two at once Tune starts an actor for nearly every trial (search.concurrent_trials, RESULTS.md)
    base = dict(num_actors=2, concurrent_trials=1, batch_size=16, mc_samples=3, cpus_per_actor=0.5, torch_threads=1,
                seed=0)
    base.update(kw)
    return SearchConfig(**base)


def test_search_marks_failures_and_still_chooses(ray_session, tiny):
    import pyarrow.parquet as pq

    ds = ray_session.data.from_items(tiny["rows"], override_num_blocks=3)
    configs = (
        (1.0, 0.0),             # fine
        (2.0, -math.inf),       # τ = 0: singular precision (dead input channel)
        (-300.0, -300.0),       # N, τ = 1e-300: std ~1e150 -> inf weights in float32 -> NaN
        (1.5, 1.0),             # fine
        (0.5, -1.0),            # fine
    )
    out = str(tiny["root"] / "out")
    res = search(tiny["model"], tiny["uris"], ds, _cfg(configs=configs), store=RunStore.open(out))
    assert len(res.rows) == len(METHODS) * len(configs)
    for m in METHODS:
        rows = {r["config_id"]: r for r in res.rows if r["method"] == m}
        assert rows[2]["status"] == "failed" and rows[2]["reason"], m
        assert math.isnan(rows[2]["nll"])
        for cid in (0, 3, 4):
            assert rows[cid]["status"] == "ok", (m, rows[cid]["reason"])
            assert rows[cid]["count"] == N_EXAMPLES
        best = res.chosen[m]
        assert best is not None
        ok = [r for r in rows.values() if r["status"] == "ok"]
        assert best["nll"] == min(r["nll"] for r in ok)
        assert best["n_data"] == 10.0 ** best["log10_n"]
        # the table on disk
        t = pq.read_table(f"{out}/eval/{m}/search.parquet")
        assert tuple(t.column_names) == TABLE_COLUMNS and t.num_rows == len(configs)
        assert t.column("status").to_pylist() == [rows[i]["status"] for i in range(len(configs))]
    for m in ("diag", "inf"):  # exact zeros in diag / D: τ = 0 is not positive definite
        r = next(r for r in res.rows if r["method"] == m and r["config_id"] == 1)
        assert r["status"] == "failed" and "positive definite" in r["reason"], (m, r["reason"])
    assert res.map["count"] == N_EXAMPLES
    assert set(res.hyper()) == set(METHODS)
    assert res.info["examples"] == N_EXAMPLES


def test_ece_objective_respects_the_accuracy_floor(ray_session, tiny):
    ds = ray_session.data.from_items(tiny["rows"], override_num_blocks=3)
    # from near-MAP (large τ) to very noisy (small τ): accuracies differ
    cfg = _cfg(configs=((1.0, 3.0), (1.0, 1.0), (1.0, 0.0), (1.0, -1.0), (1.0, -2.0), (0.0, -3.0), (0.0, -4.0)))
    free = search(tiny["model"], {"diag": tiny["uris"]["diag"]}, ds, _cfg(**{**cfg.__dict__, "objective": "ece"}))
    rows = [r for r in free.rows if r["status"] == "ok"]
    accs = sorted({r["accuracy"] for r in rows})
    assert len(accs) >= 2, "test needs configurations of different accuracy"
    # a floor above the unconstrained ECE winner's accuracy when possible
    floor = min((a for a in accs if a > free.chosen["diag"]["accuracy"]), default=accs[-1])
    ds = ray_session.data.from_items(tiny["rows"], override_num_blocks=3)
    res = search(tiny["model"], {"diag": tiny["uris"]["diag"]}, ds,
                 _cfg(**{**cfg.__dict__, "objective": "ece", "accuracy_floor": floor}))
    best = res.chosen["diag"]
    assert best is not None and best["accuracy"] >= floor
    eligible = [r for r in res.rows if r["status"] == "ok" and r["accuracy"] >= floor]
    assert best["ece"] == min(r["ece"] for r in eligible)
    # same seed, same data: the two searches scored the same configurations identically
    a = {r["config_id"]: (r["nll"], r["accuracy"]) for r in free.rows}
    b = {r["config_id"]: (r["nll"], r["accuracy"]) for r in res.rows}
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][1] == b[k][1] and a[k][0] == pytest.approx(b[k][0], rel=1e-12)


def test_configs_from_the_run_config_specs():
    from pipelines.config.schema import EvalSpec, SearchSpec
    from pipelines.evaluation.runtime import EvalConfig

    s = SearchConfig.from_spec(SearchSpec(num_configs=5, objective="ece", accuracy_floor=0.5), num_actors=1)
    assert (s.num_configs, s.objective, s.accuracy_floor, s.mc_samples, s.num_actors) == (5, "ece", 0.5, 10, 1)
    assert len(sample_configs(s)) == 5
    e = EvalConfig.from_spec(EvalSpec(mc_samples=7, ece_mode="equal_mass"), batch_size=8)
    assert (e.mc_samples, e.ece_mode, e.batch_size, e.pred_type) == (7, "equal_mass", 8, "nn")


def test_the_run_scores_the_search_with_the_evaluation_ece():
    """``evaluate.ece_mode`` / ``evaluate.ece_bins`` (and the actor settings) reach the
    SearchConfig the run builds, and its accumulators use them; the search section keeps its
    own ``mc_samples``, ``seed`` and ``chunk_size``."""
    from pipelines.config.load import load_config
    from pipelines.evaluation.runtime import eval_config, search_config
    from pipelines.evaluation.trials import SearchAccumulator

    cfg = load_config("smoke", ["evaluate.ece_mode=equal_mass", "evaluate.ece_bins=7", "evaluate.num_actors=3",
                                "evaluate.mc_samples=5", "evaluate.seed=11", "evaluate.chunk_size=256",
                                "evaluate.sample_cache_mb=8", "search.mc_samples=2", "search.seed=4",
                                "search.chunk_size=512"])
    s = search_config(cfg, gpus_per_actor=0.0, expected_rows=(40, None))
    e = eval_config(cfg, gpus_per_actor=0.0)
    assert (s.ece_mode, s.ece_bins) == (e.ece_mode, e.ece_bins) == ("equal_mass", 7)
    assert (s.num_actors, s.mc_samples, s.seed, s.chunk_size, s.expected_rows) == (3, 2, 4, 512, (40, None))
    assert (e.num_actors, e.mc_samples, e.seed, e.chunk_size, e.sample_cache_mb) == (3, 5, 11, 256, 8.0)
    ece = SearchAccumulator.create(s).ece
    assert (ece.strategy, ece.n_bins) == ("equal_mass", 7)


def test_concurrent_trials_sets_the_experiments_concurrency_apart_from_the_actors():
    """``search.concurrent_trials`` (null: ``evaluate.num_actors``) is what every experiment's
    limiter and Tune get (random grid, random with ASHA, TPE); the evaluation keeps its actors.
    The smoke preset runs one trial at a time beside two evaluation actors."""
    from pipelines.config.load import load_config
    from pipelines.evaluation.runtime import eval_config, search_config
    from pipelines.evaluation.tune import _space_and_search

    for kw, want in (({}, 3), ({"concurrent_trials": 1}, 1)):
        for extra in ({}, {"scheduler": "asha"}, {"algorithm": "tpe"}):
            cfg = SearchConfig(num_actors=3, num_configs=4, **kw, **extra)
            assert cfg.trials_at_once == want
            _, alg, _, sched, concurrent = _space_and_search(cfg, ["diag", "kfac"], 8)
            limits = [x for x in (concurrent, getattr(alg, "max_concurrent", None),
                                  getattr(sched, "max_concurrent", None)) if x is not None]
            assert limits and set(limits) == {want}, (kw, extra, limits)
    run = load_config("smoke")
    assert search_config(run).trials_at_once == 1 and eval_config(run).num_actors == 2


def test_runtime_configs_copy_every_field_they_share_with_the_specs():
    """``from_spec`` copies every field a spec shares with the runtime class (no hand-written
    list): each shared field, set away from its default in the spec, arrives; the fields only
    the run or the tests set are named here."""
    import dataclasses

    from pipelines.config.schema import EvalSpec, SearchSpec, ShiftSpec
    from pipelines.evaluation.runtime import EvalConfig

    changed = {"mc_samples": 3, "num_actors": 5, "batch_size": 9, "ece_bins": 4, "ece_mode": "equal_mass",
               "pred_type": "glm", "seed": 13, "max_failures": 0, "cpus_per_actor": 1.5, "gpus_per_actor": 0.25,
               "placement_timeout_s": 7.0, "chunk_size": 33, "sample_cache_mb": 1.0, "num_configs": 6,
               "log10_n": (1.0, 2.0), "log10_tau": (-1.0, 0.5), "objective": "ece", "accuracy_floor": 0.3,
               "method_ranges": (("kfac", (0.0, 1.0), (2.0, 3.0)),), "dtype": "float64", "torch_threads": 3,
               "log_every_s": 2.0, "entropy_bins": 7, "ood_exact_limit": 11, "scheduler": "asha",
               "algorithm": "tpe", "reduction_factor": 3, "stall_timeout_s": 12.0, "bootstrap": 50,
               "map_limit_log10_tau": 7.5, "pred_types": ("glm", "nn"), "concurrent_trials": 4,
               "shift": ShiftSpec(corruptions=("contrast",), severities=(2,))}
    # precision bf16 needs pred_type nn and dtype float32 (ActorSpec._check): a second set for it
    autocast = {**changed, "precision": "bf16", "pred_type": "nn", "pred_types": ("nn",), "dtype": "float32"}
    for spec_cls, cfg_cls in ((EvalSpec, EvalConfig), (SearchSpec, SearchConfig)):
        shared = {f.name for f in dataclasses.fields(spec_cls)} & {f.name for f in dataclasses.fields(cfg_cls)}
        assert shared <= set(autocast), f"give the test a value for {sorted(shared - set(autocast))}"
        for values in (changed, autocast):
            spec = spec_cls(**{k: values[k] for k in shared if k in values})
            got = cfg_cls.from_spec(spec)
            assert {k: getattr(got, k) for k in shared if k in values} == {k: values[k] for k in shared if k in values}
    run_only = {f.name for f in dataclasses.fields(EvalConfig)} - {f.name for f in dataclasses.fields(EvalSpec)}
    # from gpus_per_actor; tests; the scanned split; data.decode_num_cpus; the search's chosen predictives
    assert run_only == {"device", "fault_marker", "expected_rows", "decode_cpus", "method_pred_types"}
