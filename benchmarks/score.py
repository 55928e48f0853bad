"""Throughput of ``infoform score`` against plain Ray Data batch inference of the same model.

    ratio(case) = wall time of the scoring pipeline (pipelines.serve.score.score_index: decode ->
                  map_batches on an actor pool holding model + posterior -> Parquet blocks)
                / wall time of plain batch inference (the same decode, the same actor pool size and
                  CPU shares, actors holding only the model: softmax, argmax), run right before it

on the same images in one Ray instance, interleaved, medians over ``--repeats``. Cases: the GLM
predictive on a last-layer posterior (closed-form logit covariance), and weight sampling (``nn``)
with K = 10 and K = 30 on a posterior over all layers. Two smoke runs are built first (or reused
from ``--workdir``): ``posterior.layers=last`` with ``evaluate.pred_type=glm``, and the default.

    python benchmarks/score.py                        # demo CNN, the demo's 1,797 digits (32x32)
    python benchmarks/score.py --repeats 3 --num-actors 2
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)
os.environ["PYTHONPATH"] = os.pathsep.join([_REPO, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

RUNS = {"glm-last": ["posterior.layers=last", "posterior.methods=[inf]", "evaluate.pred_type=glm"],
        "all": ["posterior.methods=[inf]"]}
CASES = (("glm last layer", "glm-last", "glm", None), ("nn K=10", "all", "nn", 10), ("nn K=30", "all", "nn", 30))


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class PlainActor:
    """Plain batch inference: the run's model only, softmax and argmax per batch."""

    def __init__(self, model_ref, cfg):
        import torch

        from pipelines.evaluation.predictors import load_eval_model

        torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.model = load_eval_model(model_ref, dtype=cfg.torch_dtype, device=cfg.resolved_device)

    def __call__(self, batch):
        import numpy as np
        import torch

        with torch.no_grad():
            x = torch.from_numpy(np.ascontiguousarray(batch["image"])).to(self.cfg.torch_dtype)
            p = torch.softmax(self.model(x), dim=-1)
        return {"path": batch["path"], "pred": p.argmax(1).numpy(), "max_prob": p.max(1).values.numpy()}


def make_run(workdir: Path, name: str) -> str:
    from pipelines.cli.run import run
    from pipelines.config.load import load_config

    out = workdir / name
    if not (out / "run.json").exists():
        _log(f"building the {name} smoke run in {out}")
        run(load_config("smoke", [f"output={out}", *RUNS[name]]))
    return str(out)


def plain(info, index, dcfg, n_act: int, batch_size: int) -> float:
    import ray.data

    from pipelines.ingest.batches import build_dataset

    cfg = info.eval_config(num_actors=n_act, gpus_per_actor=0.0)
    t = time.perf_counter()
    ds = build_dataset(index, dcfg).map_batches(
        PlainActor, fn_constructor_args=(info.model, cfg), batch_size=batch_size, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=n_act), num_cpus=cfg.cpus_per_actor)
    n = sum(len(b["pred"]) for b in ds.iter_batches(batch_size=None, batch_format="numpy"))
    assert n == len(index), (n, len(index))
    return time.perf_counter() - t


def scored(info, index, dcfg, settings, out: str) -> float:
    from pipelines.serve.score import score_index

    t = time.perf_counter()
    res = score_index(info, index, dcfg, out, settings, 1.0, log=lambda m: None)
    assert res["computed"] == res["blocks"]
    return time.perf_counter() - t


def compute_ratios(runs, index, data: str, batch_size: int, repeats: int) -> list[dict]:
    """The actors' own work per batch, in this process, one thread: ``predict_columns`` (the
    score actor's call) against softmax of one forward pass (the plain actor's), interleaved on
    the same decoded batch, medians over ``repeats``."""
    import torch

    from pipelines.ingest.batches import iter_local_batches
    from pipelines.serve.run_loader import LoadedRun
    from pipelines.serve.uncertainty import predict_columns

    torch.set_num_threads(1)
    out = []
    for label, run_name, pred_type, k in CASES:
        run = LoadedRun(runs[run_name])
        x = torch.from_numpy(next(iter_local_batches(index, run.data_config, batch_size=batch_size))["image"])
        pred = run.predictor("inf", pred_type, k)
        predict_columns(run.model, pred, x)  # warm: sample cache, closed-form factors
        tp, ts = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            with torch.no_grad():
                torch.softmax(run.model(x), dim=-1).argmax(1)
            tp.append(time.perf_counter() - t)
            t = time.perf_counter()
            predict_columns(run.model, pred, x)
            ts.append(time.perf_counter() - t)
        out.append({"case": label, "K": k or run.ev.mc_samples, "plain_ms": 1e3 * statistics.median(tp),
                    "score_ms": 1e3 * statistics.median(ts), "ratio": statistics.median(s / p for s, p in zip(ts, tp))})
        _log(f"compute, {label}: {out[-1]}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=None, help="where the two smoke runs are built / found")
    ap.add_argument("--data", default=None, help="images to score (default: the demo's digits, every split)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-actors", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=100)
    ap.add_argument("--cpus", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--compute-only", action="store_true", help="only the in-process per-batch compute ratios")
    ap.add_argument("--cases", nargs="+", default=[c[0] for c in CASES], choices=[c[0] for c in CASES],
                    metavar="CASE", help="which cases (default all): " + ", ".join(repr(c[0]) for c in CASES))
    a = ap.parse_args(argv)

    import ray

    from pipelines.serve.run_loader import read_run
    from pipelines.storage.store import RunStore
    from pipelines.serve.score import ScoreSettings
    from pipelines.ingest.scan import scan

    work = Path(a.workdir or tempfile.mkdtemp(prefix="infoform-score-bench-"))
    ray_tmp = tempfile.mkdtemp(prefix="rsb", dir="/tmp")
    ray.init(num_cpus=a.cpus or os.cpu_count(), include_dashboard=False, _temp_dir=ray_tmp,
             logging_level=logging.WARNING)
    ray.data.DataContext.get_current().enable_progress_bars = False
    load = [os.getloadavg()]
    runs = {name: read_run(RunStore.open(make_run(work, name))) for name in RUNS}
    data = a.data or str(Path(runs["all"].uri) / "demo-data" / "digits")
    index = scan(runs["all"].data_config(data))
    _log(f"{len(index)} images from {data}")
    compute = compute_ratios(runs, index, data, a.batch_size, 5)
    rows = []
    for rep in range(0 if a.compute_only else a.repeats):
        for label, run_name, pred_type, k in (c for c in CASES if c[0] in a.cases):
            info = runs[run_name]
            dcfg = info.data_config(data)
            s = ScoreSettings(method="inf", pred_type=pred_type, n_samples=k or info.config.evaluate.mc_samples,
                              seed=0, block_size=1024, pool_size=a.num_actors, map_batch_size=a.batch_size)
            t_plain = plain(info, index, dcfg, a.num_actors, a.batch_size)
            t_score = scored(info, index, dcfg, s, tempfile.mkdtemp(prefix="scores-", dir=work))
            rows.append({"case": label, "repeat": rep, "K": s.n_samples, "images": len(index),
                         "plain_s": t_plain, "score_s": t_score, "ratio": t_score / t_plain})
            _log(f"{label} (repeat {rep}): plain {len(index) / t_plain:.1f} img/s, score "
                 f"{len(index) / t_score:.1f} img/s, ratio {t_score / t_plain:.2f}")
    load.append(os.getloadavg())
    ray.shutdown()
    print(f"{len(index)} images, {a.num_actors} actors, load average {load[0][0]:.1f} -> {load[-1][0]:.1f}\n")
    print("| case | K | plain images/s | score images/s | ratio (median) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, *_ in (c for c in CASES if c[0] in a.cases and rows):
        r = [x for x in rows if x["case"] == label]
        print(f"| {label} | {r[0]['K']} | {len(index) / statistics.median(x['plain_s'] for x in r):.1f} | "
              f"{len(index) / statistics.median(x['score_s'] for x in r):.1f} | "
              f"{statistics.median(x['ratio'] for x in r):.2f} |")
    print(f"\nper batch of {a.batch_size}, in this process, one thread (medians of 5):\n")
    print("| case | K | plain forward ms | score columns ms | ratio |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for c in compute:
        print(f"| {c['case']} | {c['K']} | {c['plain_ms']:.1f} | {c['score_ms']:.1f} | {c['ratio']:.2f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "compute": compute, "load": load}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
