"""Every artifact path of a run, in one place (docs/design.md §4).

A run's output (a local folder or an ``s3://`` prefix) holds::

    config.json                      the frozen config of the last invocation
    run.json                         the run summary (the audit's listing for several models)
    stages/<stage>.json              stage markers: fingerprint + summary (the commit point)
    reuse.json                       reuse keys + where the fitted stages live (pipelines.cli.reuse)
    alerts.json                      the --alert rules checked and those that fired (pipelines.cli.alerts)
    stats/passes/<pass>/             per-partition sums and checkpoints of each pass
    stats/reduced/ stats/eigenbasis/ the all-reduced statistics and the eigenbasis
    stats/subnet/ stats/subnet_partial/   the subnet pass's S x S Fisher (final / running)
    stats/curvature.json stats/worker_report.json
    posterior/<method>/              one saved posterior per method
    eval/<method>/                   metrics.json, accumulators.json, search.parquet, search.json
    eval/search.parquet              the search table of every method
    eval/tune/<method>-<key>/        the search's Ray Tune experiment state (resumed on re-submission)
    figures/<name>.png report.html report.md
    models/<model>/                  one such tree per model of an audit
    demo-data/ demo-model/           the embedded demo's data and CNN, with a remote output
    _ray_train/                      Ray Train's own run folder (local outputs)
"""
from __future__ import annotations

from pipelines.storage.uris import join

__all__ = [
    "config_uri", "run_json_uri", "stage_marker_uri", "pass_uri", "reduced_uri", "basis_uri", "subnet_uri",
    "subnet_partial_uri", "curvature_summary_uri", "worker_report_uri", "posterior_uri", "eval_dir",
    "eval_uri", "search_table_uri", "tune_uri", "figure_uri", "report_uris", "model_dir", "demo_data_uri",
    "demo_model_uri", "train_storage_uri",
]


def config_uri(output: str) -> str:
    return join(output, "config.json")


def run_json_uri(output: str) -> str:
    return join(output, "run.json")


def stage_marker_uri(output: str, stage: str) -> str:
    """The marker that commits a stage: written last, after every artifact of the stage."""
    return join(output, "stages", f"{stage}.json")


def pass_uri(output: str, name: str) -> str:
    """One partitioned pass's folder (per-partition sums, checkpoints, manifest)."""
    return join(output, "stats", "passes", name)


def reduced_uri(output: str) -> str:
    return join(output, "stats", "reduced")


def basis_uri(output: str) -> str:
    return join(output, "stats", "eigenbasis")


def subnet_uri(output: str) -> str:
    return join(output, "stats", "subnet")


def subnet_partial_uri(output: str) -> str:
    return join(output, "stats", "subnet_partial")


def curvature_summary_uri(output: str) -> str:
    return join(output, "stats", "curvature.json")


def worker_report_uri(output: str) -> str:
    return join(output, "stats", "worker_report.json")


def posterior_uri(output: str, method: str) -> str:
    return join(output, "posterior", method)


def eval_dir(output: str) -> str:
    return join(output, "eval")


def eval_uri(output: str, method: str) -> str:
    """``eval/<method>/``: metrics.json, accumulators.json, search.parquet, search.json."""
    return join(output, "eval", method)


def search_table_uri(output: str, method: str | None = None) -> str:
    """The search table of every method (``method=None``) or of one method."""
    return join(output, "eval", "search.parquet") if method is None else join(eval_uri(output, method), "search.parquet")


def tune_uri(output: str) -> str:
    """``eval/tune/``: the search's Ray Tune experiments (one per method), for resuming."""
    return join(output, "eval", "tune")


def figure_uri(output: str, name: str, model: str | None = None) -> str:
    return join(output, "figures", f"{name}.png") if model is None else join(output, "figures", model, f"{name}.png")


def report_uris(output: str) -> dict[str, str]:
    return {"html": join(output, "report.html"), "md": join(output, "report.md")}


def model_dir(output: str, model: str) -> str:
    """One model's own output tree in an audit of several models."""
    return join(output, "models", model)


def demo_data_uri(output: str, *parts: str) -> str:
    return join(output, "demo-data", *parts)


def demo_model_uri(output: str, filename: str) -> str:
    return join(output, "demo-model", filename)


def train_storage_uri(output: str) -> str:
    return join(output, "_ray_train")
