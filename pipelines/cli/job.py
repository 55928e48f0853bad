"""The job's command line: ``jobs/imagenet_inf.py`` and ``infoform run`` (same parser).

Laplace posteriors in the sparse information form for an ImageNet-scale classifier.

    ray job submit --working-dir . -- python jobs/imagenet_inf.py --preset imagenet-resnet50 \\
        --data s3://bucket/imagenet --weights s3://bucket/resnet50.pt --output s3://bucket/runs/r50

With no data arguments it runs the embedded ``demo`` preset on a local Ray instance.
Thin on purpose: parse -> frozen config -> ``ray.init()`` -> ``pipelines.cli.run`` -> print
where the report is. ``infoform run`` is the same entry point.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipelines.config.schema import ConfigError, RunConfig

from pipelines.config.load import list_presets, load_config

__all__ = ["get_args_parser", "config_from_args", "main"]


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (exit code 2), no usage wall."""

    def error(self, message: str):  # noqa: D401
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def get_args_parser(add_help: bool = False) -> argparse.ArgumentParser:
    p = _OneLineParser(description="INF Laplace posterior + calibration/OOD audit on Ray", add_help=add_help,
                       prog="imagenet_inf.py")
    p.add_argument("--preset", default="demo", help=f"YAML preset in configs/ or a path ({', '.join(list_presets())})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set curvature.num_workers=4 (repeatable)")
    p.add_argument("--output", help="output URI (local path or s3://bucket/prefix)")
    p.add_argument("--data", help="dataset root (ImageNet/ImageFolder layout or Parquet shards), local or s3://")
    p.add_argument("--ood", help="out-of-distribution image folder")
    p.add_argument("--labels-csv", help="LOC_val_solution.csv-style labels for a flat val/ folder")
    p.add_argument("--model", help="torchvision name (e.g. resnet50) or package.module:callable returning an nn.Module")
    p.add_argument("--weights", help="state-dict file (local or s3://) or torchvision weights enum name")
    p.add_argument("--methods", help="comma-separated: diag,kfac,kfac_exact,efb,inf,subnet")
    p.add_argument("--rank", type=int, help="INF rank K (Algorithm 1)")
    p.add_argument("--num-workers", type=int, help="Ray Train workers for the curvature passes")
    p.add_argument("--limit", type=int, help="use at most this many training images (class-balanced)")
    p.add_argument("--pred-type", choices=("nn", "glm"), help="predictive: weight sampling (nn) or linearized (glm)")
    p.add_argument("--stages", help="comma-separated subset of curvature,posterior,search,evaluate,report")
    p.add_argument("--force", help="comma-separated stages to redo even when their artifacts exist")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint URL (credentials come from the AWS chain)")
    p.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else a local instance)")
    p.add_argument("--dry-run", action="store_true", help="parse and validate the config, print it, and exit")
    return p


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Preset + explicit flags + ``--set`` overrides (in that order) -> validated config."""
    flags: list[str] = []

    def put(key: str, value) -> None:
        if value is not None:
            flags.append(f"{key}={value}")

    put("output", args.output)
    put("data.root", args.data)
    put("data.ood", args.ood)
    put("data.labels_csv", args.labels_csv)
    put("storage.endpoint_url", args.endpoint_url)
    put("data.limit", args.limit)
    if args.data is not None:
        flags.append("data.demo=false")
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
    return load_config(args.preset, flags + list(args.overrides))


#: What a driver started outside ``ray job submit`` ships to the cluster (``--address``).
WORKING_DIR_EXCLUDES = [".venv", ".git", "runs", "*.pyc", "__pycache__", ".pytest_cache", "*.egg-info"]


def runtime_env_for(address: str | None) -> dict | None:
    """The runtime env for ``ray.init(address)``: inside a job started by ``ray job submit``
    (``RAY_JOB_CONFIG_JSON_ENV_VAR`` set) the job's own; otherwise this checkout as the
    working dir, so that the cluster's nodes import this code and not whatever ``pipelines``
    they happen to have."""
    if not address or os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        return None
    root = str(Path(__file__).resolve().parents[2])  # the repository: pipelines/cli/job.py
    return {"working_dir": root, "excludes": list(WORKING_DIR_EXCLUDES)}


def _init_ray(address: str | None) -> None:
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        env = runtime_env_for(address)
        if env is not None:
            print(f"infoform: connecting to {address}; shipping {env['working_dir']} as the job's working dir")
        ray.init(address=address, runtime_env=env)
    else:
        # A private local instance: loopback only (ENVIRONMENT.md).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(include_dashboard=False)


def main(argv: list[str] | None = None, prog: str = "imagenet_inf.py") -> int:
    parser = get_args_parser(add_help=True)
    parser.prog = prog
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        from pipelines.cli.preflight import preflight

        preflight(cfg, dry_run=args.dry_run)  # models; data, OOD, weights, output: before any cluster work
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        import yaml

        from pipelines.config.load import to_dict

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    if cfg.data.demo:
        print(f"infoform: running the embedded demo (preset {cfg.preset}): digits in-distribution, "
              "rendered letters out-of-distribution, a small CNN trained on the spot")
    from pipelines.errors import StageError
    from pipelines.errors import PreflightError
    from pipelines.cli.run import run

    try:
        result = run(cfg, init_ray=lambda: _init_ray(args.address))
    except PreflightError as e:  # found once the cluster's shape is known, before any pass
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except StageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    print(f"infoform: report at {result.report_path}")
    return 0
