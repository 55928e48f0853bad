"""Cost per image of the linearised predictive (``glm``: MC-GLM, one Jacobian-vector product per
sample) against weight sampling (``nn``: one forward per sample), CPU, float32 (issue #38).

    /work/wt/heavy python benchmarks/glm_cost.py [--threads 1] [--repeats 3]

Models: the demo's ``demo_cnn`` (10 classes, 3x32x32 inputs, batch 128, K = 10) and torchvision's
``resnet18`` (1000 classes, 3x224x224, batch 8, K = 3), random weights (the cost depends on
the shapes only). Diag and KFAC posteriors from an MC-Fisher pass over two batches of random
inputs (``laplace_core``), τ = 1, N = 1000. Timed (median of ``--repeats``, after a warm-up):
``predict_batches`` of :func:`pipelines.evaluation.predictors.make_predictor` for ``nn`` and
``glm`` with the sample cache off, and the plain MAP forward. Printed per (model, method): ms per
image-sample of each predictive, their ratio, and each over the MAP forward.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import torch  # noqa: E402

#: model -> (input shape, classes, batch, K)
MODELS = {"demo_cnn": ((3, 32, 32), 10, 128, 10), "resnet18": ((3, 224, 224), 1000, 8, 3)}
METHODS = ("diag", "kfac")


def _model(name: str, classes: int) -> torch.nn.Module:
    from pipelines.ingest.models import load_model

    torch.manual_seed(0)
    return load_model(name, None, classes).eval()


def _posteriors(model, shape, classes, batch):
    import laplace_core as lc
    from laplace_core.posteriors.build import build_posterior

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(batch, *shape, generator=g), torch.randint(0, classes, (batch,), generator=g))
               for _ in range(2)]
    stats = lc.collect_statistics(model, batches, fisher="mc", generator=torch.Generator().manual_seed(1))
    return {m: build_posterior(stats, m, n_data=1000.0, prior_precision=1.0, dtype=torch.float32) for m in METHODS}


def _median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(name: str, repeats: int) -> list[str]:
    from pipelines.evaluation.predictors import make_predictor

    shape, classes, batch, k = MODELS[name]
    model = _model(name, classes)
    posts = _posteriors(model, shape, classes, batch)
    x = [torch.randn(batch, *shape, generator=torch.Generator().manual_seed(2))]
    with torch.no_grad():
        t_map = _median_s(lambda: model(x[0]), repeats) / batch
    out = [f"{name}: batch {batch}, K = {k}, MAP forward {t_map * 1e3:.3f} ms/image"]
    for m, post in posts.items():
        per = {}
        for pt in ("nn", "glm"):
            pred = make_predictor(model, post, pt, k, 0, 0)
            per[pt] = _median_s(lambda: pred.predict_batches(x), repeats) / (batch * k)
        out.append(f"  {m}: nn {per['nn'] * 1e3:.3f} ms/image-sample ({per['nn'] / t_map:.2f}x MAP), "
                   f"glm {per['glm'] * 1e3:.3f} ms/image-sample ({per['glm'] / t_map:.2f}x MAP), "
                   f"glm/nn = {per['glm'] / per['nn']:.2f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s), load average {os.getloadavg()[0]:.2f}", flush=True)
    for name in a.models:
        for line in run(name, a.repeats):
            print(line, flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
