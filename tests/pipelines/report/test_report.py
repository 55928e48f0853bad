"""pipelines.report: figures, the self-contained HTML page, Markdown, audit report, headless render.

The metrics dicts are real: ``laplace_core.metrics.suite.MetricSuite`` run on random probabilities
(one temperature per method, so the methods differ in calibration), plus an OOD set of flatter
probabilities. Numbers in the page are checked against those dicts; the OOD mean-entropy
estimate against the exact mean computed from the probabilities.
"""
from __future__ import annotations

import base64
import importlib.util
import io
import math
import re
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from PIL import Image

from laplace_core.metrics.base import normalized_entropy
from laplace_core.metrics.suite import MetricSuite
from pipelines.storage.store import RunStore
from pipelines.report import figures, inputs, load, write
from pipelines.report.methods import method_label
from pipelines.report.page import build_report_page
from pipelines.report.render import md_escape, render_html, render_markdown
from pipelines.storage import uris as storage

_BROWSER_PY = Path(__file__).resolve().parents[2] / "jobs" / "browser.py"
_spec = importlib.util.spec_from_file_location("infoform_test_browser", _BROWSER_PY)
browser = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(browser)

C = 10
N_IN, N_OUT = 600, 400
TEMPERATURES = {"map": 0.55, "diag": 1.0, "kfac": 1.15, "kfac_exact": 1.1, "efb": 1.25, "inf": 1.4, "subnet": 0.85}
EVIL = '<img src=x onerror="alert(1)">&amp;'


def _probs(seed: int, temperature: float, ood: bool = True):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, C, (N_IN,), generator=g)
    logits = torch.randn(N_IN, C, generator=g, dtype=torch.float64) * 1.3
    logits[torch.arange(N_IN), labels] += 3.0
    p_in = torch.softmax(logits / temperature, dim=1)
    p_out = torch.softmax(torch.randn(N_OUT, C, generator=g, dtype=torch.float64) * 0.9 / temperature, dim=1)
    suite = MetricSuite.create(num_classes=C).update(p_in, labels)
    if ood:
        suite = suite.update_ood(p_out)
    return suite.compute(), p_in, p_out


def make_metrics(methods=tuple(TEMPERATURES), ood: bool = True) -> dict[str, dict]:
    return {m: _probs(i, TEMPERATURES[m], ood)[0] for i, m in enumerate(methods)}


def make_search_table(methods=("diag", "kfac", "kfac_exact", "efb", "inf", "subnet")):
    import pandas as pd

    g = torch.Generator().manual_seed(7)
    rows = []
    for m in methods:
        for k in range(14):
            ln, lt = float(torch.rand(1, generator=g)) * 4 + 2, float(torch.rand(1, generator=g)) * 6 - 3
            failed = k in (3, 9)
            nll = float("nan") if failed else 0.8 + 0.1 * (ln - 4) ** 2 + 0.05 * (lt + 1) ** 2
            rows.append({"method": m, "log10_n": ln, "log10_tau": lt, "nll": nll,
                         "ece": float("nan") if failed else 0.02 + 0.01 * abs(lt), "accuracy": float("nan") if failed
                         else 0.7 - 0.01 * abs(ln - 4), "brier": float("nan") if failed else 0.4,
                         "status": "failed" if failed else "ok",
                         "reason": "Cholesky: not positive definite" if failed else ""})
    return pd.DataFrame(rows)


def make_summary(methods=tuple(TEMPERATURES)) -> dict:
    return {
        "run_id": "test-run-1",
        "config": {"model": {"name": "resnet18"}, "posterior": {"methods": list(methods), "rank": 100},
                   "search": {"trials": 14}},
        "model": {"name": "resnet18", "weights": "/models/r18.pt"},
        "data": {"test": "/data/val", "ood": "/data/ood/" + EVIL, "num_classes": C},
        "versions": {"torch": "2.14.1", "ray": "2.60.0"},
        "timings": {"curvature": 12.5, "posterior": 3.25, "search": 40.0, "evaluate": 20.0},
        "method_timings": {m: {"posterior": 1.0 + i, "search": 5.0, "evaluate": 2.5} for i, m in enumerate(methods)},
        "posterior_sizes": {"diag": {"numbers": 11_679_912}, "kfac": {"numbers": 95_013_546, "mb": 362.4},
                            "kfac_exact": {"numbers": 106_693_458}, "efb": {"numbers": 106_693_458},
                            "inf": {"numbers": 12_317_373, "note": "rank 100, from statistics"},
                            "subnet": {"numbers": 5_000_000}},
        "skipped_images": {"pass1": {"count": 3, "examples": [{"path": "/data/val/n01/" + EVIL + ".JPEG",
                                                               "reason": "cannot identify image file"},
                                                              {"path": "/data/val/n02/b.JPEG", "reason": "truncated"}]},
                           "pass2": {"count": 1, "examples": [{"path": "/data/val/n02/b.JPEG", "reason": "truncated"}]}},
        "clipped_d_entries": {"inf": 17},
        "clamped_eigenvalues": {"layer1.0.conv1": 2, "fc": 1},
        "chosen": {m: {"log10_n": 4.0, "log10_tau": -1.0} for m in methods if m != "map"},
    }


# --------------------------------------------------------------------------- HTML parsing
class _Page(HTMLParser):
    """Tables by id (rows of cell texts, data-key per row), img srcs, scripts, external refs."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tables: dict[str, dict] = {}
        self.imgs: list[str] = []
        self.scripts = 0
        self.external: list[str] = []
        self._table = None
        self._in_body = False
        self._row = None
        self._cell = None
        self._head: list[str] = []
        self._in_head = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for k in ("src", "href"):
            if k in a and re.match(r"^\s*(https?:)?//", a[k] or ""):
                self.external.append(a[k])
        if tag == "script":
            self.scripts += 1
        elif tag == "img":
            self.imgs.append(a.get("src", ""))
        elif tag == "table" and a.get("id"):
            self._table = a["id"]
            self.tables[self._table] = {"header": [], "rows": [], "keys": []}
        elif tag == "thead":
            self._in_head = True
        elif tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._table:
            self._row = []
            if self._in_body:
                self.tables[self._table]["keys"].append(a.get("data-key"))
        elif tag in ("td", "th") and self._row is not None:
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append(self._cell)
            self._cell = None
        elif tag == "tr" and self._row is not None and self._table:
            t = self.tables[self._table]
            (t["rows"] if self._in_body else t["header"]).extend([self._row] if self._in_body else self._row)
            self._row = None
        elif tag == "thead":
            self._in_head = False
        elif tag == "tbody":
            self._in_body = False
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def parse(text: str) -> _Page:
    p = _Page()
    p.feed(text)
    return p


def _decode_png(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.load()
    assert im.format == "PNG"
    return im


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "run"
    metrics = make_metrics()
    table = make_search_table()
    summary = make_summary()
    t0 = time.perf_counter()
    paths = write.write_report(RunStore.open(str(out)), summary, metrics, table)
    elapsed = time.perf_counter() - t0
    return {"out": out, "paths": paths, "metrics": metrics, "table": table, "summary": summary, "elapsed": elapsed}


# --------------------------------------------------------------------------- tests
def test_files_exist_and_pngs_decode(built):
    paths, out = built["paths"], built["out"]
    assert set(paths) == {"html", "md", "reliability", "entropy", "hyper"}
    for name in ("reliability", "entropy", "hyper"):
        assert paths[name] == str(out / "figures" / f"{name}.png")
        im = _decode_png(Path(paths[name]).read_bytes())
        assert im.width >= 600 and im.height >= 300, (name, im.size)
        lo, hi = im.convert("L").getextrema()
        assert hi - lo > 100, f"{name}.png looks blank"
    assert Path(paths["html"]) == out / "report.html" and Path(paths["md"]) == out / "report.md"
    assert not list(out.rglob(".*.tmp")), "temporary files left behind"


def test_html_is_self_contained_with_one_row_per_method(built):
    text = Path(built["paths"]["html"]).read_text(encoding="utf-8")
    page = parse(text)
    t = page.tables["methods-table"]
    assert t["keys"] == list(TEMPERATURES)  # one row per method, in METHOD_ORDER
    assert [r[0] for r in t["rows"]] == [method_label(m) for m in TEMPERATURES]
    assert len(page.imgs) == 3
    for src in page.imgs:
        assert src.startswith("data:image/png;base64,")
        _decode_png(base64.b64decode(src.split(",", 1)[1], validate=True))
    assert page.scripts == 0 and page.external == []
    assert "url(" not in text and "@import" not in text and "<link" not in text
    assert "<details><summary>Configuration (YAML)</summary>" in text and "rank: 100" in text


def test_table_values_come_from_the_metrics(built):
    page = parse(Path(built["paths"]["html"]).read_text(encoding="utf-8"))
    t = page.tables["methods-table"]
    col = {h: i for i, h in enumerate(t["header"])}
    assert "ECE (equal width, 15 bins)" in col and "ECE (equal mass, 15 bins)" in col
    for key, row in zip(t["keys"], t["rows"]):
        m = built["metrics"][key]
        assert row[col["Accuracy"]] == f"{100 * m['accuracy']:.2f}%"
        assert row[col["NLL"]] == f"{m['nll']:.4f}"
        assert row[col["ECE (equal width, 15 bins)"]] == f"{100 * m['ece_equal_width_15']:.2f}%"
        assert row[col["ECE (equal mass, 15 bins)"]] == f"{100 * m['ece_equal_mass_15']:.2f}%"
        assert row[col["Brier"]] == f"{m['brier']:.4f}"
        assert row[col["OOD AUROC"]] == f"{m['ood']['auroc']:.3f}"
        assert row[col["Entropy in (mean)"]] == f"{m['entropy_mean']:.3f}"
        assert row[col["Entropy OOD (mean)"]].startswith("≈")
        assert row[col["posterior (s)"]] == f"{built['summary']['method_timings'][key]['posterior']:.1f}"
    rows = dict(zip(t["keys"], t["rows"]))
    assert rows["diag"][col["Numbers stored"]] == "11,679,912"
    assert rows["diag"][col["Size (MB)"]] == "44.6"  # Lee et al. Table 3, resnet18 Diag
    assert rows["inf"][col["Size (MB)"]] == "47.0"
    assert rows["kfac"][col["Size (MB)"]] == "362.4"
    assert rows["diag"][col["Corr"]] == "no" and rows["inf"][col["Corr"]] == "yes" and rows["map"][col["Corr"]] == "—"
    assert rows["map"][col["Numbers stored"]] == "—" and rows["map"][col["log10 N"]] == "—"
    assert rows["kfac"][col["log10 N"]] == "4.00" and rows["kfac"][col["log10 τ"]] == "-1.00"
    stages = page.tables["stages-table"]
    assert [r[0] for r in stages["rows"]] == ["curvature", "posterior", "search", "evaluate"]


def test_counts_and_escaping(built):
    text = Path(built["paths"]["html"]).read_text(encoding="utf-8")
    md = Path(built["paths"]["md"]).read_text(encoding="utf-8")
    assert EVIL not in text and 'onerror="alert(1)"' not in text
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;&amp;amp;" in text
    assert "<img src=x" not in md  # escaped in Markdown too
    for s in ("Skipped images (undecodable or unreadable):</b> 4", "Clipped D entries (INF diagonal correction):</b> 17",
              "Clamped eigenvalues (tiny negatives set to 0):</b> 3", "Failed search configurations:</b> 12",
              "layer1.0.conv1: 2", "Cholesky: not positive definite", "/data/val/n02/b.JPEG — truncated"):
        assert s in text, s
    assert text.count("/data/val/n02/b.JPEG") == 1  # duplicate examples of two passes shown once


def test_markdown_lists_methods_and_links_figures(built):
    md_path = Path(built["paths"]["md"])
    md = md_path.read_text(encoding="utf-8")
    for m in TEMPERATURES:
        assert re.search(r"^\| " + re.escape(md_escape(method_label(m))) + r" \|", md, re.M), m
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert links == ["figures/reliability.png", "figures/entropy.png", "figures/hyper.png"]
    for link in links:
        assert (md_path.parent / link).is_file()
    assert "ECE (equal width, 15 bins)" in md


def test_html_and_markdown_show_the_same_sections(built):
    """One page model, two templates: the same section and sub-section titles in the same order,
    and the same notes under the methods table."""
    text = Path(built["paths"]["html"]).read_text(encoding="utf-8")
    md = Path(built["paths"]["md"]).read_text(encoding="utf-8")
    html_heads = re.findall(r"<h([23])>([^<]*)</h\1>", text)
    md_heads = [(str(len(h)), t) for h, t in re.findall(r"^(##+) (.*)$", md, re.M)]
    # the run's metadata (model, data, configuration, versions) folds away in <details> below the results (issue 27)
    assert [h for h in html_heads] == [h for h in md_heads]
    assert [t for _, t in html_heads] == ["Results per method", "Time per stage (whole run)",
                                          "Figures", "Data and numerical issues", "Run"]
    for part in ("Model", "Data", "Configuration (YAML)", "Versions"):
        assert f"<details><summary>{part}</summary>" in text and f"<details><summary>{part}</summary>" in md
    html_notes = re.search(r'<ul class="notes">(.*?)</ul>', text).group(1)
    assert html_notes.count("<li>") == len(re.findall(r"^- ", md.split("## Results per method")[1].split("###")[0], re.M))


def test_templates_are_package_data():
    """A non-editable install ships every template: each file under templates/ matches a
    package-data glob of pyproject.toml, and pipelines.report is a package setuptools finds."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[3]
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = setup["packages"]["find"]["include"] if "find" in setup.get("packages", {}) else setup["packages"]
    assert any(fnmatch.fnmatch("pipelines.report", g) for g in found)
    globs = setup["package-data"]["pipelines.report"]
    files = sorted(p.relative_to(root / "pipelines" / "report").as_posix()
                   for p in (root / "pipelines" / "report" / "templates").iterdir())
    assert any(f.endswith(".html.j2") for f in files) and any(f.endswith(".md.j2") for f in files)
    for f in files:
        assert any(fnmatch.fnmatch(f, g) for g in globs), f"{f} is not package data {globs}"

def test_reliability_points_and_ood_mean_estimate():
    metrics, p_in, p_out = _probs(3, 1.2)
    pts = inputs.reliability_points(metrics, "equal_width_15")
    assert sum(p["count"] for p in pts) == N_IN
    conf = p_in.max(dim=1).values
    for p in pts:  # bin mean confidence recomputed independently
        inside = (conf > p["lo"]) & (conf <= p["hi"])
        assert int(inside.sum()) == p["count"]
        assert math.isclose(p["confidence"], float(conf[inside].mean()), rel_tol=1e-12)
        assert math.isclose(p["gap"], p["confidence"] - p["accuracy"], abs_tol=1e-15)
    mean_in, mean_out, est = inputs.ood_entropy_means(metrics)
    assert est and math.isclose(mean_in, float(normalized_entropy(p_in).mean()), rel_tol=1e-12)
    assert abs(mean_out - float(normalized_entropy(p_out).mean())) <= 0.5 / 50 + 1e-12  # half a bin


def test_plot_functions_write_pngs(tmp_path):
    metrics = make_metrics(("map", "inf"))
    figures.plot_reliability(metrics, str(tmp_path / "r.png"))
    figures.plot_reliability(metrics, str(tmp_path / "rm.png"), variant="equal_mass_15")
    figures.plot_entropy(metrics, str(tmp_path / "e.png"))
    rows = [{"method": "inf", "log10_n": 3.0 + i / 4, "log10_tau": -1.0 + i / 8, "nll": 1.0 + i / 10,
             "status": "ok" if i != 2 else "error", "reason": ""} for i in range(6)]
    figures.plot_hyper(rows, {"inf": {"n": 1e4, "tau": 0.1}}, str(tmp_path / "h.png"))
    rows = [dict(r, ece_equal_mass_15=0.01 * i) for i, r in enumerate(rows)]
    assert inputs.search_rows(rows)[1]["ece_equal_mass_15"] == 0.01
    figures.plot_hyper(rows, None, str(tmp_path / "h2.png"), objectives=["nll", "ece_equal_mass_15"])
    for n in ("r", "rm", "e", "h", "h2"):
        _decode_png((tmp_path / f"{n}.png").read_bytes())


def test_bad_inputs_are_one_line_value_errors(tmp_path):
    metrics = make_metrics(("map",))
    with pytest.raises(ValueError, match="non-empty mapping"):
        write.write_report(RunStore.open(str(tmp_path)), {}, {})
    with pytest.raises(ValueError, match="lack 'nll'"):
        write.write_report(RunStore.open(str(tmp_path)), {}, {"map": {"accuracy": 0.5, "brier": 0.1}})
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['log10_tau'\]"):
        write.write_report(RunStore.open(str(tmp_path)), {}, metrics, [{"method": "inf", "log10_n": 1.0, "nll": 1.0}])
    with pytest.raises(ValueError, match="run_summary\\['timings'\\] must be a mapping"):
        write.write_report(RunStore.open(str(tmp_path)), {"timings": [1, 2]}, metrics)
    with pytest.raises(ValueError, match="unknown ECE variant"):
        figures.render_reliability(metrics, variant="quantile_10")
    with pytest.raises(ValueError, match="chosen\\['inf'\\]"):
        figures.render_hyper([{"method": "inf", "log10_n": 1.0, "log10_tau": 0.0, "nll": 1.0}], {"inf": {"x": 1}})
    assert not (tmp_path / "report.html").exists()


def test_without_ood_or_search_and_with_given_figure(tmp_path):
    metrics = make_metrics(("map", "diag"), ood=False)
    extra = tmp_path / "elsewhere" / "custom.png"
    extra.parent.mkdir()
    extra.write_bytes(figures.render_entropy(metrics))
    paths = write.write_report(RunStore.open(str(tmp_path / "out")), {"model": "tiny"}, metrics, None, {"custom": str(extra)})
    assert set(paths) == {"html", "md", "reliability", "entropy", "custom"}
    page = parse(Path(paths["html"]).read_text(encoding="utf-8"))
    t = page.tables["methods-table"]
    assert t["keys"] == ["map", "diag"] and "Entropy (mean)" in t["header"] and "OOD AUROC" not in t["header"]
    assert len(page.imgs) == 3
    assert base64.b64decode(page.imgs[2].split(",", 1)[1]) == extra.read_bytes()
    md = Path(paths["md"]).read_text(encoding="utf-8")
    assert f"]({extra})" in md  # outside the output directory: linked by its own path


def test_failed_evaluations_are_listed_not_fatal(tmp_path):
    """A method whose evaluation did not finish (``status != "ok"``, no numbers) is listed under
    the table; the others are reported as usual; with every method failed the page still says why."""
    metrics = make_metrics(("map", "diag"), ood=False)
    metrics["kfac"] = {"status": "failed", "reason": "NaN logits in 3 of 4 batches"}
    paths = write.write_report(RunStore.open(str(tmp_path / "some")), {"model": "tiny"}, metrics)
    page = parse(Path(paths["html"]).read_text(encoding="utf-8"))
    assert page.tables["methods-table"]["keys"] == ["map", "diag"]
    line = "Evaluation failed, not in the table: kfac: failed (NaN logits in 3 of 4 batches)"
    assert line in Path(paths["html"]).read_text(encoding="utf-8")
    assert line in Path(paths["md"]).read_text(encoding="utf-8")
    assert {"reliability", "entropy"} <= set(paths)

    only = {"diag": {"status": "failed", "reason": ""}}
    paths = write.write_report(RunStore.open(str(tmp_path / "none")), {"model": "tiny"}, only)
    assert set(paths) == {"html", "md"}  # no figures without numbers
    text = Path(paths["html"]).read_text(encoding="utf-8")
    assert parse(text).tables["methods-table"]["rows"] == []
    assert "Evaluation failed, not in the table: diag: failed (no reason given)" in text
    with pytest.raises(ValueError, match="non-empty mapping"):
        write.write_report(RunStore.open(str(tmp_path / "empty")), {"model": "tiny"}, {})


def test_search_without_a_scored_configuration_is_a_note_not_a_crash(tmp_path):
    """Every (N, τ) pair failed (e.g. non-finite predictions on a random-init ResNet-50, seen
    on a GPU run): the report is written without the search figure and says why."""
    metrics = make_metrics(("map", "diag"), ood=False)
    rows = [{"config_id": i, "method": "diag", "log10_n": 1.0, "log10_tau": -3.0, "n_data": 10.0,
             "prior_precision": 1e-3, "nll": None, "ece": None, "accuracy": None, "brier": None, "count": 0,
             "status": "failed", "reason": "non-finite predictions", "seconds": 0.0} for i in range(2)]
    paths = write.write_report(RunStore.open(str(tmp_path / "r")), {"model": "tiny"}, metrics, rows)
    assert "hyper" not in paths and {"reliability", "entropy"} <= set(paths)
    note = ("Search: none of the 2 (method, configuration) pairs could be scored "
            "(first reason: non-finite predictions); no search figure.")
    assert note in Path(paths["html"]).read_text(encoding="utf-8")
    assert note in Path(paths["md"]).read_text(encoding="utf-8")
    rows[0].update(nll=0.5, ece=0.1, accuracy=0.9, brier=0.2, count=10, status="ok", reason=None)
    paths = write.write_report(RunStore.open(str(tmp_path / "r2")), {"model": "tiny"}, metrics, rows)
    assert "hyper" in paths and "Search: none" not in Path(paths["md"]).read_text(encoding="utf-8")


def test_load_eval_metrics_and_search_table(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    metrics = make_metrics(("inf", "map"))
    for m, d in metrics.items():
        storage.write_json_atomic(str(tmp_path / "eval" / m / "metrics.json"), d)
    (tmp_path / "eval" / "search").mkdir()  # a directory without metrics.json is ignored
    loaded = load.load_eval_metrics(RunStore.open(str(tmp_path)))
    assert list(loaded) == ["map", "inf"] and loaded["inf"]["nll"] == metrics["inf"]["nll"]
    df = make_search_table(("inf",))
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), str(tmp_path / "search.parquet"))
    rows = load.read_search_table(str(tmp_path / "search.parquet"))
    assert len(rows) == 14 and sum(r["status"] != "ok" for r in rows) == 2
    assert rows[3]["nll"] is None and rows[0]["nll"] == df["nll"][0]
    with pytest.raises(ValueError, match="no eval/<method>/metrics.json"):
        load.load_eval_metrics(RunStore.open(str(tmp_path / "nothing")))


@pytest.mark.s3
def test_write_report_to_s3(s3_bucket):
    bucket, endpoint = s3_bucket
    uri = bucket + "/runs/r1"
    store = RunStore.open(uri, storage.StorageOptions(endpoint))
    paths = write.write_report(store, make_summary(("map", "inf")), make_metrics(("map", "inf")), make_search_table(("inf",)))
    assert paths["html"] == uri + "/report.html" and paths["hyper"] == uri + "/figures/hyper.png"
    page = parse(storage.read_bytes(paths["html"], endpoint).decode("utf-8"))
    assert page.tables["methods-table"]["keys"] == ["map", "inf"]
    _decode_png(storage.read_bytes(paths["reliability"], endpoint))
    assert "figures/hyper.png" in storage.read_bytes(paths["md"], endpoint).decode("utf-8")


@pytest.mark.slow
def test_audit_report_compares_models(tmp_path):
    per_model = {}
    for name, methods in (("resnet18", ("map", "diag", "kfac", "efb", "inf")), ("densenet/121", ("map", "diag", "inf"))):
        summary = make_summary(methods)
        summary["posterior_sizes"] = {k: v for k, v in summary["posterior_sizes"].items() if k in methods}
        per_model[name] = (summary, make_metrics(methods))
    paths = write.write_audit_report(RunStore.open(str(tmp_path)), per_model, {"resnet18": make_search_table(("diag", "inf"))})
    assert paths["html"] == str(tmp_path / "audit.html")
    assert Path(paths["densenet/121/reliability"]) == tmp_path / "figures" / "densenet_121" / "reliability.png"
    assert "densenet/121/hyper" not in paths and "resnet18/hyper" in paths
    page = parse(Path(paths["html"]).read_text(encoding="utf-8"))
    sizes = page.tables["sizes-table"]
    assert sizes["keys"] == ["resnet18", "densenet/121"]
    col = {h: i for i, h in enumerate(sizes["header"])}
    assert sizes["rows"][0][col["Diag: numbers (MB), corr: no"]] == "11,679,912 (44.6)"
    assert sizes["rows"][0][col["INF: numbers (MB), corr: yes"]] == "12,317,373 (47.0)"
    assert sizes["rows"][1][col["KFAC: numbers (MB), corr: yes"]] == "—"  # densenet's summary has no KFAC size
    mt = page.tables["methods-table"]
    assert mt["keys"] == [f"resnet18/{m}" for m in ("map", "diag", "kfac", "efb", "inf")] + \
        [f"densenet/121/{m}" for m in ("map", "diag", "inf")]
    assert len(page.imgs) == 1 + 3 + 2 and all(s.startswith("data:image/png;base64,") for s in page.imgs)
    assert page.scripts == 0 and page.external == []
    for p in paths.values():
        assert Path(p).is_file()


# --------------------------------------------------------------------------- headless browser
def _nonblank(region: Image.Image) -> bool:
    lo, hi = region.convert("L").getextrema()
    return hi - lo > 60


@pytest.mark.browser
@pytest.mark.slow
def test_report_renders_in_headless_chromium(built, tmp_path):
    """Acceptance: the page renders in headless Chromium; the table is there, every image loaded,
    and the screenshot shows the figures (the image regions are not blank)."""
    path, reason = browser.ensure_chromium()
    if path is None:
        print(f"SKIP reason: {reason}")
        pytest.skip(f"headless chromium unavailable: {reason}")
    t0 = time.perf_counter()
    checked = tmp_path / "report_checked.html"
    checked.write_text(browser.with_check_script(Path(built["paths"]["html"]).read_text(encoding="utf-8")),
                       encoding="utf-8")
    info = browser.read_check(browser.dump_dom(checked))
    assert info["images"] == 3 and info["loaded"] == 3, info
    assert info["rows"] == len(TEMPERATURES) and info["keys"] == list(TEMPERATURES)
    for x, y, w, h, nw, nh in info["boxes"]:
        assert w > 300 and h > 150 and nw > 0 and nh > 0

    shot = browser.screenshot(built["paths"]["html"], tmp_path / "shot.png", window=(1400, 3000))
    im = Image.open(shot).convert("RGB")
    assert im.size == (1400, 3000)
    assert any(lo != hi for lo, hi in im.getextrema()), "screenshot is a single colour"
    visible = 0
    for x, y, w, h, _, _ in info["boxes"]:
        top, bottom = max(0, int(y)), min(im.height, int(y + h))
        if bottom - top < 100:
            continue  # below the fold
        visible += 1
        assert _nonblank(im.crop((int(x) + 2, top + 2, int(x + w) - 2, bottom - 2))), (x, y, w, h)
    assert visible >= 1, f"no figure inside the 1400x3000 screenshot: boxes {info['boxes']}"
    print(f"chromium check: {time.perf_counter() - t0:.1f} s ({path})")


def _with_intervals(results: dict, n: int = 269) -> dict:
    """``results`` with planted paired intervals: INF better than MAP on ECE and NLL, the rest n.s."""
    out = {}
    for m, r in results.items():
        ci = {k: [v - 0.01, v + 0.01] for k, v in r.items() if isinstance(v, float)}
        paired = {}
        for ref in ("map", "temperature"):
            if ref == m or ref not in results:
                continue
            paired[ref] = {}
            for k, v in ci.items():
                if k not in results[ref]:
                    continue
                d = r[k] - results[ref][k]
                sig = m == "inf" and ref == "map" and k in ("ece", "nll")
                lo, hi = (d - abs(d) / 2, d + abs(d) / 2) if sig else (d - 0.05, d + 0.05)
                paired[ref][k] = {"diff": d, "lo": lo, "hi": hi, "significant": sig}
        out[m] = {**r, "intervals": {"n": n, "n_ood": 100, "resamples": 1000, "seed": 0, "level": 0.95,
                                     "ci": ci, "paired": paired}}
    return out


def test_the_report_opens_with_the_verdict(tmp_path):
    """Summary first (HTML and Markdown): one row per headline metric with its better direction,
    every value with its interval, the best value(s) marked (ties are ties), the paired differences
    against MAP and temperature scaling, and sentences that claim a difference only where the paired
    interval excludes 0 (issue 27)."""
    from pipelines.report.verdict import summary_table, verdict_sentences

    results = {"map": {"status": "ok", "accuracy": 0.90, "nll": 0.40, "ece": 0.034, "brier": 0.15, "ood_auroc": 0.80},
               "diag": {"status": "ok", "accuracy": 0.90, "nll": 0.35, "ece": 0.020, "brier": 0.14, "ood_auroc": 0.80},
               "inf": {"status": "ok", "accuracy": 0.91, "nll": 0.30, "ece": 0.011, "brier": 0.13, "ood_auroc": 0.85},
               "temperature": {"status": "ok", "accuracy": 0.90, "nll": 0.33, "ece": 0.013, "brier": 0.14}}
    results = _with_intervals(results)
    sizes = {"diag": {"numbers": 1000}, "inf": {"numbers": 1050}, "temperature": {"numbers": 1}}
    header, rows, marked, keys = summary_table(results)
    t_label = method_label("temperature")
    assert header[:2] == ["Metric", "Better"] and header[-1] == "Best"
    assert header[2:-1] == ["MAP", t_label, "Diag", "INF"]  # temperature scaling the first row after MAP
    assert keys == ["accuracy", "nll", "ece", "brier", "ood_auroc"]
    ece = dict(zip(header, rows[2]))
    nb = "\u00a0"  # no-break space inside an interval
    assert ece == {"Metric": "ECE", "Better": "↓ lower", "MAP": f"3.4% [2.4,{nb}4.4]", "Diag": f"2.0% [1.0,{nb}3.0]",
                   "INF": f"1.1% [0.1,{nb}2.1]", t_label: f"1.3% [0.3,{nb}2.3]", "Best": "INF"}
    auroc = dict(zip(header, rows[4]))  # INF's paired difference against MAP does not exclude 0 here
    assert auroc["Best"] == "INF (n.s. vs MAP)" and auroc[t_label] == "—"
    acc = dict(zip(header, rows[0]))
    assert acc["Best"] == "INF (n.s. vs MAP)"
    assert dict(zip(header, rows[1]))["Best"] == "INF"  # NLL: better than MAP, the interval excludes 0
    inf = header.index("INF")
    assert (2, inf) in marked and (0, inf) in marked and (4, inf) in marked and len(marked) == 5
    said = verdict_sentences(results, sizes)
    assert said[0].startswith("Temperature vs MAP: no significant difference at n = 269")
    inf_s = next(s for s in said if s.startswith("INF"))
    assert inf_s.startswith("INF vs MAP: better NLL, ECE; "
                            "no significant difference at n = 269 in Accuracy, Brier, OOD AUROC; "
                            f"vs {t_label}: no significant difference at n = 269 on any metric")
    tie = _with_intervals({"map": {"status": "ok", "ood_auroc": 1.0}, "diag": {"status": "ok", "ood_auroc": 1.0}})
    h, r, mk, _ = summary_table(tie)
    assert dict(zip(h, r[0]))["Best"] == "all tied" and len(mk) == 2
    no_iv = {m: {k: v for k, v in d.items() if k != "intervals"} for m, d in results.items()}
    assert all("no difference is claimed" in s for s in verdict_sentences(no_iv))
    summary = {"title": "t", "results": results, "posterior_sizes": sizes,
               "temperature": {"temperature": 1.0, "fallback": "temperature scaling: the search split is separable"}}
    page = build_report_page(summary, {}, [])
    html, md = render_html(page), render_markdown(page)
    assert html.index('id="summary-table"') < html.index("<h2>Run") and html.index("<table") == html.index('<table id="summary-table"')
    assert f'<td class="best"><strong>1.1% [0.1,{nb}2.1]</strong></td>' in html
    assert "n = 269 test images and 100 OOD images" in html and "n = 269 test images" in md
    assert html.index('id="summary-table"') < html.index('id="paired-table"') < html.index("<h2>Run")
    assert "temperature scaling: the search split is separable" in html and "search split is separable" in md
    assert "INF − MAP" in html and "better" in html and "n.s." in md
    first_table = next(ln for ln in md.splitlines() if ln.startswith("|"))
    assert first_table.startswith("| Metric | Better | MAP |") and f"| **1.1% \\[0.1,{nb}2.1\\]** |" in md
    assert md.index("## Summary") < md.index("## Paired differences") < md.index("## Run")
    # no fallback, but T fit on few mistakes (the demo's converged CNN: 1 of 269): the fit's note, last
    note = "only 1 of the 269 fitting examples is misclassified, so T is set by few mistakes"
    few = build_report_page({**summary, "temperature": {"temperature": 0.2701, "fallback": "", "note": note}}, {}, [])
    html, md = render_html(few), render_markdown(few)
    said = f"Temperature scaling (T = 0.27, fit on the search split): {note}."
    assert said in html and said in md and "separable" not in html
