"""The core end to end on the offline demo data, in one process and without Ray.

Steps: write the digits ImageFolder and the letters A-J OOD set under ``--workdir``
(:mod:`pipelines.ingest.demo_data`); train (or load from cache) the small CNN; collect the curvature
statistics on the digits train split (pass 1: KFAC factors + exact Fisher diagonal), the
eigenbasis, and the EFB eigenvalues (pass 2, per-example gradients in that basis); build every
posterior (diag, kfac, kfac_exact, efb, inf at ``--rank``); draw samples; evaluate the MC
predictive on the digits test split (in distribution) and on the letters (out of
distribution); print a table of numbers stored, MB, timings and metrics.

Usage (from the repository root, after ``pip install -e '.[dev]'``)::

    python jobs/core_demo.py [--workdir runs/demo-data] [--rank 100] [--mc-samples 10]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

try:
    import laplace_core  # noqa: F401
except ImportError:  # running from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

METHODS = ("diag", "kfac", "kfac_exact", "efb", "inf")


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="infoform core demo (no Ray)", add_help=add_help)
    parser.add_argument("--workdir", default="runs/demo-data", help="where data, model cache and results go")
    parser.add_argument("--size", default=32, type=int, help="image side in pixels")
    parser.add_argument("--epochs", default=10, type=int, help="CNN training epochs (cached afterwards)")
    parser.add_argument("--seed", default=0, type=int, help="seed for data split, training, labels and samples")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated posterior methods")
    parser.add_argument("--rank", default=100, type=int, help="INF rank K per layer (top-K EFB eigenvalues)")
    parser.add_argument("--fisher", default="mc", choices=["mc", "empirical"], help="label source for the Fisher")
    parser.add_argument("--fisher-samples", default=1, type=int, help="sampled labels per example (fisher=mc)")
    parser.add_argument("--batch-size", default=64, type=int, help="batch size for the statistics passes")
    parser.add_argument("--max-examples", default=None, type=int, help="use only the first N training images")
    parser.add_argument("--n-data", default=None, type=float, help="N in P = N F/M + tau I (default: M)")
    parser.add_argument("--prior-precision", default=300.0, type=float,
                        help="tau in P = N F/M + tau I (300 suits the demo CNN; tau = 1 collapses its MC predictive)")
    parser.add_argument("--samples", default=3, type=int, help="posterior samples drawn for the timing column")
    parser.add_argument("--mc-samples", default=10, type=int, help="weight samples for the MC predictive (0: skip)")
    parser.add_argument("--letters-per-class", default=50, type=int, help="OOD images per letter")
    parser.add_argument("--threads", default=None, type=int, help="torch intra-op threads")
    parser.add_argument("--json", default=None, help="also write the results table as JSON here")
    return parser


def _batches(x: torch.Tensor, y: torch.Tensor, batch_size: int):
    for i in range(0, len(x), batch_size):
        yield x[i : i + batch_size], y[i : i + batch_size]


def _metrics(probs: torch.Tensor, y: torch.Tensor | None) -> dict[str, float]:
    p = probs.double().clamp_min(1e-12)
    ent = -(p * p.log()).sum(1) / torch.log(torch.tensor(float(p.shape[1]), dtype=torch.float64))
    out = {"entropy": float(ent.mean())}
    if y is not None:
        out["acc"] = float((p.argmax(1) == y).double().mean())
        out["nll"] = float(-p[torch.arange(len(y)), y].log().mean())
    return out


def _auroc(in_scores: torch.Tensor, out_scores: torch.Tensor) -> float:
    """P(score_out > score_in) + 0.5 P(tie): OOD detection by predictive entropy."""
    a = in_scores.double().view(-1, 1)
    b = out_scores.double().view(1, -1)
    return float(((b > a).double() + 0.5 * (b == a).double()).mean())


def _entropy(probs: torch.Tensor) -> torch.Tensor:
    p = probs.double().clamp_min(1e-12)
    return -(p * p.log()).sum(1)


def main(args: argparse.Namespace) -> list[dict]:
    import laplace_core as lc
    from laplace_core.posteriors import sizes
    from laplace_core.curvature.collect import collect_efb
    from laplace_core.predictive.monte_carlo import map_predict, mc_predict
    from pipelines.ingest import demo_data as dd

    if args.threads:
        torch.set_num_threads(args.threads)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    work = Path(args.workdir)
    t0 = time.perf_counter()
    dd.write_digits_imagefolder(work / "digits", size=args.size, seed=args.seed)
    dd.write_letters_ood(work / "letters", size=args.size, n_per_letter=args.letters_per_class, seed=args.seed)
    t_data = time.perf_counter() - t0

    model, info = dd.train_small_cnn(work / "digits", epochs=args.epochs, seed=args.seed, cache_path=work / "model")
    print(f"small CNN: val accuracy {info.val_accuracy:.3f} ({'cached' if info.cached else f'trained in {info.train_seconds:.1f} s'})")

    x_tr, y_tr, _ = dd.load_imagefolder(work / "digits", "train")
    if args.max_examples:
        x_tr, y_tr = x_tr[: args.max_examples], y_tr[: args.max_examples]
    x_te, y_te, _ = dd.load_imagefolder(work / "digits", "test")
    x_ood, _, _ = dd.load_imagefolder(work / "letters")

    timings: dict[str, float] = {"data": t_data}
    t = time.perf_counter()
    stats = lc.collect_statistics(
        model, _batches(x_tr, y_tr, args.batch_size), fisher=args.fisher, mc_samples=args.fisher_samples,
        generator=torch.Generator().manual_seed(args.seed), dtype=torch.float64,
    )
    timings["pass1 (A, G, diag)"] = time.perf_counter() - t
    t = time.perf_counter()
    basis = lc.eigenbasis(stats)
    timings["eigenbasis"] = time.perf_counter() - t
    t = time.perf_counter()
    efb, efb_count = collect_efb(
        model, _batches(x_tr, y_tr, args.batch_size), basis, fisher=args.fisher, mc_samples=args.fisher_samples,
        generator=torch.Generator().manual_seed(args.seed + 1), dtype=torch.float64,
    )
    stats = stats.with_efb(efb, efb_count)
    timings["pass2 (EFB)"] = time.perf_counter() - t
    print(f"statistics: M={stats.count}, {len(stats.layers)} layers, excluded: {sorted(stats.excluded)}; "
          + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()))

    predicted = sizes.statistics_sizes(stats, rank=args.rank).totals
    results = []
    if args.mc_samples > 0:
        with torch.no_grad():
            p_in, p_out = map_predict(model, x_te), map_predict(model, x_ood)
        results.append({"method": "map", "num_stored": 0, "predicted": 0, "build_s": 0.0, "sample_s": 0.0,
                        **_row_metrics(p_in, y_te, p_out)})
    for method in methods:
        t = time.perf_counter()
        post = lc.build_posterior(stats, method, rank=args.rank if method == "inf" else None, n_data=args.n_data,
                                  prior_precision=args.prior_precision, basis=basis)
        build_s = time.perf_counter() - t
        t = time.perf_counter()
        deltas = post.sample(args.samples, torch.Generator().manual_seed(args.seed))
        sample_s = (time.perf_counter() - t) / max(1, args.samples)
        assert set(deltas) == set(stats.layers)
        row = {"method": method, "num_stored": post.num_stored(), "predicted": predicted[method],
               "build_s": build_s, "sample_s": sample_s}
        if method == "inf":
            row["clipped_D"] = post.info.get("clipped_D")
        if args.mc_samples > 0:
            t = time.perf_counter()
            p_in = mc_predict(model, post, x_te, n_samples=args.mc_samples, seed=args.seed)
            p_out = mc_predict(model, post, x_ood, n_samples=args.mc_samples, seed=args.seed)
            row["eval_s"] = time.perf_counter() - t
            row.update(_row_metrics(p_in, y_te, p_out))
        results.append(row)

    _print_table(results, args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"timings": timings, "results": results}, indent=2))
    return results


def _row_metrics(p_in: torch.Tensor, y_in: torch.Tensor, p_out: torch.Tensor) -> dict[str, float]:
    m_in = _metrics(p_in, y_in)
    m_out = _metrics(p_out, None)
    return {"acc": m_in["acc"], "nll": m_in["nll"], "entropy_in": m_in["entropy"], "entropy_out": m_out["entropy"],
            "auroc": _auroc(_entropy(p_in), _entropy(p_out))}


def _print_table(results: list[dict], args: argparse.Namespace) -> None:
    head = (f"{'method':<11} {'numbers stored':>15} {'MB':>7} {'build s':>8} {'s/sample':>9} "
            f"{'acc':>6} {'nll':>7} {'H in':>6} {'H ood':>6} {'AUROC':>6}")
    print(head)
    print("-" * len(head))
    for r in results:
        mb = sizes_mb(r["num_stored"])
        met = (f"{r['acc']:>6.3f} {r['nll']:>7.3f} {r['entropy_in']:>6.3f} {r['entropy_out']:>6.3f} {r['auroc']:>6.3f}"
               if "acc" in r else "")
        print(f"{r['method']:<11} {r['num_stored']:>15,} {mb:>7.3f} {r['build_s']:>8.3f} {r['sample_s']:>9.4f} {met}")
        if r["predicted"] is not None and r["predicted"] != r["num_stored"]:
            print(f"  warning: laplace_core.posteriors.sizes predicted {r['predicted']:,} numbers for {r['method']}")
    print(f"N = {args.n_data or 'M'}, tau = {args.prior_precision}, INF rank K = {args.rank}; MB = 2^20 bytes at "
          f"4 bytes/number; H = normalised predictive entropy (digits test / letters A-J), AUROC = OOD detection "
          f"by entropy; MC predictive with {args.mc_samples} samples.")


def sizes_mb(n: int) -> float:
    from laplace_core.posteriors.sizes import to_mb

    return to_mb(n)


if __name__ == "__main__":
    main(get_args_parser().parse_args())
