"""Lee et al. (2020), Figure 4: predictive uncertainty on the toy regression.

    python benchmarks/paper/figure4.py

The paper's toy problem (100 points ``x ~ U(-4, 4)``, ``y ~ N(x³, 3²)``; one hidden layer
of 7 ReLU units, Adam on MSE). Curvature with the shipped
``collect_statistics(..., likelihood="regression")`` (empirical Fisher, unit noise), posteriors
with ``build_posterior`` at ``N = M / σ²`` (the noise ``σ = 3`` folded into ``N``) and a common
prior precision ``τ`` (``--tau``), sampled with ``Posterior.sample``. Panels: MAP, KFAC (Ritter
et al.'s ``kfac``), INF (full rank) and the reference: a full-covariance Laplace over all 22
weights, ``P = J^T J / σ² + τ I`` with ``J`` the exact Jacobian (generalised Gauss-Newton),
sampled exactly. Bands: predictive mean ± 1, 2, 3 std of ``f(x) + ε`` (``ε ~ N(0, σ²)``).

The paper's reference is HMC (NumPyro, 50,000 samples). No HMC sampler is installed in this
project's environment (NumPyro, Pyro, hamiltorch are absent), so the reference here is the
full-covariance Laplace; that is the posterior the block-diagonal methods approximate, not
the true posterior HMC targets. Writes ``figure4.png`` and ``figure4.json`` (per method: mean
predictive std inside and outside ``[-4, 4]`` and the mean relative distance of its std to the
reference's) to ``--out``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.paper.common import DEFAULT_OUT, machine, write  # noqa: E402
from benchmarks.paper.table1 import F64, mlp, toy_data, train  # noqa: E402
from laplace_core.curvature.collect import collect_statistics  # noqa: E402
from laplace_core.basis.eigenbasis import eigenbasis  # noqa: E402
from laplace_core.posteriors.build import build_posterior  # noqa: E402

SIGMA = 3.0


def _forward_with(model: nn.Module, deltas: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``(S, len(x))`` outputs with ``W~ + δ_s`` for each of the ``S`` draws."""
    from torch.func import functional_call

    params = dict(model.named_parameters())
    S = next(iter(deltas.values())).shape[0]
    outs = []
    for s in range(S):
        p = {k: v.detach() for k, v in params.items()}
        for name, d in deltas.items():
            p[f"{name}.weight"] = p[f"{name}.weight"] + d[s, :, :-1]
            p[f"{name}.bias"] = p[f"{name}.bias"] + d[s, :, -1]
        outs.append(functional_call(model, p, (x,))[:, 0])
    return torch.stack(outs)


def full_laplace_samples(model: nn.Module, x: torch.Tensor, xs: torch.Tensor, tau: float, S: int,
                         gen: torch.Generator) -> torch.Tensor:
    """``(S, len(xs))`` outputs under ``θ ~ N(θ_MAP, (J^T J / σ² + τ I)^{-1})`` over all weights."""
    from torch.func import functional_call, jacrev

    names = [k for k, _ in model.named_parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    shapes = [p.shape for p in model.parameters()]

    def unflat(t):
        out, i = {}, 0
        for k, sh in zip(names, shapes):
            n = sh.numel()
            out[k] = t[i:i + n].reshape(sh)
            i += n
        return out

    J = jacrev(lambda t: functional_call(model, unflat(t), (x,))[:, 0])(theta)  # (M, P)
    P = J.T @ J / SIGMA ** 2 + tau * torch.eye(len(theta), dtype=F64)
    L = torch.linalg.cholesky(P)
    z = torch.randn(S, len(theta), generator=gen, dtype=F64)
    draws = theta + torch.linalg.solve_triangular(L.T, z.T, upper=True).T  # cov = (L L^T)^{-1}
    with torch.no_grad():
        return torch.stack([functional_call(model, unflat(t), (xs,))[:, 0] for t in draws])


def run(seed: int = 0, tau: float = 0.2, samples: int = 500, steps: int = 3000) -> dict[str, Any]:
    x, y = toy_data(seed)
    model = mlp(1, 7, seed)
    mse = train(model, x, y, steps, 0.01)
    xs = torch.linspace(-6, 6, 241, dtype=F64)[:, None]
    batches = [(x, y)]
    stats = collect_statistics(model, batches, fisher="empirical", likelihood="regression", dtype=F64)
    basis = eigenbasis(stats)
    stats = collect_statistics(model, batches, fisher="empirical", likelihood="regression", dtype=F64, basis=basis)
    N = len(x) / SIGMA ** 2
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        f_map = model(xs)[:, 0]
    preds: dict[str, torch.Tensor] = {}
    for name in ("kfac", "inf"):
        post = build_posterior(stats, name, n_data=N, prior_precision=tau, basis=basis)
        with torch.no_grad():
            preds[name] = _forward_with(model, post.sample(samples, gen), xs)
    preds["full"] = full_laplace_samples(model, x, xs, tau, samples, gen)
    bands = {"map": (f_map, torch.full_like(f_map, SIGMA))}
    for k, f in preds.items():
        bands[k] = (f.mean(0), (f.var(0) + SIGMA ** 2).sqrt())
    inside = (xs[:, 0].abs() <= 4)
    ref = bands["full"][1]
    summary = {k: {"std_inside": float(s[inside].mean()), "std_outside": float(s[~inside].mean()),
                   "rel_dist_to_full": float(((s - ref).abs() / ref).mean())} for k, (_, s) in bands.items()}
    return {"seed": seed, "tau": tau, "N": N, "samples": samples, "train_mse": mse, "summary": summary,
            "x": x[:, 0].tolist(), "y": y[:, 0].tolist(), "grid": xs[:, 0].tolist(),
            "bands": {k: {"mean": m.tolist(), "std": s.tolist()} for k, (m, s) in bands.items()},
            "machine": machine()}


def figure(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"map": "MAP (noise only)", "kfac": "KFAC", "inf": "INF (full rank)",
              "full": "full-covariance Laplace (reference)"}
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6), sharey=True)
    g = torch.tensor(res["grid"])
    for ax, k in zip(axes, titles):
        m, s = torch.tensor(res["bands"][k]["mean"]), torch.tensor(res["bands"][k]["std"])
        for j in (3, 2, 1):
            ax.fill_between(g, m - j * s, m + j * s, color="tab:blue", alpha=0.15)
        ax.plot(g, torch.tensor(res["bands"]["map"]["mean"]), color="tab:red", lw=1, label="MAP")
        ax.plot(g, m, color="tab:blue", lw=1, label="mean")
        ax.plot(g, g ** 3, color="black", lw=0.8)
        ax.scatter(res["x"], res["y"], s=4, color="black")
        ax.set_ylim(-150, 150)
        ax.set_title(titles[k])
    axes[0].legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(res: dict[str, Any]) -> str:
    lines = ["| method | mean predictive std in [-4, 4] | outside | mean relative distance to the full Laplace's std |",
             "| --- | --- | --- | --- |"]
    for k, label in (("map", "MAP"), ("kfac", "KFAC"), ("inf", "INF"), ("full", "full Laplace")):
        s = res["summary"][k]
        lines.append(f"| {label} | {s['std_inside']:.2f} | {s['std_outside']:.2f} | {s['rel_dist_to_full']:.3f} |")
    lines.append(f"\nN = M/σ² = {res['N']:.2f}, τ = {res['tau']}, {res['samples']} draws; no HMC sampler is installed, "
                 "so the reference is the full-covariance Laplace.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Lee et al. (2020) Figure 4: toy predictive uncertainty")
    p.add_argument("--tau", type=float, default=0.2, help="prior precision for every method (paper's KFAC: 0.2)")
    p.add_argument("--samples", type=int, default=500, help="posterior draws per method")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder for figure4.png / figure4.json / figure4.md")
    args = p.parse_args(argv)
    res = run(tau=args.tau, samples=args.samples)
    out = Path(args.out)
    md = markdown(res)
    write(out, "figure4", res, md)
    figure(res, out / "figure4.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
