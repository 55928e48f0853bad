"""kronfluence's EKFAC passes against this project's pass 1, eigenbasis and EFB pass (CPU, one process).

    python benchmarks/peers_kronfluence.py [--size 64] [--batch 32] [--batches 8] [--reps 3]
                                           [--threads 1] [--out kronfluence.json]

Same torchvision resnet18 (random init, eval mode), same random data (``batches x batch``
images at ``size x size``, 10 classes), empirical Fisher (true labels) on both sides, all
Linear/Conv2d layers:

* ``factors``: kronfluence ``fit_covariance_matrices`` (A, G) against
  :func:`~laplace_core.curvature.collect.collect_statistics` (A, G and the exact Fisher diagonal);
* ``eigen``: kronfluence ``perform_eigendecomposition`` (float64) against
  :func:`~laplace_core.basis.eigenbasis.eigenbasis` (float64);
* ``lambda``: kronfluence ``fit_lambda_matrices`` (eigenvalue correction) against
  :func:`~laplace_core.curvature.collect.collect_efb`.

Repetitions interleave the two sides step by step; medians are reported with the load
average. The numerical check compares, per layer, the factors after normalising each to unit
Frobenius norm (kronfluence averages ``A`` over rows, i.e. examples x positions, and ``G`` over
examples and positions; ours sums ``A`` over examples and averages over positions, and sums
``G``): the largest ``|| X/||X|| - Y/||Y|| ||_F`` over layers for ``A``, ``G`` and lambda/EFB.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
import torchvision

from laplace_core.curvature.collect import collect_efb, collect_statistics
from laplace_core.basis.eigenbasis import eigenbasis


def kronfluence_task():
    from kronfluence.task import Task

    class Classification(Task):
        def compute_train_loss(self, batch, model, sample=False):
            x, y = batch
            logits = model(x)
            if sample:
                with torch.no_grad():
                    y = torch.multinomial(torch.softmax(logits.detach(), 1), 1).flatten()
            return F.cross_entropy(logits, y, reduction="sum")

        def compute_measurement(self, batch, model):
            return self.compute_train_loss(batch, model)

    return Classification()


class Kronfluence:
    """kronfluence 1.0.1 on CPU: one Analyzer; each fit overwrites its factors."""

    def __init__(self, model, x, y, batch: int, out_dir: str):
        from kronfluence.analyzer import Analyzer, prepare_model
        from kronfluence.arguments import FactorArguments
        from kronfluence.utils.dataset import DataLoaderKwargs

        task = kronfluence_task()
        self.model = prepare_model(model, task)
        self.analyzer = Analyzer("bench", self.model, task, cpu=True, disable_tqdm=True, output_dir=out_dir)
        self.data = torch.utils.data.TensorDataset(x, y)
        self.args = FactorArguments(strategy="ekfac", use_empirical_fisher=True)
        self.kw = dict(per_device_batch_size=batch, dataloader_kwargs=DataLoaderKwargs(num_workers=0),
                       factor_args=self.args, overwrite_output_dir=True)

    def factors(self):
        self.analyzer.fit_covariance_matrices("f", self.data, **self.kw)

    def eigen(self):
        self.analyzer.perform_eigendecomposition("f", factor_args=self.args, overwrite_output_dir=True)

    def lam(self):
        self.analyzer.fit_lambda_matrices("f", self.data, **self.kw)

    def results(self):
        cov = self.analyzer.load_covariance_matrices("f")
        lam = self.analyzer.load_lambda_matrices("f")
        return cov["activation_covariance"], cov["gradient_covariance"], lam["lambda_matrix"]


class Ours:
    def __init__(self, model, x, y, batch: int):
        self.model = model
        self.batches = [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x), batch)]
        self.stats = self.basis = self.efb = None

    def factors(self):
        self.stats = collect_statistics(self.model, self.batches, fisher="empirical")

    def eigen(self):
        self.basis = eigenbasis(self.stats)

    def lam(self):
        self.efb, _ = collect_efb(self.model, self.batches, self.basis, fisher="empirical")


def _unit(t: torch.Tensor) -> torch.Tensor:
    t = t.to(torch.float64)
    return t / t.norm()


def _agreement(ours: Ours, kron: Kronfluence) -> dict[str, float]:
    A_k, G_k, lam_k = kron.results()
    worst = {"A": 0.0, "G": 0.0, "lambda": 0.0}
    matched = 0
    for name, ls in ours.stats.layers.items():
        if name not in A_k:
            continue
        matched += 1
        worst["A"] = max(worst["A"], float((_unit(ls.A) - _unit(A_k[name])).norm()))
        worst["G"] = max(worst["G"], float((_unit(ls.G) - _unit(G_k[name])).norm()))
        lam = lam_k[name].reshape(ours.efb[name].shape)
        worst["lambda"] = max(worst["lambda"], float((_unit(ours.efb[name]) - _unit(lam)).norm()))
    return {**worst, "layers_compared": matched, "layers": len(ours.stats.layers)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    M = a.batch * a.batches
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, 3, a.size, a.size, generator=gen)
    y = torch.randint(0, 10, (M,), generator=gen)
    ours = Ours(torchvision.models.resnet18(num_classes=10).eval(), x, y, a.batch)
    peer_model = torchvision.models.resnet18(num_classes=10).eval()
    peer_model.load_state_dict(ours.model.state_dict())
    times: dict[str, list[float]] = {f"{side}_{step}": [] for side in ("ours", "kron") for step in ("factors", "eigen", "lambda")}
    with tempfile.TemporaryDirectory() as tmp:
        kron = Kronfluence(peer_model, x, y, a.batch, tmp)
        for _ in range(a.reps):
            for step, o, k in (("factors", ours.factors, kron.factors), ("eigen", ours.eigen, kron.eigen),
                               ("lambda", ours.lam, kron.lam)):
                for side, fn in (("ours", o), ("kron", k)):
                    t0 = time.perf_counter()
                    fn()
                    times[f"{side}_{step}"].append(time.perf_counter() - t0)
        check = _agreement(ours, kron)
    med = {k: statistics.median(v) for k, v in times.items()}
    total = {s: sum(med[f"{s}_{st}"] for st in ("factors", "eigen", "lambda")) for s in ("ours", "kron")}
    res = {
        "args": vars(a), "torch": torch.__version__, "load_avg": os.getloadavg(), "times_s": times, "median_s": med,
        "per_batch_s": {k: med[k] / a.batches for k in med if not k.endswith("eigen")},
        "ratio": {st: med[f"ours_{st}"] / med[f"kron_{st}"] for st in ("factors", "eigen", "lambda")},
        "total_s": total, "total_ratio": total["ours"] / total["kron"], "agreement": check,
    }
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
