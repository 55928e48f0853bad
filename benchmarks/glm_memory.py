"""Peak memory of the MC-GLM predictive on resnet18 at the search's shapes, with and without the JVP
byte budget (``laplace_core.predictive.jvp_budget``), CPU, float32.

    python benchmarks/glm_memory.py [--batch 64] [--samples 10] [--budgets-mib 2048 0]

Each case runs in a fresh process: torchvision's resnet18 (4 classes, random weights, seeded), a
diag posterior from an MC-Fisher pass over two random batches (N = 1e5, τ = 1e7), one
``GLMPredictor.predict`` on ``[batch, 3, 224, 224]`` with ``samples`` directions. Printed: the
process's RSS before the predict and its peak during it (``VmRSS``, then ``VmHWM`` after resetting it
through ``/proc/self/clear_refs``), the seconds and ms per
example-direction, and the largest difference of the probabilities from the first case (a budget
of 0 means none: ``jvp_bytes`` = 1 TiB).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)


def _status_gib(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(key + ":")) / 2**20


def child(batch: int, samples: int, budget_mib: int, out: str) -> None:
    import torch
    import laplace_core as lc
    from laplace_core.posteriors.build import build_posterior
    from laplace_core.predictive.glm import GLMPredictor
    from pipelines.ingest.models import load_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = load_model("resnet18", None, 4).eval()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 224, 224, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(2)]
    stats = lc.collect_statistics(model, batches, fisher="mc", generator=torch.Generator().manual_seed(1))
    post = build_posterior(stats, "diag", n_data=1e5, prior_precision=1e7, dtype=torch.float32)
    del stats
    x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    pred = GLMPredictor(model, post, samples, 0, jvp_bytes=(budget_mib << 20) if budget_mib else 1 << 40)
    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) starts again from the present RSS
        f.write("5")
    before = _status_gib("VmRSS")
    t0 = time.perf_counter()
    p = pred.predict(x)
    dt = time.perf_counter() - t0
    after = _status_gib("VmHWM")
    torch.save(p, out)
    print(json.dumps({"before_gib": before, "after_gib": after, "seconds": dt}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--budgets-mib", type=int, nargs="+", default=[2048, 0])
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="/tmp/glm_memory_probs", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        return child(a.batch, a.samples, a.child, a.out)
    import torch

    print(f"resnet18 at 224 px, batch {a.batch}, K = {a.samples}, 1 thread; load average {os.getloadavg()[0]:.2f}")
    first = None
    for budget in a.budgets_mib:
        out = f"{a.out}_{budget}.pt"
        res = subprocess.run([sys.executable, __file__, "--batch", str(a.batch), "--samples", str(a.samples),
                              "--child", str(budget), "--out", out], capture_output=True, text=True)
        if res.returncode != 0:
            print(f"  budget {budget or 'none'} MiB: exit {res.returncode} {res.stderr.strip()[-300:]}")
            continue
        r = json.loads(res.stdout.strip().splitlines()[-1])
        probs = torch.load(out, weights_only=True)
        first = probs if first is None else first
        print(f"  budget {budget or 'none'} MiB: peak RSS {r['before_gib']:.2f} -> {r['after_gib']:.2f} GiB "
              f"(+{r['after_gib'] - r['before_gib']:.2f}), {r['seconds']:.1f} s, "
              f"{r['seconds'] / (a.batch * a.samples) * 1e3:.0f} ms per example-direction, "
              f"max |p - p_first| {float((probs - first).abs().max()):.1e}", flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
