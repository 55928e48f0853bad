"""pipelines.evaluation.asha: the promotion rule of ASHA (Li et al. 2020, Algorithm 2) on Tune
trials, without a cluster: a trial goes on from rung ``k`` only while it is among the best
``⌊n_k/η⌋`` of the ``n_k`` trials recorded there and was not promoted from it before; the
others pause. The scheduler inside a real Tune experiment is tested in test_search_tune.py.
"""
from __future__ import annotations

import math

from ray.tune.experiment import Trial
from ray.tune.schedulers import TrialScheduler

from pipelines.evaluation.asha import GridSearcher, PromotionASHA, method_group, rung_steps


def _trial(name: str, i: int) -> Trial:
    return Trial("SearchTrainable", config={"trial": name}, trial_id=f"t{i:03d}", stub=True)


def _result(step: int, value: float) -> dict:
    return {"training_iteration": step, "objective": value, "done": False}


def test_rung_steps_are_integer_powers_below_max_t():
    assert rung_steps(17, 4) == [1, 4, 16]
    assert rung_steps(16, 4) == [1, 4]  # 16 is the end: trials there are complete
    assert rung_steps(64, 4) == [1, 4, 16]  # log(64)/log(4) is not exactly 3 in floats
    assert rung_steps(1, 4) == [] and rung_steps(9, 3) == [1, 3]


def test_nobody_goes_on_before_eta_trials_reach_the_rung_then_the_best_quarter_does():
    s = PromotionASHA(max_t=17, reduction_factor=4, exempt=("map",))
    trials = [_trial(f"diag:{i}", i) for i in range(8)]
    values = [5.0, 3.0, 4.0, 1.0, 2.0, 6.0, 7.0, 0.5]
    actions = []
    for t, v in zip(trials, values):
        s.on_trial_add(None, t)
        actions.append(s.on_trial_result(None, t, _result(1, v)))
    # 1st-3rd: fewer than 4 recorded -> pause; 4th (1.0) is the best of 4 -> goes on;
    # 5th-7th: the best 1 of 5-7 is trial 3, promoted already -> pause; 8th (0.5): best 2 of 8 -> on
    assert actions == [TrialScheduler.PAUSE] * 3 + [TrialScheduler.CONTINUE] + [TrialScheduler.PAUSE] * 3 + [
        TrialScheduler.CONTINUE]
    assert s.paused == {t.trial_id for t in trials} - {"t003", "t007"}
    assert s.promoted["diag"][0] == {"t003", "t007"}
    assert s.promotable("diag", 0, "t004") is False  # 3rd best of 8: not in the top 2
    # a step off the rungs goes on; the end (max_t) goes on (the trial finishes by itself)
    assert s.on_trial_result(None, trials[3], _result(2, 1.0)) == TrialScheduler.CONTINUE
    assert s.on_trial_result(None, trials[3], _result(17, 1.0)) == TrialScheduler.CONTINUE


def test_methods_compete_apart_and_the_map_reference_is_never_paused():
    s = PromotionASHA(max_t=17, reduction_factor=2, exempt=("map",))
    m = _trial("map:0", 0)
    s.on_trial_add(None, m)
    assert s.on_trial_result(None, m, _result(1, 9.0)) == TrialScheduler.CONTINUE
    a, b = _trial("diag:0", 1), _trial("kfac:0", 2)
    for t in (a, b):
        s.on_trial_add(None, t)
        assert s.on_trial_result(None, t, _result(1, 1.0)) == TrialScheduler.PAUSE  # alone in its method's rung
    c = _trial("kfac:1", 3)
    s.on_trial_add(None, c)
    assert s.on_trial_result(None, c, _result(1, 2.0)) == TrialScheduler.PAUSE  # 2nd of 2 in kfac
    assert s.promotable("kfac", 0, "t002") and not s.promotable("diag", 0, "t001")
    assert method_group(m) == "map" and set(s.rungs) == {"diag", "kfac"}


def test_failed_trials_rank_last_and_the_fallback_picks_the_best_of_the_highest_rung():
    s = PromotionASHA(max_t=17, reduction_factor=4)
    trials = [_trial(f"diag:{i}", i) for i in range(3)]
    for t, v in zip(trials, [math.nan, 2.0, math.inf]):
        s.on_trial_add(None, t)
        s.on_trial_result(None, t, _result(1, v))
        t.set_status(Trial.PAUSED)
    assert s.rungs["diag"][0]["t000"] == math.inf
    assert s._fallback() is trials[1]  # 3 < η trials: nobody promotable; the group has no complete trial
    s.finished["diag"] = 1
    assert s._fallback() is None


def test_grid_searcher_hands_out_its_configurations_in_order_and_restores(tmp_path):
    g = GridSearcher([{"trial": "map:0"}, {"trial": "diag:0"}])
    assert g.suggest("a") == {"trial": "map:0"}
    g.save(str(tmp_path / "s.json"))
    h = GridSearcher([])
    h.restore(str(tmp_path / "s.json"))
    assert h.suggest("b") == {"trial": "diag:0"} and h.suggest("c") == GridSearcher.FINISHED


def test_method_searcher_restores_from_json_and_each_method_s_own_state(tmp_path):
    """``MethodSearcher`` saved after three of four trials and restored into a new one (as Tune does
    for a re-submitted job): its own file is JSON (no pickle of ours), and the restored searcher
    proposes exactly what the saved one goes on to propose, each method's Optuna sampler included."""
    import json

    import optuna
    from ray.tune.search.optuna import OptunaSearch

    from pipelines.evaluation.asha import MethodSearcher

    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def make():
        space = {"log10_n": optuna.distributions.FloatDistribution(0.0, 4.0),
                 "log10_tau": optuna.distributions.FloatDistribution(-2.0, 3.0)}
        return MethodSearcher({m: OptunaSearch(dict(space), metric="objective", mode="min",
                                               sampler=optuna.samplers.TPESampler(seed=3)) for m in ("diag", "kfac")}, 2)

    first = make()
    for i in range(3):  # diag's two and kfac's first: kfac's sampler has moved on
        got = first.suggest(f"t{i}")
        first.on_trial_complete(f"t{i}", {"objective": got["log10_n"] - got["log10_tau"]})
    path = tmp_path / "searcher-state.json"
    first.save(str(path))
    assert json.loads(path.read_text())["given"] == 3
    again = make()
    again.restore(str(path))
    want, got = [first.suggest("t3"), first.suggest("t4")], [again.suggest("t3"), again.suggest("t4")]
    assert got == want and got[0]["method"] == "kfac" and got[1] == "FINISHED"
    assert got[0] != make().searchers["kfac"].suggest("x") | {"method": "kfac"}  # not a fresh sampler's first
