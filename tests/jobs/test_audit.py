"""The audit end to end: the `audit` preset runs two different models in one job and writes one
comparison report (Lee et al. 2020, Table 3 per model + figures).

One job in all (the expensive part, one Ray Train fit per model): ``jobs/imagenet_inf.py --preset
audit`` on a private local Ray instance, over an ImageNet-layout tree of real JPEGs written here
(``train/<wnid>/*.JPEG`` with an empty class, flat ``val/`` + ``LOC_val_solution.csv``) and an OOD
folder, with two architectures (``tiny_cnn`` and ``demo_cnn``) whose state dicts are written here
with ``torch.save`` (read back with ``weights_only=True``). The preset's cluster sizes are cut
down with ``--set`` (one Ray Train worker per fit to keep CI short; tests/jobs/test_job.py covers
two); ``models:`` is given the way infra/README.md documents it
(``--set 'models=[{name: ..., weights: ...}, ...]'``).

Checked: per-model artifacts under ``<output>/models/<name>/`` (stage markers, posteriors whose
stored counts match the report, metrics, run.json); ``audit.html`` / ``audit.md`` exist and parse;
the Table-3 size table has a row per model whose numbers equal independent counts of the
posteriors' stored numbers (and MB = numbers x 4 / 2^20); the metrics table has one row per
model x method with finite numbers; every figure the Markdown links exists and is a PNG; the
top-level ``run.json`` lists the models; the page renders in headless Chromium (every image
decodes) when Chromium is available. Then, cheaply: a re-submission skips every stage of both
models; ``--stages report`` on an empty output writes only the listing; a failed evaluation is
listed, not fatal; duplicate model names and ``--weights`` next to ``models:`` are refused.
"""
from __future__ import annotations

import html.parser
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import background  # tests/background.py: whole jobs beside the suite
import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "jobs" / "imagenet_inf.py"
METHODS = ("diag", "kfac", "efb", "inf")
ROWS = ("temperature", *METHODS)  # the preset evaluates temperature scaling too (issue 27), after MAP
MODELS = ("tiny_cnn", "demo_cnn")
NUM_CLASSES = 4  # imagegen's 3 wnids + the empty class (its index stays reserved)
STAGES = ("curvature", "posterior", "search", "evaluate", "report")
MB = 2**20
#: figures per model on the audit page: reliability, entropy, hyper-parameter map, risk-coverage
PER_MODEL_FIGURES = 4

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


imagegen = _load("infoform_test_imagegen", ROOT / "tests" / "pipelines" / "imagegen.py")
browser = _load("infoform_test_browser_audit", ROOT / "tests" / "jobs" / "browser.py")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    return env


def _write_inputs(base: Path) -> dict[str, Path]:
    import torch

    from pipelines.ingest.demo_data import small_cnn
    from pipelines.ingest.models import tiny_cnn

    data = base / "imagenet"
    imagegen.make_imagenet_tree(data, per_class=8, n_val=24, size=(24, 20))
    ood = base / "ood"
    ood.mkdir()
    for i in range(12):  # a different image family: horizontal colour ramps
        img = imagegen.random_rgb(f"ood/{i}", (24, 20)).transpose(0)
        (ood / f"ood_{i:03d}.jpg").write_bytes(imagegen.jpeg_bytes(img))
    weights = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        nets = {"tiny_cnn": tiny_cnn(NUM_CLASSES), "demo_cnn": small_cnn(NUM_CLASSES, seed=0)}
    for name, net in nets.items():
        weights[name] = base / f"{name}.pt"
        torch.save(net.state_dict(), weights[name])
    return {"data": data, "ood": ood, **weights}


def _job_args(inputs: dict[str, Path], out: Path) -> list[str]:
    models = "[" + ", ".join(f"{{name: {m}, weights: {inputs[m]}}}" for m in MODELS) + "]"
    sets = [
        f"models={models}",
        "curvature.num_workers=1", "curvature.cpus_per_worker=0.5", "curvature.use_gpu=false",
        "curvature.batch_size=16",
        "data.limit=null", "data.per_class=null", "data.val_limit=null", "data.test_limit=null",
        "data.partition_size=100", "data.image_size=16", "data.resize_size=16",
        "posterior.rank=5",
        "search.num_configs=2", "search.mc_samples=2", "search.log10_n=[2.0, 3.0]", "search.log10_tau=[0.0, 2.0]",
        "evaluate.mc_samples=3", "evaluate.num_actors=1", "evaluate.batch_size=32", "evaluate.gpus_per_actor=0",
    ]
    args = ["--preset", "audit", "--data", str(inputs["data"]), "--ood", str(inputs["ood"]), "--output", str(out)]
    for s in sets:
        args += ["--set", s]
    return args


@background.job("audit_run")
def _audit_job(base: Path):
    """The two-model audit, run beside the suite (``tests/background.py``)."""
    inputs = _write_inputs(base)
    out = base / "out"
    cmd = [sys.executable, str(JOB), *_job_args(inputs, out)]
    yield
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, (res.stdout[-5000:], res.stderr[-5000:])
    return out, res.stdout, inputs


@pytest.fixture(scope="module")
def audit_run(tmp_path_factory):
    return background.result(_audit_job, tmp_path_factory)


# --------------------------------------------------------------------------- HTML parsing
class _Page(html.parser.HTMLParser):
    """Tables (by id: header cells, body rows with their data-key) and <img> sources."""

    def __init__(self):
        super().__init__()
        self.tables: dict[str, dict] = {}
        self.imgs: list[str] = []
        self._table = None
        self._row = None
        self._cell = None
        self._in_head = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table" and a.get("id"):
            self._table = self.tables.setdefault(a["id"], {"header": [], "rows": [], "keys": []})
        elif self._table is not None and tag == "thead":
            self._in_head = True
        elif self._table is not None and tag == "tr":
            self._row = []
            if not self._in_head:
                self._table["keys"].append(a.get("data-key"))
        elif self._table is not None and tag in ("td", "th"):
            self._cell = []
        elif tag == "img":
            self.imgs.append(a.get("src", ""))

    def handle_endtag(self, tag):
        if self._table is None:
            return
        if tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            if self._in_head:
                self._table["header"] = self._row
            else:
                self._table["rows"].append(self._row)
            self._row = None
        elif tag == "thead":
            self._in_head = False
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _page(out: Path) -> _Page:
    p = _Page()
    p.feed((out / "audit.html").read_text(encoding="utf-8"))
    return p


def _number(cell: str) -> float:
    """'1,234 (0.0)' -> 1234; '12.50%' -> 12.5; '≈0.812' -> 0.812."""
    m = re.search(r"-?[\d,]+(?:\.\d+)?", cell.replace("≈", ""))
    assert m, f"no number in cell {cell!r}"
    return float(m.group(0).replace(",", ""))


# --------------------------------------------------------------------------- tests
def test_each_model_has_its_own_complete_run(audit_run):
    out, log, inputs = audit_run
    from laplace_core.posteriors.structures.base import load_posterior

    for model in MODELS:
        sub = out / "models" / model
        for stage in STAGES:
            marker = json.loads((sub / "stages" / f"{stage}.json").read_text())
            assert marker["stage"] == stage and marker["fingerprint"], (model, stage)
        run = json.loads((sub / "run.json").read_text())
        assert run["model"]["name"] == model and run["model"]["weights"] == str(inputs[model])
        assert run["data"]["num_classes"] == NUM_CLASSES
        assert run["curvature"]["num_workers"] == 1 and run["curvature"]["count"] == 3 * 8
        assert set(run["results"]) == {"map", *ROWS}
        for m in ("map", *ROWS):
            metrics = json.loads((sub / "eval" / m / "metrics.json").read_text())
            assert metrics["status"] == "ok" and 0.0 <= metrics["accuracy"] <= 1.0, (model, m)
            assert isinstance(metrics.get("ood"), dict) and 0.0 <= metrics["ood"]["auroc"] <= 1.0, (model, m)
        for m in METHODS:
            post = load_posterior(str(sub / "posterior" / m))
            assert post.method == m and post.num_stored() == run["posterior_sizes"][m]["numbers"]
        assert (sub / "report.html").is_file() and (sub / "eval" / "search.parquet").is_file()
        assert f"audit: model {model} -> {sub}" in log
    # two different architectures: different posterior sizes
    sizes = {m: json.loads((out / "models" / m / "run.json").read_text())["posterior_sizes"]["diag"]["numbers"]
             for m in MODELS}
    assert sizes["tiny_cnn"] != sizes["demo_cnn"]


def _independent_counts(model: str, weights: Path) -> dict[str, int]:
    """Numbers stored per method, counted from the layer shapes alone (W~ = [W, b] is m x n):
    Diag m*n; KFAC m^2 + n^2; EFB m^2 + n^2 + m*n (Lee et al. Table 3)."""
    from torch import nn

    from pipelines.ingest.models import load_model

    net = load_model(model, str(weights))
    diag = kfac = 0
    for mod in net.modules():
        if isinstance(mod, (nn.Linear, nn.Conv2d)):
            m = mod.weight.shape[0]
            n = mod.weight[0].numel() + (mod.bias is not None)
            diag += m * n
            kfac += m * m + n * n
    return {"diag": diag, "kfac": kfac, "efb": kfac + diag}


def test_table3_row_per_model_with_exact_sizes(audit_run):
    out, _, inputs = audit_run
    page = _page(out)
    t3 = page.tables["sizes-table"]
    assert t3["keys"] == list(MODELS), t3
    header = t3["header"]
    assert header[0] == "Model"
    col = {h.split(":")[0]: i for i, h in enumerate(header)}
    assert {"Diag", "KFAC", "EFB", "INF"} <= set(col), header
    for model, row in zip(MODELS, t3["rows"]):
        assert row[0] == model
        run = json.loads((out / "models" / model / "run.json").read_text())
        expect = _independent_counts(model, inputs[model])
        for meth, label in (("diag", "Diag"), ("kfac", "KFAC"), ("efb", "EFB"), ("inf", "INF")):
            cell = row[col[label]]
            m = re.fullmatch(r"([\d,]+) \(([\d,.]+)\)", cell)
            assert m, (model, label, cell)
            numbers = int(m.group(1).replace(",", ""))
            assert numbers == run["posterior_sizes"][meth]["numbers"], (model, meth)
            if meth in expect:
                assert numbers == expect[meth], (model, meth, numbers, expect[meth])
            assert float(m.group(2).replace(",", "")) == pytest.approx(numbers * 4 / MB, abs=0.05 + 1e-9)


def test_metrics_table_row_per_model_and_method(audit_run):
    out, _, _ = audit_run
    page = _page(out)
    t = page.tables["methods-table"]
    want = [f"{model}/{m}" for model in MODELS for m in ("map", *ROWS)]
    assert t["keys"] == want, t["keys"]
    h = t["header"]
    for name in ("Model", "Method", "Accuracy", "NLL", "Brier", "OOD AUROC", "Numbers stored", "Size (MB)"):
        assert name in h, h
    assert any(c.startswith("ECE (") for c in h), h
    for key, row in zip(t["keys"], t["rows"]):
        model, meth = key.split("/")
        cells = dict(zip(h, row))
        assert cells["Model"] == model
        metrics = json.loads((out / "models" / model / "eval" / meth / "metrics.json").read_text())
        assert _number(cells["Accuracy"]) == pytest.approx(100 * metrics["accuracy"], abs=0.006)
        assert _number(cells["NLL"]) == pytest.approx(metrics["nll"], abs=6e-5)
        assert _number(cells["OOD AUROC"]) == pytest.approx(metrics["ood"]["auroc"], abs=6e-4)
        assert math.isfinite(_number(cells["Brier"]))
        if meth in ("map", "temperature"):  # no posterior stored, no (N, tau) chosen
            assert cells["Numbers stored"] == "—"
        else:
            run = json.loads((out / "models" / model / "run.json").read_text())
            assert _number(cells["Numbers stored"]) == run["posterior_sizes"][meth]["numbers"]
            chosen = run["chosen"][meth]
            assert _number(cells["log10 N"]) == pytest.approx(chosen["log10_n"], abs=0.006)


def test_markdown_and_figures(audit_run):
    out, log, _ = audit_run
    md = (out / "audit.md").read_text(encoding="utf-8")
    assert md.startswith("# ") and "Table 3" in md
    tables = [ln for ln in md.splitlines() if ln.startswith("|")]
    for model in MODELS:
        assert sum(1 for ln in tables if ln.startswith(f"| {model.replace('_', chr(92) + '_')} |")) == 1 + 1 + len(ROWS)
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert "figures/comparison.png" in links
    for model in MODELS:
        for fig in ("reliability", "entropy", "hyper", "risk_coverage"):
            assert f"figures/{model}/{fig}.png" in links, (model, fig, links)
    for link in links:
        p = out / link
        assert p.is_file() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", link
    page = _page(out)
    assert len(page.imgs) == 1 + PER_MODEL_FIGURES * len(MODELS)
    assert all(s.startswith("data:image/png;base64,") for s in page.imgs)
    assert f"report at {out / 'audit.html'}" in log


def test_top_level_run_json_lists_the_models(audit_run):
    out, _, _ = audit_run
    run = json.loads((out / "run.json").read_text())
    assert sorted(run["models"]) == sorted(MODELS)  # JSON objects are written with sorted keys
    for model in MODELS:
        assert run["models"][model]["output"] == str(out / "models" / model)
        assert set(run["models"][model]["results"]) == {"map", *ROWS}
    assert run["report"] == {"html": str(out / "audit.html"), "md": str(out / "audit.md")}


@pytest.mark.browser
def test_audit_page_renders_in_headless_chromium(audit_run, tmp_path):
    out, _, _ = audit_run
    path, reason = browser.ensure_chromium()
    if path is None:
        pytest.skip(f"headless chromium unavailable: {reason}")
    checked = tmp_path / "audit_checked.html"
    checked.write_text(browser.with_check_script((out / "audit.html").read_text(encoding="utf-8")), encoding="utf-8")
    info = browser.read_check(browser.dump_dom(checked))
    n_img = 1 + PER_MODEL_FIGURES * len(MODELS)
    assert info["images"] == n_img and info["loaded"] == n_img, info
    assert info["keys"] == [f"{model}/{m}" for model in MODELS for m in ("map", *ROWS)]
    for _, _, w, h, nw, nh in info["boxes"]:
        assert w > 200 and h > 100 and nw > 0 and nh > 0


def test_resubmission_skips_every_stage_of_every_model(audit_run):
    """The same command again: every stage of both models is found done, Ray is never started,
    and both levels of run.json come out identical (the comparison report is rewritten)."""
    out, _, inputs = audit_run
    before = {p: p.read_text() for p in [out / "run.json", *(out / "models" / m / "run.json" for m in MODELS)]}
    res = subprocess.run([sys.executable, str(JOB), *_job_args(inputs, out)], env=_env(), capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("done earlier, skipped") == len(STAGES) * len(MODELS), res.stdout
    assert not re.search(r"stage \w+: running", res.stdout), res.stdout
    assert "Started a local Ray instance" not in res.stdout + res.stderr
    for p, text in before.items():
        assert json.loads(p.read_text()) == json.loads(text), p


def test_audit_without_evaluations_writes_the_listing_only(audit_run, tmp_path):
    """``--stages report`` on an empty output: no model has results, so no comparison page; the
    job still succeeds, lists the models in run.json and needs no cluster."""
    _, _, inputs = audit_run
    out = tmp_path / "partial"
    res = subprocess.run([sys.executable, str(JOB), *_job_args(inputs, out), "--stages", "report"], env=_env(),
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "no comparison report written" in res.stdout and f"report at {out / 'run.json'}" in res.stdout
    assert "Started a local Ray instance" not in res.stdout + res.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["report"] is None and sorted(run["models"]) == sorted(MODELS)
    assert all(run["models"][m]["results"] is None for m in MODELS)
    assert not (out / "audit.html").exists()


def test_failed_evaluation_is_listed_not_fatal(audit_run, tmp_path):
    """A method whose evaluation failed (metrics.json with status "failed", no numbers) is named
    in the comparison's notes and left out of its rows; the other rows and figures stay."""
    from pipelines.report.load import load_eval_metrics
    from pipelines.report.write import write_audit_report
    from pipelines.storage.store import RunStore

    out, _, _ = audit_run
    per_model = {}
    for model in MODELS:
        sub = out / "models" / model
        metrics = load_eval_metrics(RunStore.open(str(sub)))
        if model == "demo_cnn":
            metrics["kfac"] = {"method": "kfac", "status": "failed", "reason": "actor died"}
        per_model[model] = (json.loads((sub / "run.json").read_text()), metrics)
    paths = write_audit_report(RunStore.open(str(tmp_path)), per_model)
    page = _page(tmp_path)
    keys = page.tables["methods-table"]["keys"]
    assert "demo_cnn/kfac" not in keys and "tiny_cnn/kfac" in keys and "demo_cnn/inf" in keys
    assert "demo_cnn/kfac: failed (actor died)" in (tmp_path / "audit.html").read_text(encoding="utf-8")
    assert Path(paths["demo_cnn/reliability"]).is_file()


def test_duplicate_model_names_are_refused_before_any_cluster_work(tmp_path):
    w = tmp_path / "t.pt"
    import torch

    from pipelines.ingest.models import tiny_cnn

    torch.save(tiny_cnn(4).state_dict(), w)
    (tmp_path / "data" / "train" / "a").mkdir(parents=True)
    res = subprocess.run([sys.executable, str(JOB), "--preset", "audit", "--data", str(tmp_path / "data"),
                          "--set", f"models=[{{name: tiny_cnn, weights: {w}}}, {{name: tiny_cnn, weights: {w}}}]"],
                         env=dict(_env(), RAY_ADDRESS=""), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "tiny_cnn listed more than once" in lines[0], res.stderr
    assert "Started a local Ray" not in res.stdout + res.stderr


def test_model_flags_with_a_models_list_are_refused(tmp_path):
    """--weights would be silently ignored next to a models: list; say so instead."""
    w = tmp_path / "t.pt"
    import torch

    from pipelines.ingest.models import tiny_cnn

    torch.save(tiny_cnn(4).state_dict(), w)
    (tmp_path / "data" / "train" / "a").mkdir(parents=True)
    res = subprocess.run([sys.executable, str(JOB), "--preset", "audit", "--data", str(tmp_path / "data"),
                          "--set", f"models=[{{name: tiny_cnn, weights: {w}}}]", "--model", "resnet18", "--weights", str(w)],
                         env=dict(_env(), RAY_ADDRESS=""), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "both model" in lines[0] and "models:" in lines[0], res.stderr
