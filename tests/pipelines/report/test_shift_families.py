"""The report's "Shift by corruption family" table (issue 39) from ``shift.json``'s ``summary``:
one row per family and method, the values as shift_summary computed them, partial sweeps said."""
from __future__ import annotations

import numpy as np

from pipelines.config.choices import IMAGENET_C_NAMES
from pipelines.evaluation.shift_summary import shift_summary
from pipelines.report.shift import shift_summary_section


def _metrics(names, sevs, seed):
    rng = np.random.default_rng(seed)
    return {c: {str(s): dict(zip(("accuracy", "nll", "ece", "brier"), rng.uniform(0.05, 0.95, 4)))
                for s in sevs} for c in names}


def test_one_row_per_family_and_method_with_the_summary_values():
    sevs = [1, 2, 3, 4, 5]
    full, base = _metrics(IMAGENET_C_NAMES, sevs, 0), _metrics(IMAGENET_C_NAMES, sevs, 1)
    docs = {"map": {"summary": shift_summary(base, base, sevs, True)},
            "inf": {"summary": shift_summary(full, base, sevs, True)}}
    sec = shift_summary_section(docs)
    assert sec.title == "Shift by corruption family" and "AlexNet" in sec.note
    assert [r[0] for r in sec.table.rows] == [f for f in ("noise", "blur", "weather", "digital", "all") for _ in "ab"]
    row = dict(zip(sec.table.keys, sec.table.rows))["all:inf"]
    s = docs["inf"]["summary"]["all"]
    assert row[2:] == [f"{100 * s['accuracy']:.1f}%", f"{s['nll']:.4f}", f"{100 * s['ece']:.1f}%",
                       f"{s['ce_vs_map']:.3f}", f"{s['mce_alexnet']:.1f}"]
    assert dict(zip(sec.table.keys, sec.table.rows))["all:map"][5] == "1.000"  # MAP against itself


def test_a_partial_sweep_is_said_and_no_summary_gives_no_section():
    sevs = [1, 5]
    got = _metrics(["gaussian_noise", "contrast"], sevs, 2)
    sec = shift_summary_section({"map": {"summary": shift_summary(got, got, sevs)}})
    assert [r[0] for r in sec.table.rows] == ["noise (partial)", "digital (partial)", "all (partial)"]
    assert all(r[6] == "—" for r in sec.table.rows)  # no mCE for a partial sweep
    assert shift_summary_section({"map": {"mean": {}}}) is None
