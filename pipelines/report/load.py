"""Read a run's report inputs back from its output (local or s3://): the evaluation metrics
and the Parquet search table. See ``docs/design.md`` (artifacts layout) for where they live."""
from __future__ import annotations

import io
from typing import Any

from pipelines.report.inputs import search_rows
from pipelines.report.methods import order_methods
from pipelines.storage import uris as storage

__all__ = ["load_eval_metrics", "read_search_table"]


def load_eval_metrics(output_uri: str, endpoint_url: str | None = None) -> dict[str, dict]:
    """``{method: metrics}`` from ``<output>/eval/<method>/metrics.json``."""
    eval_dir = storage.join(output_uri, "eval")
    out = {}
    for name in storage.listdir(eval_dir, endpoint_url):
        uri = storage.join(eval_dir, name, "metrics.json")
        if storage.exists(uri, endpoint_url):
            out[name] = storage.read_json(uri, endpoint_url)
    if not out:
        raise ValueError(f"no eval/<method>/metrics.json under {output_uri}")
    return {m: out[m] for m in order_methods(out)}


def read_search_table(uri: str, endpoint_url: str | None = None) -> list[dict[str, Any]]:
    """A Parquet search table (local or s3://) as row dicts (see :func:`search_rows`)."""
    import pyarrow.parquet as pq

    return search_rows(pq.read_table(io.BytesIO(storage.read_bytes(uri, endpoint_url))))

