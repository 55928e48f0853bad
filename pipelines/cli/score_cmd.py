"""``infoform score`` (and ``jobs/score.py`` for ``ray job submit``): a finished run's posterior on
new data, one Parquet row per image (:mod:`pipelines.serve.score`)::

    infoform score --run runs/smoke --data s3://bucket/new-images --output s3://bucket/scores/week42 \\
        [--method inf] [--pred-type nn|glm] [--model-name NAME] [--flag-at X] [--endpoint-url URL]

``--data run:test`` (or ``run:search``, ``run:ood``) scores one of the run's own splits. Everything
that can be checked without the cluster is checked first: the run (finished, the model named,
its weights and posteriors present), the method and predictive, the data, an output holding
another scoring; each problem is one line and exit code 2. A failure on the cluster is one line
and exit code 1.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

__all__ = ["add_score_parser", "cmd_score", "resolve_data", "RUN_SPLITS"]

#: ``--data run:<split>``: one of the run's own splits.
RUN_SPLITS = ("test", "search", "ood")


def add_score_parser(sub: argparse._SubParsersAction, init_ray: Callable[[str | None], None]) -> None:
    p = sub.add_parser("score", help="score new images with a finished run's posterior (Ray Data, Parquet out)",
                       description="Per-image predictive, uncertainty (entropy, mutual information) and a flag "
                                   "for new data, with the posterior of a finished run.")
    p.add_argument("--run", required=True, help="output URI of a finished run (local or s3://)")
    p.add_argument("--data", required=True,
                   help="images to score: a folder or Parquet shards (local or s3://), or run:test / run:search / "
                        "run:ood for one of the run's own splits")
    p.add_argument("--output", required=True, help="where the Parquet blocks go (local or s3://)")
    p.add_argument("--method", help="map, a posterior method of the run, or temperature (default: inf, else the "
                                    "run's first posterior)")
    p.add_argument("--pred-type", choices=("nn", "glm"),
                   help="predictive (default: the one the run's search chose for the method, else evaluate.pred_type)")
    p.add_argument("--model-name", help="the model the run must hold (and which model of an audit)")
    p.add_argument("--n-samples", type=int, help="MC samples K (default: the run's evaluate.mc_samples)")
    p.add_argument("--top-k", type=int, default=5, help="top-k classes and probabilities per image (default 5)")
    p.add_argument("--block-size", type=int, default=1024, help="images per output Parquet file (default 1024)")
    p.add_argument("--flag-at", type=float, help="flag images whose predictive entropy (nats) exceeds this "
                                                 "(default: the entropy at 95%% TPR on the run's test split)")
    p.add_argument("--keep-probs", action="store_true", help="also write the full probability vector per image")
    p.add_argument("--num-actors", type=int, help="scoring actors (default: the run's evaluate.num_actors)")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint URL (credentials come from the AWS chain)")
    p.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else a local instance)")
    p.set_defaults(func=lambda a: cmd_score(a, init_ray))


def resolve_data(info: Any, data: str) -> tuple[Any, Any]:
    """``(index, data config)`` of ``--data``: one of the run's splits, or the images under a URI
    decoded with the run's transforms (scanned on the driver; unlabeled)."""
    from pipelines.ingest.scan import scan

    if data.startswith("run:"):
        name = data[4:]
        if name not in RUN_SPLITS:
            raise ValueError(f"--data {data!r}: valid run splits are {', '.join('run:' + s for s in RUN_SPLITS)}")
        return info.split(name)
    dcfg = info.data_config(data)
    return scan(dcfg), dcfg


def _settings(args: argparse.Namespace, info: Any):
    from pipelines.evaluation.predictors import check_pred_type
    from pipelines.serve.score import ScoreSettings

    ev = info.config.evaluate
    method = info.check_method(args.method or info.default_method())
    pred_type = args.pred_type or info.pred_type_of(method)
    check_pred_type(pred_type)
    return ScoreSettings(method=method, pred_type=pred_type,
                         n_samples=args.n_samples or ev.mc_samples, seed=ev.seed, top_k=args.top_k,
                         block_size=args.block_size, keep_probs=args.keep_probs, pool_size=args.num_actors)


def _prepare(args: argparse.Namespace):
    """Every check before the cluster: ``(info, settings, index, data config)``; the run's store
    (:class:`pipelines.storage.store.RunStore`, built here once) travels in ``info.store``."""
    from pipelines.serve.run_loader import read_run
    from pipelines.serve.score import plan_blocks
    from pipelines.storage.store import RunStore
    from pipelines.storage.uris import StorageOptions

    info = read_run(RunStore.open(args.run, StorageOptions(args.endpoint_url)), args.model_name)
    s = _settings(args, info)
    if args.flag_at is not None and not (args.flag_at == args.flag_at):
        raise ValueError("--flag-at must be a number")
    index, dcfg = resolve_data(info, args.data)
    plan_blocks(info, index, args.output, s, args.flag_at, check_only=True)
    return info, s, index, dcfg


def cmd_score(args: argparse.Namespace, init_ray: Callable[[str | None], None], prog: str = "infoform score") -> int:
    from pipelines.config.schema import ConfigError
    from pipelines.errors import StageError

    try:
        info, s, index, dcfg = _prepare(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    import os

    import ray
    import ray.data

    from pipelines.distributed.cluster import quiet_env
    from pipelines.serve.score import flag_threshold, score_index

    for k, v in quiet_env().items():  # this process's Ray Data: our own progress lines
        os.environ.setdefault(k, v)
    if not ray.is_initialized():
        init_ray(args.address)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = ctx.print_on_execution_start = False
    try:
        threshold = args.flag_at
        if threshold is None:
            threshold = flag_threshold(info, s)["entropy"]
        res = score_index(info, index, dcfg, args.output, s, threshold)
    except StageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    print(f"infoform: scores of {len(index)} images ({s.key()}, flag at entropy > {threshold:.4g}) in "
          f"{res['output']}")
    return 0
