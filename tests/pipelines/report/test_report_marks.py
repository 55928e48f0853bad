"""Issue #38: a method whose chosen configuration did not beat MAP on validation is marked in the
verdict, the log's verdict lines and the report's method table, with the search's exact sentence;
its test row stays, labelled (no Ray; the per-image quantities of ``test_report_verdict``)."""
from __future__ import annotations

from pathlib import Path

from pipelines.cli.run import verdict_lines
from pipelines.evaluation.runtime import EvalConfig
from pipelines.report.page import build_report_page, marks
from pipelines.report.verdict import verdict_sentences


def _load(name: str, path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_HERE = Path(__file__).resolve().parent
_verdict = _load("infoform_test_report_verdict_marks", _HERE / "test_report_verdict.py")
MARK = "no configuration of kfac improved validation NLL over MAP (best Δ = +0.0061 [+0.0042, +0.0081])"


def test_a_marked_method_is_labelled_in_the_verdict_the_log_and_the_table():
    mbm, results = _verdict._evaluated(EvalConfig(bootstrap=50))
    plain = verdict_sentences(results)
    marked = verdict_sentences(results, marks={"kfac": MARK})
    (kfac,) = [s for s in marked if "KFAC" in s]
    assert kfac.startswith("No configuration of kfac improved validation NLL over MAP (best Δ = +0.0061 "
                           "[+0.0042, +0.0081]); its test row is shown for reference: KFAC ")
    assert [s for s in marked if "KFAC" not in s] == [s for s in plain if "KFAC" not in s]  # the others as before
    summary = {**_verdict.make_summary(tuple(mbm)), "results": results,
               "search": {"not_better_than_map": {"kfac": MARK, "diag": ""}}}
    assert marks(summary) == {"kfac": MARK}
    assert any(MARK[1:] in line for line in verdict_lines({**summary, "data": {}}))
    page = build_report_page(summary, mbm, [])
    (row,) = [r for r in page.methods.rows if r[0].startswith("KFAC")]
    assert row[0] == "KFAC (not better than MAP on validation)"
    assert any(MARK in n and "not as the method's improvement" in n for n in page.notes)
    assert any(s.startswith("No configuration of kfac") for s in page.verdict)
