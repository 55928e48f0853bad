"""The report's first screen on a laptop: the demo's summary table (MAP, temperature and the four
Laplace methods, each value with its interval, the letters set's rows) fits a 1280-px window, so
its Best column is read without scrolling sideways. ``data/demo_results.json``: the results of a
fresh clone's ``make demo`` (2026-11-29, the converged CNN, 269 test images), the summary's metrics
only, to 6 significant figures. Before the metric column could wrap, the table's right edge was at
1,286 px and the Best column was cut off (its page's own table, 1,340 px); now 1,256 px."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pipelines.report.page import build_report_page
from pipelines.report.render import render_html

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("infoform_test_browser_width", HERE.parents[1] / "jobs" / "browser.py")
browser = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(browser)

LAPTOP = (1280, 900)


@pytest.mark.browser
def test_the_demo_summary_table_fits_a_laptop_window(tmp_path):
    path, reason = browser.ensure_chromium()
    if path is None:
        pytest.skip(f"headless chromium unavailable: {reason}")
    results = json.loads((HERE / "data" / "demo_results.json").read_text())
    sizes = {m: {"numbers": 1} for m in results if m != "map"}
    page = build_report_page({"title": "demo_cnn (demo)", "results": results, "posterior_sizes": sizes}, {}, [])
    html = render_html(page)
    assert html.index("<table") == html.index('<table id="summary-table"')
    checked = tmp_path / "report.html"
    checked.write_text(browser.with_check_script(html, table_id="summary-table"), encoding="utf-8")
    info = browser.read_check(browser.dump_dom(checked, window=LAPTOP))
    assert info["rows"] >= 10 and info["viewport"] <= LAPTOP[0], info
    assert 0 < info["right"] <= info["viewport"], (info["right"], info["viewport"])
    print(f"summary table right edge {info['right']} px in a {info['viewport']} px window")
