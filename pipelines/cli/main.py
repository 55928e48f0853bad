"""The ``infoform`` command line (also ``python -m pipelines`` and ``jobs/imagenet_inf.py``).

Subcommands live in the explicit registry :data:`SUBCOMMANDS` (name -> function that adds
its parser). Each parser sets ``func``; ``func(args) -> int`` is the exit code.

* ``infoform run ...``: the Ray job (:func:`cmd_run`): preset + flags + ``--set`` overrides
  -> frozen config -> preflight -> Ray -> :func:`pipelines.cli.run.run` -> where the report
  is. ``jobs/imagenet_inf.py`` is the same parser (:func:`get_args_parser`) and command::

      ray job submit --working-dir . -- python jobs/imagenet_inf.py --preset imagenet-resnet50 \\
          --data s3://bucket/imagenet --weights s3://bucket/resnet50.pt --output s3://bucket/runs/r50

  With no data arguments it runs the embedded ``demo`` preset on a local Ray instance.
* ``infoform score --run URI --data URI --output URI ...``: a finished run's posterior on new
  images, one Parquet row per image (:mod:`pipelines.cli.score_cmd`, :mod:`pipelines.serve.score`).
* ``infoform config [--list] [PREFIX]``: every config key with its default, valid range or
  values, and help, from the one place they are written (:mod:`pipelines.config.schema`).
* ``infoform sizes --model NAME [--rank K] [--stats URI] [--norm-layers map|diag] [--layers all|last|NAMES] [--json]``: numbers stored per
  posterior method for any torchvision or ``timm:NAME`` classifier, built without weights on the
  ``meta`` device (no weights, no data, offline). See :mod:`laplace_core.posteriors.sizes`.

Usage errors (unknown model, bad flag values, a bad config) print one line to stderr and
exit 2; a stage that fails exits 1 with one line.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Callable

from pipelines.config.load import list_presets, load_config, preset_settings
from pipelines.config.schema import ConfigError, RunConfig

__all__ = ["CliError", "SUBCOMMANDS", "build_parser", "build_torchvision_model", "get_args_parser",
           "config_from_args", "cmd_run", "run_job", "main"]

PROG = "infoform"


class CliError(Exception):
    """A usage error: reported as one line on stderr, exit code 2."""


# --------------------------------------------------------------------------- run
class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (exit code 2), no usage wall."""

    def error(self, message: str):  # noqa: D401
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def get_args_parser(add_help: bool = False) -> argparse.ArgumentParser:
    p = _OneLineParser(description="INF Laplace posterior + calibration/OOD audit on Ray", add_help=add_help,
                       prog="imagenet_inf.py")
    p.add_argument("--preset", default=None,
                   help=f"YAML preset in configs/ or a path ({', '.join(list_presets())}); default: custom when "
                        "--data, --model or --weights is given (your own model and data), else demo")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set curvature.num_workers=4 (repeatable; every key, "
                        "its default and range: infoform config --list)")
    p.add_argument("--output", help="output URI (local path or s3://bucket/prefix)")
    p.add_argument("--data", help="dataset root (ImageNet/ImageFolder layout or Parquet shards), local or s3://")
    p.add_argument("--relist", action="store_true",
                   help="list the data again instead of reusing the index stored under <output>/index/")
    p.add_argument("--ood", action="append", metavar="NAME=URI",
                   help="an OOD image set, local or s3:// (repeatable; a bare folder is named after it; "
                        "groups: data.ood in the config)")
    p.add_argument("--labels-csv", help="LOC_val_solution.csv-style labels for a flat val/ folder")
    p.add_argument("--model", help="torchvision name (e.g. resnet50), timm:NAME or package.module:callable returning a model")
    p.add_argument("--weights", help="state-dict file (local or s3://) or torchvision weights enum name")
    p.add_argument("--methods", help="comma-separated: diag,kfac,kfac_exact,efb,inf,subnet,temperature")
    p.add_argument("--rank", type=int, help="INF rank K (Algorithm 1)")
    p.add_argument("--num-workers", type=int, help="Ray Train workers for the curvature passes")
    p.add_argument("--limit", type=int, help="use at most this many training images (class-balanced)")
    p.add_argument("--pred-type", choices=("nn", "glm"), help="predictive: weight sampling (nn) or linearized (glm)")
    p.add_argument("--stages", help="comma-separated subset of curvature,posterior,search,evaluate,report")
    p.add_argument("--force", help="comma-separated stages to redo even when their artifacts exist")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint URL (credentials come from the AWS chain)")
    p.add_argument("--reuse", metavar="URI|auto|none",
                   help="take the curvature, posteriors and search of this earlier run (read in place) and evaluate "
                        "only; auto (default): a matching run under --history (docs/scheduled-audits.md)")
    p.add_argument("--history", metavar="ROOT",
                   help="audit root: each run adds its own object under ROOT/history/; auto reuse looks there")
    p.add_argument("--alert", metavar="RULES",
                   help="e.g. 'ece>0.05,accuracy<0.70,inf.ood_auroc<0.8': exit code 3 and <output>/alerts.json "
                        "when one fires")
    p.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else a local instance)")
    p.add_argument("--dry-run", action="store_true", help="parse and validate the config, print it, and exit")
    p.add_argument("--verbose", action="store_true", help="also show Ray's own log lines (Train, Data, the local instance)")
    return p


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Preset + explicit flags + ``--set`` overrides (in that order) -> validated config."""
    flags: list[str] = []

    def put(key: str, value) -> None:
        if value is not None:
            flags.append(f"{key}={value}")

    put("output", args.output)
    put("data.root", args.data)
    if args.ood:
        flags.append(f"data.ood={json.dumps(list(args.ood))}")
    put("data.labels_csv", args.labels_csv)
    put("storage.endpoint_url", args.endpoint_url)
    put("data.limit", args.limit)
    if args.data is not None:
        flags.append("data.demo=false")
    if getattr(args, "relist", False):
        flags.append("data.relist=true")
    put("model.name", args.model)
    put("model.weights", args.weights)
    if args.methods is not None:
        flags.append(f"posterior.methods=[{args.methods}]")
    put("posterior.rank", args.rank)
    put("curvature.num_workers", args.num_workers)
    put("evaluate.pred_type", args.pred_type)
    if args.stages is not None:
        flags.append(f"stages=[{args.stages}]")
    if args.force is not None:
        flags.append(f"force=[{args.force}]")
    flags += schedule_flags(args)
    preset, derived = chosen_preset(args)
    return load_config(preset, derived + flags + list(args.overrides))


def schedule_flags(args: argparse.Namespace) -> list[str]:
    """``--reuse``, ``--history``, ``--alert`` as ``schedule.*`` settings."""
    out = [f"schedule.{k}={json.dumps(v)}" for k, v in (("reuse", getattr(args, "reuse", None)),
                                                         ("history", getattr(args, "history", None))) if v is not None]
    if getattr(args, "alert", None) is not None:
        out.append(f"schedule.alert={json.dumps([r.strip() for r in args.alert.split(',') if r.strip()])}")
    return out


def chosen_preset(args: argparse.Namespace) -> tuple[str, list[str]]:
    """``--preset``, or with none: ``custom`` when ``--data`` / ``--model`` / ``--weights`` point at a
    model and data of one's own (with the settings derived from the model,
    :func:`pipelines.ingest.plan.custom_preset`), else the embedded ``demo``."""
    if args.preset is not None:
        return args.preset, []
    if args.data is None and args.model is None and args.weights is None:
        return "demo", []
    if args.model is None:
        raise ConfigError("--data without a preset is your own model and data: give --model NAME (a torchvision "
                          "name, timm:NAME or package.module:callable) and --weights FILE (or --preset demo / smoke)")
    from pipelines.ingest.plan import custom_preset

    return "custom", custom_preset(args.model, args.weights, args.data, getattr(args, "overrides", None) or ())[0]


def preset_line(args: argparse.Namespace, cfg: RunConfig) -> str:
    """Which preset runs and why, in one line (the dry run's first line, the job's first log line)."""
    if cfg.preset == "custom" and getattr(args, "preset", None) is None:
        line = cfg.description
    elif getattr(args, "preset", None) is None:
        line = f"preset demo (no --preset and no --data/--model/--weights): {cfg.description}"
    else:
        line = f"preset {cfg.preset} (--preset {args.preset})" + (f": {cfg.description}" if cfg.description else "")
    if cfg.preset == "custom" and (px := f"at {cfg.data.image_size} px (resize {cfg.data.resize_size})") not in line:
        line += f"; data.image_size={cfg.data.image_size} as set: images {px} instead"
    if cfg.model.weights == "random" and "--weights random" not in line:
        line += "; --weights random: a test run with randomly initialised weights, not a trained model"
    return line


#: What a driver started outside ``ray job submit`` ships to the cluster (``--address``).
WORKING_DIR_EXCLUDES = [".venv", ".git", "runs", "*.pyc", "__pycache__", ".pytest_cache", "*.egg-info"]


def runtime_env_for(address: str | None) -> dict | None:
    """The runtime env for ``ray.init(address)``: inside a job started by ``ray job submit``
    (``RAY_JOB_CONFIG_JSON_ENV_VAR`` set) the job's own; otherwise this checkout as the
    working dir, so that the cluster's nodes import this code and not whatever ``pipelines``
    they happen to have."""
    if not address or os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        return None
    root = str(Path(__file__).resolve().parents[2])  # the repository: pipelines/cli/main.py
    return {"working_dir": root, "excludes": list(WORKING_DIR_EXCLUDES)}


def _init_ray(address: str | None) -> None:
    import logging

    import ray

    from pipelines.distributed.cluster import quiet_env, start_local_instance, verbose

    if ray.is_initialized():  # e.g. a notebook or a test session that started Ray itself
        return
    level = logging.INFO if verbose() else logging.WARNING
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        env = runtime_env_for(address)
        if env is not None:
            env["env_vars"] = quiet_env()
            print(f"infoform: connecting to {address}; shipping {env['working_dir']} as the job's working dir")
        ray.init(address=address, runtime_env=env, logging_level=level)
        return
    start_local_instance(level)


def run_job(argv: list[str] | None = None, prog: str = "imagenet_inf.py") -> int:
    """``jobs/imagenet_inf.py``: the ``run`` command's parser, under the script's name."""
    parser = get_args_parser(add_help=True)
    parser.prog = prog
    return cmd_run(parser.parse_args(argv), prog)


def cmd_run(args: argparse.Namespace, prog: str | None = None) -> int:
    """Parse -> frozen config -> preflight -> Ray -> the stages -> where the report is."""
    prog = prog or f"{PROG} run"
    try:
        cfg = config_from_args(args)
        from pipelines.cli.preflight import preflight

        preflight(cfg, dry_run=args.dry_run)  # models; data, OOD, weights, output: before any cluster work
        from pipelines.cli.schedule import preflight_schedule

        preflight_schedule(cfg, dry_run=args.dry_run)  # alert rules, --reuse, --history (docs/scheduled-audits.md)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        import yaml

        from pipelines.config.load import to_dict

        print(f"# {preset_line(args, cfg)}")
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    if cfg.data.demo:
        why = ", no --preset given" if args.preset is None else ""
        print(f"infoform: running the embedded demo (preset {cfg.preset}{why}): digits in-distribution, "
              "rendered letters out-of-distribution, a small CNN trained on the spot")
    else:
        print(f"infoform: {preset_line(args, cfg)}")
    from pipelines.distributed.cluster import VERBOSE_ENV, quiet_env

    if getattr(args, "verbose", False):
        os.environ[VERBOSE_ENV] = "1"
    for k, v in quiet_env().items():  # this process (the driver's Ray Data)
        os.environ.setdefault(k, v)
    if not sys.stdout.isatty():  # a log file or a job's log: Ray's "(Actor pid=...)" prefixes without colour codes
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    from pipelines.errors import StageError
    from pipelines.errors import PreflightError
    from pipelines.ingest.index import DataError
    from pipelines.cli.run import run

    try:
        result = run(cfg, init_ray=lambda: _init_ray(args.address))
    except (PreflightError, DataError) as e:  # the cluster's shape, the splits' scan: on the driver, before any pass
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except StageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    from pipelines.cli.run import verdict_lines

    for line in verdict_lines(result.summary):
        print(f"infoform: {line}")
    print(f"infoform: report at {result.report_path}")
    from pipelines.cli.schedule import finish_run

    return finish_run(cfg, result.summary, result.output, log=lambda line: print(f"infoform: {line}"))  # 3: an alert


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


def _build_sizes_model(name: str, num_classes: int | None):
    """``timm:NAME`` through timm on the meta device (no weights), else a torchvision name."""
    from pipelines.ingest.models import build_meta
    from pipelines.ingest.timm_models import is_timm

    return build_meta(name, num_classes) if is_timm(name) else build_torchvision_model(name, num_classes=num_classes)[0]


def _examples(names: list[str]) -> list[str]:
    preferred = ["resnet18", "resnet50", "densenet121", "vgg16", "efficientnet_b0", "vit_b_16"]
    return [n for n in preferred if n in names] or names[:6]


def add_sizes_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sizes",
        help="numbers stored per posterior method for a torchvision or timm model (no data needed)",
        description=(
            "Count the numbers each Laplace posterior stores (Lee et al. 2020, Table 3 counting) "
            "for a torchvision or timm architecture built without weights. INF at rank K depends on the "
            "EFB eigenvalues: give --stats for the exact count, otherwise a lower bound is shown."
        ),
    )
    p.add_argument("--model", help="torchvision architecture name, e.g. resnet18, or timm:NAME (timm's registry)")
    p.add_argument("--num-classes", type=_positive_int, default=None, help="classifier outputs (default: the model's)")
    p.add_argument("--rank", type=_positive_int, default=None, help="INF rank K (top-K EFB eigenvalues per layer)")
    p.add_argument("--stats", default=None, metavar="URI", help="statistics with EFB sums (CurvatureStatistics.save)")
    p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint for an s3:// --stats")
    p.add_argument("--norm-layers", choices=("map", "diag"), default=None,
                   help="norm layers and free parameters: at MAP (Table 3's counting) or under a diagonal posterior; "
                        "default: what the job runs for --model without --preset (custom preset's norm_layers)")
    p.add_argument("--layers", default="all", metavar="all|last|NAMES",
                   help="layers under the posterior: all (default), last (the last curvature layer, e.g. fc) or "
                        "comma-separated layer names / globs (e.g. 'layer4,fc'); the others stay at MAP")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_sizes)


def _layer_selection(text: str):
    """``--layers``: ``all``, ``last`` or comma-separated names / globs."""
    if text in ("all", "last"):
        return text
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if not names:
        raise CliError(f"--layers {text!r}: give all, last or comma-separated layer names / globs")
    return names


def cmd_sizes(args: argparse.Namespace) -> int:
    from laplace_core.posteriors import sizes
    from laplace_core.curvature.layer_selection import LayerSelectionError

    if args.model is None and args.stats is None:
        raise CliError("give --model NAME (and/or --stats URI)")
    if args.stats is not None and args.rank is None:
        raise CliError("--stats is only used for the INF count: give --rank K too")
    stats = None
    if args.stats is not None:
        from laplace_core.curvature.statistics import CurvatureStatistics

        from pipelines.storage import uris as storage

        try:
            stats = CurvatureStatistics.load(args.stats, storage.fsspec_options(args.stats, args.endpoint_url))
        except (OSError, ValueError) as e:
            raise CliError(f"cannot load statistics {args.stats!r}: {e}") from None
    try:
        if args.model is not None:
            model = _build_sizes_model(args.model, args.num_classes)
            report = sizes.model_sizes(model, rank=args.rank, stats=stats, name=args.model, layers=_layer_selection(
                args.layers), norm_layers=args.norm_layers or preset_settings("custom").posterior.norm_layers)
        else:
            if args.layers != "all":
                raise CliError("--layers needs --model (the statistics hold the layers they were collected for)")
            report = sizes.statistics_sizes(stats, rank=args.rank, model=None)
    except LayerSelectionError as e:
        raise CliError(f"--layers: {e}") from None
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(sizes.format_table(report))
    return 0


# --------------------------------------------------------------------------- config
def add_config_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="every config key with its default, valid values and help",
                       description="The keys of the run config (YAML presets, --set KEY=VALUE), each written once "
                                   "in pipelines/config/schema.py.")
    p.add_argument("--list", action="store_true", help="list every key (the default)")
    p.add_argument("prefix", nargs="?", default="", help="only keys starting with this, e.g. evaluate.")
    p.set_defaults(func=cmd_config)


def cmd_config(args: argparse.Namespace) -> int:
    from pipelines.config.settings import describe

    rows = [r for r in describe(RunConfig) if r[0].startswith(args.prefix)]
    if not rows:
        raise CliError(f"no config key starts with {args.prefix!r}")
    width = max(len(key) for key, *_ in rows)
    for key, default, valid, help_text in rows:
        print(f"{key:<{width}}  {default}  [{valid}]  {help_text}".rstrip())
    return 0


# --------------------------------------------------------------------------- registry
def add_run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", parents=[get_args_parser(add_help=False)],
                       help="the Ray job: curvature, posteriors, search, evaluation, report",
                       description="INF Laplace posterior + calibration/OOD audit on Ray (as jobs/imagenet_inf.py)")
    p.set_defaults(func=cmd_run)


def add_score_parser(sub: argparse._SubParsersAction) -> None:
    from pipelines.cli.score_cmd import add_score_parser as add

    add(sub, _init_ray)


SUBCOMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {
    "run": add_run_parser,
    "sizes": add_sizes_parser,
    "score": add_score_parser,
    "config": add_config_parser,
}


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog=PROG,
        description="Laplace posteriors (Diag, KFAC, EFB, INF) for torchvision and timm classifiers, computed on Ray.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS.values():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
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
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
