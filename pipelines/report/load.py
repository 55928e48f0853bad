"""Read a run's report inputs back from its output (local or s3://): the evaluation metrics
and the Parquet search table. See ``docs/design.md`` (artifacts layout) for where they live."""
from __future__ import annotations

import io
from typing import Any

from pipelines.report.inputs import search_rows
from pipelines.report.methods import order_methods
from pipelines.storage import uris as storage
from pipelines.storage.store import RunStore

__all__ = ["load_eval_metrics", "read_search_table"]


def load_eval_metrics(store: RunStore) -> dict[str, dict]:
    """``{method: metrics}`` from ``<output>/eval/<method>/metrics.json`` of the run's store."""
    eval_dir = store.eval_dir()
    out = {}
    for name in store.listdir(eval_dir):
        uri = storage.join(eval_dir, name, "metrics.json")
        if store.exists(uri):
            out[name] = store.read_json(uri)
    if not out:
        raise ValueError(f"no eval/<method>/metrics.json under {store.output}")
    return {m: out[m] for m in order_methods(out)}


def read_search_table(uri: str, store: RunStore = RunStore()) -> list[dict[str, Any]]:
    """A Parquet search table (local or s3://) as row dicts (see :func:`search_rows`)."""
    import pyarrow.parquet as pq

    return search_rows(pq.read_table(io.BytesIO(store.read_bytes(uri))))

