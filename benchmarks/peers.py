"""Our curvature fits and MC predictive against the established libraries (CPU, float32).

    python benchmarks/peers.py [--model resnet18] [--size 64] [--batch 32] [--batches 4]
                               [--reps 3] [--out peers.json]

Same torchvision model (random init, ``weights=None``, eval mode, BatchNorm parameters frozen
so that every library covers exactly the Linear/Conv2d weights and biases), same random data,
empirical Fisher (true labels) everywhere, ``batches x batch`` images at ``size x size``:

* ``inf_ours``: our full INF fit: :func:`~laplace_core.collect.collect_statistics` (pass 1: A, G,
  exact diagonal) + :func:`~laplace_core.eigenbasis.eigenbasis` +
  :func:`~laplace_core.collect.collect_efb` (pass 2: EFB eigenvalues).
* ``inf_peers``: the same outputs from the peers' separate passes: curvlinops
  ``KFACLinearOperator.compute_kronecker_factors`` (A, G) + ``EKFACLinearOperator.
  compute_eigenvalue_correction`` (its own factor pass, eigh, correction pass) + the exact
  empirical-Fisher diagonal (BackPACK ``SumGradSquared``, what laplace-torch's ``BackPackEF``
  diag uses; if BackPACK cannot extend the model, laplace-torch's ``CurvlinopsEF.diag``).
* ``kfac_ours``: fit = ``collect_statistics`` + ``build_posterior(stats, "kfac")``, then (same
  process, timed separately) predict = ``MCPredictor(model, post, 30).predict(x)`` on one batch.
* ``kfac_laplace``: fit = ``laplace.Laplace(..., hessian_structure="kron",
  backend=CurvlinopsEF).fit``, then predict = ``la(x, pred_type="nn", link_approx="mc",
  n_samples=30)`` on the same batch.

Each (task, repetition) runs in its own subprocess, so peak RSS (``ru_maxrss`` of that process,
whole process including the untimed setup) does not mix between tasks; repetitions are
interleaved across tasks (the machine is shared and noisy) and medians are reported. Prints a
Markdown table and writes JSON to ``--out``. Targets (issue 7): ``inf_ours / inf_peers <= 0.6``;
``predict(laplace) / predict(ours) >= 2``. The peak RSS of the two KFAC rows covers fit and predict.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics as pystats
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("inf_ours", "inf_peers", "kfac_ours", "kfac_laplace")
N_PRED = 30


# ------------------------------------------------------------------ one task in a subprocess
def _setup(a):
    import torch
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, a.model)(weights=None, num_classes=10).eval()
    for mod in model.modules():  # BatchNorm stays a point estimate in every library
        if not isinstance(mod, (torch.nn.Linear, torch.nn.Conv2d)):
            for p in mod.parameters(recurse=False):
                p.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(a.batch, 3, a.size, a.size, generator=g),
                torch.randint(0, 10, (a.batch,), generator=g)) for _ in range(a.batches)]
    return model, batches


def _peer_diag(model, batches):
    """Exact empirical-Fisher diagonal Σ_k d_k² over all batches, by a peer library."""
    import torch
    try:
        from backpack import backpack, extend
        from backpack.extensions import SumGradSquared
        lossf = extend(torch.nn.CrossEntropyLoss(reduction="sum"))
        emodel = extend(model, use_converter=True)
        params = [p for p in emodel.parameters() if p.requires_grad]
        total = [torch.zeros_like(p) for p in params]
        for x, y in batches:
            loss = lossf(emodel(x), y)
            with backpack(SumGradSquared()):
                loss.backward()
            for t, p in zip(total, params):
                t += p.sum_grad_squared
                p.grad = None
        return "backpack.SumGradSquared", total
    except Exception as e:  # noqa: BLE001 - fall back to laplace-torch's EF diagonal
        from laplace.curvature import CurvlinopsEF
        be = CurvlinopsEF(model, "classification")
        total = None
        for x, y in batches:
            _, d = be.diag(x, y)
            total = d if total is None else total + d
        return f"laplace.CurvlinopsEF.diag (backpack failed: {type(e).__name__})", [total]


def _task(a) -> dict:
    import torch
    warnings.filterwarnings("ignore")
    model, batches = _setup(a)
    out = {"task": a.task, "threads": torch.get_num_threads()}
    t0 = time.perf_counter()
    if a.task == "inf_ours":
        from laplace_core.collect import collect_efb, collect_statistics
        from laplace_core.eigenbasis import eigenbasis
        stats = collect_statistics(model, batches, fisher="empirical")
        t1 = time.perf_counter()
        basis = eigenbasis(stats)
        t2 = time.perf_counter()
        efb, cnt = collect_efb(model, batches, basis, fisher="empirical")
        stats = stats.with_efb(efb, cnt)
        out["parts_s"] = {"pass1": t1 - t0, "eigenbasis": t2 - t1, "efb_pass": time.perf_counter() - t2}
    elif a.task == "inf_peers":
        from curvlinops import EKFACLinearOperator, KFACLinearOperator
        params = [p for p in model.parameters() if p.requires_grad]
        kw = dict(fisher_type="empirical", kfac_approx="expand", separate_weight_and_bias=False,
                  check_deterministic=False, num_data=a.batch * a.batches)
        loss = torch.nn.CrossEntropyLoss(reduction="sum")
        KFACLinearOperator(model, loss, params, batches, **kw).compute_kronecker_factors()
        t1 = time.perf_counter()
        EKFACLinearOperator(model, loss, params, batches, **kw).compute_eigenvalue_correction()
        t2 = time.perf_counter()
        out["diag_source"], _ = _peer_diag(model, batches)
        out["parts_s"] = {"kfac": t1 - t0, "ekfac": t2 - t1, "diag": time.perf_counter() - t2}
    elif a.task == "kfac_ours":
        from laplace_core.collect import collect_statistics
        from laplace_core.posterior import build_posterior
        from laplace_core.predictive import MCPredictor
        stats = collect_statistics(model, batches, fisher="empirical")
        out["parts_s"] = {"pass1": time.perf_counter() - t0}
        post = build_posterior(stats, "kfac", dtype=torch.float32)
        out["fit_s"] = time.perf_counter() - t0
        x = batches[0][0]
        t1 = time.perf_counter()
        p = MCPredictor(model, post, n_samples=N_PRED, seed=0).predict(x)
        out["pred_s"] = time.perf_counter() - t1
        assert torch.isfinite(p).all() and p.shape == (x.shape[0], 10)
    elif a.task == "kfac_laplace":
        from laplace import Laplace
        from laplace.curvature import CurvlinopsEF
        la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="kron",
                     backend=CurvlinopsEF)
        la.fit(batches_loader(batches))
        out["fit_s"] = time.perf_counter() - t0
        x = batches[0][0]
        t1 = time.perf_counter()
        with torch.no_grad():
            p = la(x, pred_type="nn", link_approx="mc", n_samples=N_PRED)
        out["pred_s"] = time.perf_counter() - t1
        assert torch.isfinite(p).all() and p.shape == (x.shape[0], 10)
    else:
        raise ValueError(f"unknown task {a.task!r}; valid: {', '.join(TASKS)}")
    out["seconds"] = time.perf_counter() - t0
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def batches_loader(batches):
    """A DataLoader over the fixed batches (laplace-torch reads ``len(loader.dataset)``)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    X = torch.cat([x for x, _ in batches])
    Y = torch.cat([y for _, y in batches])
    return DataLoader(TensorDataset(X, Y), batch_size=batches[0][0].shape[0], shuffle=False)


# ------------------------------------------------------------------ driver
def _run_child(a, task: str) -> dict:
    cmd = [sys.executable, __file__, "--child", task, "--model", a.model, "--size", str(a.size),
           "--batch", str(a.batch), "--batches", str(a.batches)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode != 0:
        return {"task": task, "error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"rc {r.returncode}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        a.task = a.child
        print(json.dumps(_task(a)))
        return 0
    tasks = [t for t in a.tasks.split(",") if t]
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise SystemExit(f"unknown tasks {bad}; valid: {', '.join(TASKS)}")
    runs: dict[str, list[dict]] = {t: [] for t in tasks}
    for rep in range(a.reps):  # interleaved: every task once per repetition
        for t in tasks:
            r = _run_child(a, t)
            runs[t].append(r)
            print(f"rep {rep} {t}: {r.get('seconds', r.get('error'))}", file=sys.stderr, flush=True)
    summary = {}
    for t, rs in runs.items():
        ok = [r for r in rs if "seconds" in r]
        rows = {t: "seconds"} if t.startswith("inf") else {f"{t}.fit": "fit_s", f"{t}.predict": "pred_s"}
        for row, key in rows.items():
            summary[row] = {
                "median_s": pystats.median(r[key] for r in ok) if ok else None,
                "peak_rss_mib": pystats.median(r["peak_rss_mib"] for r in ok) if ok else None,
                "n": len(ok), "errors": [r["error"] for r in rs if "error" in r],
                "extra": {k: v for k, v in (ok[-1] if ok else {}).items()
                          if k not in ("seconds", "peak_rss_mib", "task", "fit_s", "pred_s")},
            }

    def ratio(num, den):
        x, y = summary.get(num, {}).get("median_s"), summary.get(den, {}).get("median_s")
        return None if not x or not y else x / y

    ratios = {
        "inf_ours/inf_peers": ratio("inf_ours", "inf_peers"),
        "kfac fit ours/laplace": ratio("kfac_ours.fit", "kfac_laplace.fit"),
        "predict laplace/ours": ratio("kfac_laplace.predict", "kfac_ours.predict"),
    }
    r1, r2 = ratios["inf_ours/inf_peers"], ratios["predict laplace/ours"]
    targets = {
        "inf_ours/inf_peers <= 0.6": None if r1 is None else r1 <= 0.6,
        "predict laplace/ours >= 2": None if r2 is None else r2 >= 2,
    }
    cfg = {k: getattr(a, k) for k in ("model", "size", "batch", "batches", "reps")}
    print(f"\n{a.model} {a.size}x{a.size}, {a.batches} batches of {a.batch}, CPU float32, "
          f"empirical Fisher, medians of {a.reps} interleaved subprocess runs\n")
    print("| task | median s | peak RSS MiB | runs |")
    print("| --- | ---: | ---: | ---: |")
    for t, s in summary.items():
        ms = "error" if s["median_s"] is None else f"{s['median_s']:.2f}"
        rss = "" if s["peak_rss_mib"] is None else f"{s['peak_rss_mib']:.0f}"
        print(f"| {t} | {ms} | {rss} | {s['n']}/{a.reps} |")
    print()
    for k, v in ratios.items():
        print(f"- {k}: {'n/a' if v is None else f'{v:.2f}'}")
    for k, v in targets.items():
        print(f"- target {k}: {'n/a' if v is None else ('met' if v else 'NOT met')}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"config": cfg, "summary": summary, "runs": runs,
                                           "ratios": ratios, "targets": targets}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
