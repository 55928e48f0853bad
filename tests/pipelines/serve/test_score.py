"""``infoform score`` and ``infoform.load_run`` on one smoke run (the session's, built once and
shared with the shift tests: the smoke preset with ``--methods temperature,diag,inf``, K = 4).

Checked:
* scoring the run's own test split writes one row per image, in index order, with every column;
  its probabilities equal the evaluation stage's per-image predictive to :data:`PROB_TOL` (the
  reference is the evaluation's own code path run in this process: ``iter_chunks`` ->
  ``make_predictor`` -> ``predict_chunk`` with the run's chosen ``(N, τ)`` and seed), and that
  reference reproduces the accuracy and NLL the evaluation stored in ``eval/inf/metrics.json``;
* the flag threshold is the entropy at 95% TPR on the test split, stored in the run, and
  ``flag == entropy > threshold``;
* ``load_run(...).predict`` on images decoded in this process equals the scored rows;
* resuming: with two of four block files removed, a re-run computes exactly those two (the same
  bytes: a real SIGKILL mid-run was checked by hand, benchmarks/RESULTS.md), leaves the
  others untouched and gives the same table;
* the same run, data and output on S3 (moto's server, ``--endpoint-url``) give the same rows;
* a missing run, another model's name, or an output holding other settings: one line, exit 2.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from pipelines.storage.store import RunStore
from pipelines.storage.uris import StorageOptions

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROB_TOL = 1e-6  # the acceptance tolerance: per-image probabilities, score vs the evaluation
COLUMNS = ("path", "label", "valid", "error", "pred", "topk_classes", "topk_probs", "max_prob", "entropy",
           "expected_entropy", "mutual_information", "probs", "flag")
README = Path(__file__).resolve().parents[3] / "README.md"


@pytest.fixture(scope="module")
def smoke_run(smoke_shift_run):
    """The session's smoke run (temperature, diag, INF; ``tests/pipelines/conftest.py``): its
    shift sweep and ASHA search do not touch what scoring reads."""
    return str(smoke_shift_run)


def _score(capsys, *args):
    from pipelines.cli.main import main

    code = main(["score", *args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


@pytest.fixture(scope="module")
def scored(smoke_run, tmp_path_factory):
    """The test split scored with ``inf`` (blocks of 30: four files)."""
    from pipelines.cli.main import main

    out = str(tmp_path_factory.mktemp("scores") / "inf")
    assert main(["score", "--run", smoke_run, "--data", "run:test", "--output", out, "--method", "inf",
                 "--keep-probs", "--block-size", "30"]) == 0
    return out


def _evaluation_reference(run_uri: str, method: str = "inf"):
    """Per-image probabilities of the evaluation's code path, in this process, and the labels."""
    import torch

    from pipelines.evaluation.chunks import iter_chunks
    from pipelines.evaluation.predictors import load_eval_model, load_posteriors, make_predictor, predict_chunk
    from pipelines.ingest.batches import iter_local_batches
    from pipelines.serve.run_loader import read_run

    info = read_run(RunStore.open(run_uri))
    ev = info.eval_config()
    index, dcfg = info.split("test")
    model = load_eval_model(info.model, dtype=ev.torch_dtype, device="cpu")
    post = load_posteriors({method: info.posterior_uris[method]}, {method: info.hyper[method]})[method]
    pred = make_predictor(model, post, ev.pred_type, ev.mc_samples, ev.seed, int(ev.sample_cache_mb * 2**20))
    probs, labels = [], []
    with torch.no_grad():
        for chunk in iter_chunks(iter_local_batches(index, dcfg, batch_size=37), ev.batch_size,
                                 ev.batches_per_chunk, dtype=ev.torch_dtype):
            probs += predict_chunk(model, pred, chunk)
            labels += [y[:n] for y, n in zip(chunk.ys, chunk.sizes)]
    return index, torch.cat(probs).numpy(), torch.cat(labels).numpy()


def test_scoring_the_test_split_reproduces_the_evaluation(smoke_run, scored):
    import json

    from pipelines.serve.score import read_scores

    table = read_scores(scored)
    index, ref, labels = _evaluation_reference(smoke_run)
    assert table.num_rows == len(index) == 100 and tuple(table.column_names) == COLUMNS
    assert table.column("path").to_pylist() == list(index.paths)
    assert table.column("valid").to_numpy().all()
    probs = np.stack(table.column("probs").to_numpy(zero_copy_only=False))
    err = float(np.abs(probs - ref).max())
    print(f"max |p_score - p_eval| = {err:.3g}")
    assert err <= PROB_TOL
    # the reference is the stored evaluation: its accuracy and NLL equal eval/inf/metrics.json
    metrics = json.loads(Path(smoke_run, "eval", "inf", "metrics.json").read_text())
    assert (ref.argmax(1) == labels).mean() == pytest.approx(metrics["accuracy"], abs=1e-12)
    nll = -np.log(np.clip(ref[np.arange(len(labels)), labels].astype(np.float64), 1e-12, None)).mean()
    assert nll == pytest.approx(metrics["nll"], abs=1e-5)
    ent = table.column("entropy").to_numpy()
    exp_h, mi = table.column("expected_entropy").to_numpy(), table.column("mutual_information").to_numpy()
    assert np.allclose(ent, exp_h + mi, atol=1e-9) and (mi >= 0).all() and mi.max() > 0
    assert (table.column("pred").to_numpy() == ref.argmax(1)).all()
    topk = np.stack(table.column("topk_classes").to_numpy(zero_copy_only=False))
    assert topk.shape == (100, 5) and (topk[:, 0] == table.column("pred").to_numpy()).all()


def test_flag_threshold_is_the_entropy_at_95_percent_tpr_stored_in_the_run(smoke_run, scored):
    import json

    from pipelines.serve.score import read_scores

    doc = json.loads(Path(smoke_run, "score", "flag-inf-nn-k4-s0.json").read_text())
    table = read_scores(scored)
    ent, flag = table.column("entropy").to_numpy(), table.column("flag").to_numpy(zero_copy_only=False)
    assert doc["num_images"] == 100 and doc["tpr"] == 0.95
    assert (flag == (ent > doc["entropy"])).all()
    assert (ent <= doc["entropy"]).mean() >= 0.95 and (ent < doc["entropy"]).mean() < 0.95  # the 95% point


def test_load_run_predict_equals_the_scored_rows(smoke_run, scored):
    import infoform
    from pipelines.ingest.batches import iter_local_batches
    from pipelines.serve.score import read_scores

    run = infoform.load_run(smoke_run)
    assert set(run.posteriors) == {"diag", "inf"} and set(run.hyper) == {"diag", "inf"}
    assert run.temperature is not None and run.model.training is False
    index, dcfg = run.info.split("test")
    batch = next(iter_local_batches(index, dcfg, batch_size=12))
    import torch

    out = run.predict(torch.from_numpy(batch["image"]), method="inf")
    table = read_scores(scored).slice(0, 12)
    assert list(batch["path"]) == table.column("path").to_pylist()
    probs = np.stack(table.column("probs").to_numpy(zero_copy_only=False))
    assert np.abs(out["probs"] - probs).max() <= PROB_TOL
    for col in ("entropy", "expected_entropy", "mutual_information"):
        assert np.abs(out[col] - table.column(col).to_numpy()).max() <= 1e-5, col


def test_a_rerun_recomputes_only_the_missing_blocks(smoke_run, scored, capsys):
    from pipelines.serve.score import read_scores

    before = read_scores(scored)
    files = sorted(p for p in os.listdir(scored) if p.startswith("part-"))
    assert len(files) == 4  # 100 images in blocks of 30
    for name in files[1:3]:  # as if the run had been killed before these were written
        os.remove(os.path.join(scored, name))
    kept = {n: os.stat(os.path.join(scored, n)).st_mtime_ns for n in (files[0], files[3])}
    code, out, err = _score(capsys, "--run", smoke_run, "--data", "run:test", "--output", scored,
                            "--method", "inf", "--keep-probs", "--block-size", "30")
    assert code == 0, err
    assert re.search(r"2 of 4 block\(s\) to compute \(60 images\)", out), out
    assert {n: os.stat(os.path.join(scored, n)).st_mtime_ns for n in kept} == kept
    after = read_scores(scored)
    assert after.column_names == before.column_names
    for col in before.column_names:
        a, b = after.column(col).to_pylist(), before.column(col).to_pylist()
        if col in ("path", "label", "valid", "error", "pred", "topk_classes", "flag"):
            assert a == b, col
        else:  # bit for bit: every forward is on a fixed-size batch, whichever rows Ray Data groups
            assert np.array_equal(np.asarray(a, dtype=float), np.asarray(b, dtype=float), equal_nan=True), col


@pytest.mark.s3
def test_scoring_on_s3_gives_the_same_rows(smoke_run, scored, s3_bucket, capsys):
    import s3fs

    from pipelines.serve.score import read_scores

    bucket, endpoint = s3_bucket
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, use_listings_cache=False)
    for name in ("config.json", "run.json", "stages", "posterior", "score"):  # what scoring reads
        src = os.path.join(smoke_run, name)
        fs.put(src, f"{bucket[5:]}/run/{name}", recursive=os.path.isdir(src))
    out = f"{bucket}/scores"
    code, log, err = _score(capsys, "--run", f"{bucket}/run", "--data", "run:test", "--output", out,
                            "--method", "inf", "--keep-probs", "--block-size", "30", "--endpoint-url", endpoint)
    assert code == 0, err
    got, ref = read_scores(out, RunStore.open(None, StorageOptions(endpoint))), read_scores(scored)
    assert got.num_rows == ref.num_rows == 100
    assert sorted(got.column("path").to_pylist()) == sorted(ref.column("path").to_pylist())
    order = np.argsort(got.column("path").to_numpy(zero_copy_only=False))
    ref_order = np.argsort(ref.column("path").to_numpy(zero_copy_only=False))
    p_got = np.stack(got.column("probs").to_numpy(zero_copy_only=False))[order]
    p_ref = np.stack(ref.column("probs").to_numpy(zero_copy_only=False))[ref_order]
    assert np.abs(p_got - p_ref).max() <= PROB_TOL
    assert got.column("flag").to_pylist() == [ref.column("flag").to_pylist()[i] for i in ref_order[np.argsort(order)]]


def test_a_wrong_run_is_one_line_and_exit_2(smoke_run, scored, tmp_path, capsys):
    cases = [
        (["--run", str(tmp_path / "nope")], "not the output of a finished run"),
        (["--run", smoke_run, "--model-name", "resnet18"], "holds model 'demo_cnn', not 'resnet18'"),
        (["--run", smoke_run, "--method", "kfac"], "has no method 'kfac'"),
    ]
    for args, needle in cases:
        code, out, err = _score(capsys, *args, "--data", "run:test", "--output", str(tmp_path / "o"))
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (args, err)
        assert not (tmp_path / "o").exists()  # refused before any work
    code, out, err = _score(capsys, "--run", smoke_run, "--data", "run:test", "--output", scored,
                            "--method", "diag")  # the output holds the inf scores
    assert code == 2 and "already holds a scoring with other settings" in err and len(err.strip().splitlines()) == 1


def test_readme_load_run_example_runs(smoke_run, tmp_path, monkeypatch):
    """README's ``load_run`` block, verbatim, with ``runs/smoke`` the fixture's run."""
    from PIL import Image

    block = next(b for lang, b in re.findall(r"^```([\w-]*)\n(.*?)^```", README.read_text(), flags=re.S | re.M)
                 if lang == "python" and "load_run" in b)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "smoke").symlink_to(smoke_run)
    monkeypatch.chdir(tmp_path)
    root = Path(smoke_run, "demo-data", "digits", "test")
    paths = sorted(str(p) for p in root.rglob("*.jpg"))[:3]
    ns = {"paths": paths}
    exec(compile(block, "README.md:load_run", "exec"), ns)
    out = ns["out"]
    assert out["probs"].shape == (3, 10) and np.allclose(out["probs"].sum(1), 1, atol=1e-5)
    assert (out["mutual_information"] >= 0).all() and out["pred"].shape == (3,)
    assert isinstance(Image.open(paths[0]), Image.Image)


def test_scoring_defaults_to_the_predictive_the_search_chose(smoke_run, tmp_path, capsys):
    """A run whose search chose the linearised predictive for a method (``search.pred_types``)
    is scored and served with it unless ``--pred-type`` says otherwise; a method the search did
    not choose one for keeps ``evaluate.pred_type``. (A copy of the session's run with the search
    marker's choice for ``diag`` set to ``glm``: the plumbing from the marker to the predictor.)"""
    import json
    import shutil

    from laplace_core.predictive.monte_carlo import MCPredictor
    from pipelines.serve.run_loader import LoadedRun, read_run

    run = tmp_path / "run"
    shutil.copytree(smoke_run, run, ignore=shutil.ignore_patterns("shift", "scores*"))
    marker = run / "stages" / "search.json"
    doc = json.loads(marker.read_text())
    doc["summary"]["chosen"]["diag"]["pred_type"] = "glm"
    marker.write_text(json.dumps(doc))
    info = read_run(RunStore.open(str(run)))
    assert info.pred_type_of("diag") == "glm" and info.pred_type_of("inf") == info.config.evaluate.pred_type == "nn"
    loaded = LoadedRun(info)
    assert "GLM" in type(loaded.predictor("diag")).__name__
    assert isinstance(loaded.predictor("inf"), MCPredictor)
    assert isinstance(loaded.predictor("diag", pred_type="nn"), MCPredictor)
    out = tmp_path / "scores"
    code, _, err = _score(capsys, "--run", str(run), "--data", "run:test", "--output", str(out), "--method", "diag")
    assert code == 0, err
    manifest = json.loads((out / "_score.json").read_text())
    assert manifest["method"] == "diag" and manifest["pred_type"] == "glm", manifest
