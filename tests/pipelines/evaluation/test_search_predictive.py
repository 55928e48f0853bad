"""Issue #38, the predictive in the search: ``search.pred_types`` lists the predictives searched
(``nn`` weight sampling, ``glm`` the linearised MC-GLM); each method's choice names its
predictive, the judgement against MAP and the test evaluation use that predictive. In one
process, without Ray, on the session's ``tiny_cnn`` data (3 classes, 256 random 8x8 images,
30% of the labels replaced at random) with diag and KFAC posteriors from an MC Fisher.
Ground truth: :func:`search_shard` and :func:`evaluate_shard` run with one ``pred_type`` each.
"""
from __future__ import annotations

import dataclasses
import math

import pytest

from pipelines.config.schema import SearchSpec
from pipelines.evaluation.against_map import judge_shard
from pipelines.evaluation.evaluate import evaluate_shard
from pipelines.evaluation.runtime import EvalConfig, SearchConfig
from pipelines.evaluation.search import search_shard

METHODS = ("diag", "kfac")
N_EXAMPLES = 64
#: (log10 N, log10 τ): N about the example count; τ broad enough that the two predictives part, not so broad that
#: a probability underflows (the search floors log p, the judge does not: their NLLs would then differ by design).
CONFIGS = ((2.0, 1.0), (2.0, 8.0))


@pytest.fixture(scope="module")
def data(tiny_cnn_posteriors):
    return tiny_cnn_posteriors(256, METHODS)


def _batches(data):
    return data["batches"][: N_EXAMPLES // 16]


def _cfg(pred_type: str = "nn", **kw) -> SearchConfig:
    return SearchConfig(configs=CONFIGS, mc_samples=3, seed=5, batch_size=16, torch_threads=1, pred_type=pred_type,
                        **kw)


def test_pred_types_is_checked_where_it_is_written():
    assert SearchSpec(pred_types=("nn", "glm")).pred_types == ("nn", "glm")
    for bad in (("nn", "nn"), ("nn", "probit"), ()):
        with pytest.raises(ValueError, match="pred"):
            SearchSpec(pred_types=bad)
    assert SearchConfig().searched_pred_types == ("nn",)  # null: evaluate.pred_type alone
    assert SearchConfig(pred_type="glm").searched_pred_types == ("glm",)
    with pytest.raises(ValueError, match="fp32"):
        SearchConfig(pred_types=("nn", "glm"), precision="bf16")
    with pytest.raises(ValueError, match="fp32"):
        EvalConfig(method_pred_types=(("diag", "glm"),), precision="bf16")


def test_the_judgement_against_map_uses_each_method_s_chosen_predictive(data):
    """The judge's NLL of a chosen (configuration, predictive) is the search's own number for that
    predictive (same images, same draws), and differs from the other predictive's."""
    by_pt = {pt: search_shard(data["net"], data["posts"], _batches(data), _cfg(pt)) for pt in ("nn", "glm")}
    nll = {pt: {m: {cid: a.compute()["nll"] for cid, a in got["acc"][m].items()} for m in METHODS}
           for pt, got in by_pt.items()}
    cid = 0  # the broader posterior: weight sampling and the linearisation part there
    assert all(abs(nll["nn"][m][cid] - nll["glm"][m][cid]) > 1e-3 for m in METHODS), nll
    for pt in ("nn", "glm"):
        chosen = {m: {"config_id": cid, "pred_type": pt, "n_data": 10 ** CONFIGS[cid][0],
                      "prior_precision": 10 ** CONFIGS[cid][1]} for m in METHODS}
        # the search config's own pred_type is the other one: the chosen row's must win
        other = "glm" if pt == "nn" else "nn"
        got = judge_shard(data["net"], data["posts"], chosen, _batches(data), _cfg(other))
        for m in METHODS:
            assert got[m]["n"] == N_EXAMPLES
            assert got[m]["nll"] == pytest.approx(nll[pt][m][cid], rel=1e-9), (pt, m)


def test_the_evaluation_uses_each_method_s_chosen_predictive(data):
    """``EvalConfig.method_pred_types`` (what the run passes from the search's choice): diag
    evaluated with the GLM predictive equals a plain ``pred_type: glm`` evaluation; kfac, not
    listed, equals the plain ``nn`` one."""
    base = EvalConfig(mc_samples=3, seed=5, batch_size=16, torch_threads=1, bootstrap=2)
    mixed, _ = evaluate_shard(data["net"], data["posts"], _batches(data), None,
                              dataclasses.replace(base, method_pred_types=(("diag", "glm"),)))
    plain = {pt: evaluate_shard(data["net"], data["posts"], _batches(data), None,
                                dataclasses.replace(base, pred_type=pt))[0] for pt in ("nn", "glm")}
    want = {"diag": plain["glm"]["diag"], "kfac": plain["nn"]["kfac"], "map": plain["nn"]["map"]}
    for m, acc in want.items():
        assert mixed[m].compute()["nll"] == pytest.approx(acc.compute()["nll"], rel=1e-12), m
    assert not math.isclose(plain["glm"]["diag"].compute()["nll"], plain["nn"]["diag"].compute()["nll"], rel_tol=1e-6)
    assert dataclasses.replace(base, method_pred_types=(("diag", "glm"),)).pred_type_of("kfac") == "nn"


def test_the_map_reference_is_scored_once_over_the_predictives():
    """``algorithm: random`` with ``pred_types: [nn, glm]``: the MAP reference trial is in the first
    predictive's grid only (MAP has no posterior: the second would score the same predictions again);
    every method's configurations are in both."""
    from pipelines.evaluation.tune import MAP_TRIAL, _space_and_search

    cfg = SearchConfig(num_configs=3, log10_n=(1.0, 3.0), log10_tau=(0.0, 2.0), map_limit_log10_tau=8.0,
                       pred_types=("nn", "glm"), algorithm="random")
    grids = {pt: _space_and_search(dataclasses.replace(cfg, pred_type=pt), METHODS, 1)[0]["trial"]["grid_search"]
             for pt in cfg.searched_pred_types}
    assert grids["nn"][0] == f"{MAP_TRIAL}:0" and grids["glm"] == grids["nn"][1:]
    assert grids["glm"] == [f"{m}:{i}" for m in METHODS for i in range(4)]  # 3 draws + the MAP limit, id 3
