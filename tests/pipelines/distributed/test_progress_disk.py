"""Progress lines of the passes and the search, and the disk arithmetic the log announces (no Ray)."""
from __future__ import annotations

import re
import time
from types import SimpleNamespace

from pipelines.distributed.progress import Progress
from pipelines.storage.disk import expected_bytes, human

MiB = 2**20


def test_pass_progress_ticks_while_a_batch_runs_and_closes_with_the_rate(capsys):
    p = Progress("pass 1 (KFAC factors and diagonal)", total=60, world=2, rank=0, every_s=0.2)
    p.start_ticker()
    p(10)  # rank 0's first 10 images: about 20 of the group's
    time.sleep(0.7)  # a long batch: no call, the ticker still writes
    p.partition_done(60)
    p.finish(60)
    lines = capsys.readouterr().out.strip().splitlines()
    ticks = [ln for ln in lines if "ETA" in ln]
    assert len(ticks) >= 2, lines
    assert re.fullmatch(r"\[curvature\] pass 1 \(KFAC factors and diagonal\): ~20/60 images, [\d.]+ images/s, "
                        r"ETA \d+ s", ticks[0]), ticks[0]
    assert re.fullmatch(r"\[curvature\] pass 1 \(KFAC factors and diagonal\): 60/60 images done in [\d.]+ s, "
                        r"[\d.]+ images/s", lines[-1]), lines[-1]
    time.sleep(0.5)
    assert capsys.readouterr().out == ""  # the ticker stopped
    q = Progress("pass 1", total=60, world=2, rank=1, every_s=0.01)  # other ranks say nothing
    q.start_ticker()
    q(5)
    time.sleep(0.05)
    q.finish(60)
    assert capsys.readouterr().out == ""


def test_search_progress_counts_trials_and_images(capsys, monkeypatch):
    from pipelines.evaluation import search_progress as sp

    clock = iter([0.0, 10.0, 20.0, 40.0, 40.0])
    monkeypatch.setattr(sp.time, "perf_counter", lambda: next(clock))
    cb = sp.SearchProgress(num_trials=3, images=100, every_s=15.0)  # t0 = 0
    t1, t2 = SimpleNamespace(trial_id="a"), SimpleNamespace(trial_id="b")
    cb.on_trial_result(1, [], t1, {"images": 50})  # 10 s: too early
    cb.on_trial_result(1, [], t2, {"images": 50})  # 20 s: 100 of 300 images, 5 images/s, <= 40 s left
    cb.on_trial_result(2, [], t1, {"images": 100, "done": True})  # 40 s
    cb.on_experiment_end([])  # 40 s
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["[search] trials 0/3 done, images scored 100/300, 5.00 images/s, ETA <= 40 s",
                   "[search] trials 1/3 done, images scored 150/300, 3.75 images/s, ETA <= 40 s",
                   "[search] 1/3 trials done, 150 images scored in 40.0 s, 3.75 images/s"], out


def test_search_progress_of_one_of_several_experiments_leaves_the_total_to_its_caller(capsys, monkeypatch):
    """TPE runs one Tune experiment per method and predictive (the demo: 8): each writes no end line
    of its own, and the search writes one total line for them all."""
    from pipelines.evaluation import search_progress as sp

    clock = iter([0.0, 1.0, 2.0])
    monkeypatch.setattr(sp.time, "perf_counter", lambda: next(clock))
    cb = sp.SearchProgress(num_trials=5, images=100, every_s=15.0, end_line=False)
    cb.on_trial_result(1, [], SimpleNamespace(trial_id="a"), {"images": 100, "done": True})
    cb.on_experiment_end([])
    assert capsys.readouterr().out == ""
    sp.total_line(40, 40, 10_760, 200.0, experiments=8)
    assert capsys.readouterr().out.strip() == ("[search] 40/40 trials done in 8 experiments, 10760 images scored in "
                                               "200.0 s, 53.80 images/s")


def test_expected_bytes_of_resnet18_match_what_a_run_wrote():
    """resnet18 (10 classes), float64 statistics: the pass-1 checkpoint a 60-image run wrote was
    444.0 MiB and its eigenbasis 718 MiB (benchmarks/RESULTS.md); kfac keeps only eigenvalues."""
    from pipelines.ingest.models import model_size_report

    rep = model_size_report("resnet18", 10, rank=100)
    est = expected_bytes(rep, ("diag", "kfac", "efb", "inf"))
    assert round(est["checkpoint"] / MiB, 1) == 444.0
    assert abs(est["eigenbasis"] / MiB - 718) < 1
    # stats/reduced: A, G as upper triangles + diagonal + EFB sums = the checkpoint + one m x n sum
    assert est["statistics"] == est["checkpoint"] + 8 * rep.num_weights
    assert est["posteriors"]["diag"] == est["posteriors"]["efb"] == 8 * rep.num_weights
    assert est["posteriors"]["kfac"] == 8 * sum(ls.m + ls.n for ls in rep.layers)
    assert human(444 * MiB) == "444 MiB" and human(3 * 2**30) == "3.00 GiB"


def test_progress_of_one_of_several_experiments_names_it(capsys, monkeypatch):
    """With several experiments running beside each other their lines interleave: each names its
    method(s) and predictive and says nothing before its first scored image; a single
    experiment's line stays as it was."""
    from pipelines.evaluation import search_progress as sp

    clock = iter([0.0, 16.0, 20.0, 0.0, 20.0])
    monkeypatch.setattr(sp.time, "perf_counter", lambda: next(clock))
    cb = sp.SearchProgress(num_trials=5, images=100, every_s=15.0, end_line=False, label="kfac, glm")
    cb.on_step_end(1, [])  # nothing scored yet: no line of zeros
    assert capsys.readouterr().out == ""
    cb.on_trial_result(1, [], SimpleNamespace(trial_id="a"), {"images": 100, "done": True})
    assert capsys.readouterr().out.strip() == ("[search] kfac, glm: trials 1/5 done, images scored 100/500, "
                                               "5.00 images/s, ETA <= 80 s")
    one = sp.SearchProgress(num_trials=5, images=100, every_s=15.0)
    one.on_trial_result(1, [], SimpleNamespace(trial_id="a"), {"images": 100, "done": True})
    assert capsys.readouterr().out.startswith("[search] trials 1/5 done")
