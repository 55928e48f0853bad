"""The ``infoform`` command line (also ``python -m pipelines``).

Subcommands live in the explicit registry :data:`SUBCOMMANDS` (name -> function that adds
its parser). Each parser sets ``func``; ``func(args) -> int`` is the exit code.

* ``infoform sizes --model NAME [--rank K] [--stats URI] [--norm-layers map|diag] [--json]``: numbers stored per
  posterior method for any torchvision classifier, built with ``weights=None`` on the
  ``meta`` device (no weights, no data, offline). See :mod:`laplace_core.sizes`.
* ``infoform run ...``: the Ray job, exactly ``jobs/imagenet_inf.py`` (:mod:`pipelines.cli.job`,
  same parser, same exit codes).

Usage errors (unknown model, bad flag values) print one line to stderr and exit 2.
"""
from __future__ import annotations

import argparse
import difflib
import json
import sys
import warnings
from typing import Callable

__all__ = ["CliError", "SUBCOMMANDS", "build_parser", "build_torchvision_model", "main"]

PROG = "infoform"


class CliError(Exception):
    """A usage error: reported as one line on stderr, exit code 2."""


# --------------------------------------------------------------------------- sizes
def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def torchvision_model_names() -> list[str]:
    """Classification architectures in ``torchvision.models`` (not detection/segmentation)."""
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def build_torchvision_model(name: str, *, num_classes: int | None = None):
    """``(model, device)``: ``torchvision.models.get_model(name, weights=None)`` on the meta
    device (no memory, no weights); falls back to CPU for the few architectures whose
    constructor reads tensor values (regnet). Unknown names raise :class:`CliError`."""
    import torch
    import torchvision

    names = torchvision_model_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise CliError(
            f"unknown model {name!r}; {hint}valid names include {', '.join(_examples(names))} "
            f"({len(names)} in torchvision.models.list_models(module=torchvision.models))"
        )
    kwargs = {} if num_classes is None else {"num_classes": num_classes}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. googlenet/inception init FutureWarnings
        try:
            with torch.device("meta"):
                return torchvision.models.get_model(name, weights=None, **kwargs), "meta"
        except NotImplementedError:
            return torchvision.models.get_model(name, weights=None, **kwargs), "cpu"


def _examples(names: list[str]) -> list[str]:
    preferred = ["resnet18", "resnet50", "densenet121", "vgg16", "efficientnet_b0", "vit_b_16"]
    return [n for n in preferred if n in names] or names[:6]


def add_sizes_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sizes",
        help="numbers stored per posterior method for a torchvision model (no data needed)",
        description=(
            "Count the numbers each Laplace posterior stores (Lee et al. 2020, Table 3 counting) "
            "for a torchvision architecture built without weights. INF at rank K depends on the "
            "EFB eigenvalues: give --stats for the exact count, otherwise a lower bound is shown."
        ),
    )
    p.add_argument("--model", help="torchvision architecture name, e.g. resnet18")
    p.add_argument("--num-classes", type=_positive_int, default=None, help="classifier outputs (default: the model's)")
    p.add_argument("--rank", type=_positive_int, default=None, help="INF rank K (top-K EFB eigenvalues per layer)")
    p.add_argument("--stats", default=None, metavar="URI", help="statistics with EFB sums (CurvatureStatistics.save)")
    p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint for an s3:// --stats")
    p.add_argument("--norm-layers", choices=("map", "diag"), default="map",
                   help="normalisation layers (BatchNorm/LayerNorm/GroupNorm, layer scales): at MAP (default, "
                        "Table 3) or under a diagonal posterior")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_sizes)


def cmd_sizes(args: argparse.Namespace) -> int:
    from laplace_core import sizes

    if args.model is None and args.stats is None:
        raise CliError("give --model NAME (and/or --stats URI)")
    if args.stats is not None and args.rank is None:
        raise CliError("--stats is only used for the INF count: give --rank K too")
    stats = None
    if args.stats is not None:
        from laplace_core.statistics import CurvatureStatistics

        from pipelines.storage import uris as storage

        try:
            stats = CurvatureStatistics.load(args.stats, storage.fsspec_options(args.stats, args.endpoint_url))
        except (OSError, ValueError) as e:
            raise CliError(f"cannot load statistics {args.stats!r}: {e}") from None
    try:
        if args.model is not None:
            model, _ = build_torchvision_model(args.model, num_classes=args.num_classes)
            report = sizes.model_sizes(model, rank=args.rank, stats=stats, name=args.model,
                                       norm_layers=args.norm_layers)
        else:
            report = sizes.statistics_sizes(stats, rank=args.rank, model=None)
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(sizes.format_table(report))
    return 0


# --------------------------------------------------------------------------- registry
# name -> function adding the subcommand's parser (which sets ``func``).
# The Ray job registers here as well: "run": add_run_parser (from pipelines' job module).
def add_run_parser(sub: argparse._SubParsersAction) -> None:
    # Listed for `infoform --help`; `main` hands `infoform run ...` to pipelines.cli.job.main,
    # which owns the full parser (shared with jobs/imagenet_inf.py).
    sub.add_parser("run", help="the Ray job: curvature, posteriors, search, evaluation, report "
                               "(same flags as jobs/imagenet_inf.py; see `infoform run --help`)", add_help=False)


SUBCOMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {
    "sizes": add_sizes_parser,
    "run": add_run_parser,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Laplace posteriors (Diag, KFAC, EFB, INF) for torchvision classifiers, computed on Ray.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS.values():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        from pipelines.cli.job import main as job_main

        return job_main(argv[1:], prog=f"{PROG} run")
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_usage(sys.stderr)
        print(f"{PROG}: error: choose a command: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except CliError as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `infoform sizes ... | head`
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
