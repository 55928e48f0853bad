"""One store per run (:class:`pipelines.storage.store.RunStore`): built once, plain data that
pickles to workers unchanged, the layout relative to its output; and the store is no longer
threaded by hand as an ``endpoint_url`` parameter (issue 30, acceptance 2)."""
from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from pipelines.storage import layout
from pipelines.storage.store import RunStore
from pipelines.storage.uris import StorageOptions

ROOT = Path(__file__).resolve().parents[1]

#: the storage boundary and the CLI flag / config key may name it; nothing else
MAX_ENDPOINT_URL_LINES = 15


def _endpoint_url_lines(root: Path = ROOT) -> list[str]:
    """``grep -rn endpoint_url pipelines laplace_core`` under ``root``."""
    hits = []
    for pkg in ("pipelines", "laplace_core"):
        for path in sorted((root / pkg).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if "endpoint_url" in line:
                    hits.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    return hits


def test_endpoint_url_is_named_only_at_the_storage_boundary():
    hits = _endpoint_url_lines()
    assert len(hits) <= MAX_ENDPOINT_URL_LINES, "\n".join(hits)
    # no function below the driver takes it as a parameter again
    params = [h for h in hits if re.search(r"(def \w+\(|^\s*)[^#]*\bendpoint_url\s*:\s*(str|storage|Store)", h.split(": ", 1)[1])
              and "StorageOptions" not in h and "schema.py" not in h and "uris.py" not in h]
    assert params == [], params


def test_the_counter_sees_a_planted_parameter(tmp_path):
    """The count above is of real files: a module that threads the endpoint again is seen."""
    (tmp_path / "pipelines" / "stage").mkdir(parents=True)
    (tmp_path / "laplace_core").mkdir()
    (tmp_path / "pipelines" / "stage" / "x.py").write_text(
        "def load(uri, endpoint_url: str | None = None):\n    return read(uri, endpoint_url)\n")
    assert len(_endpoint_url_lines(tmp_path)) == 2


def test_run_store_pickles_and_round_trips(tmp_path):
    opts = StorageOptions("http://127.0.0.1:9", {"config_kwargs": {"s3": {"addressing_style": "path"}}})
    store = RunStore.open(tmp_path / "run", opts)
    again = pickle.loads(pickle.dumps(store))
    assert again == store and again.options == opts and again.output == str(tmp_path / "run")
    # the same IO through the unpickled copy (what a worker or actor does)
    again.write_json_atomic(again.run_json_uri(), {"count": 3})
    assert store.exists(store.run_json_uri()) and store.read_json(store.run_json_uri()) == {"count": 3}
    assert store.listdir(store.output) == ["run.json"]
    store.write_bytes_atomic(store.uri("figures", "a.png"), b"png")
    assert again.read_bytes(layout.figure_uri(str(tmp_path / "run"), "a")) == b"png"
    store.remove(store.uri("figures"), recursive=True)
    assert not store.exists(store.uri("figures")) and store.fsspec_options(store.output) == {}
    # s3:// URIs elsewhere are reached with the same options
    s3 = store.fsspec_options("s3://bucket/data")
    assert s3["endpoint_url"] == "http://127.0.0.1:9" and s3["config_kwargs"] == opts.options["config_kwargs"]


def test_layout_is_relative_to_the_output_and_for_model_nests(tmp_path):
    out = str(tmp_path / "audit")
    store = RunStore.open(out)
    assert store.config_uri() == layout.config_uri(out)
    assert store.stage_marker_uri("search") == layout.stage_marker_uri(out, "search")
    assert store.posterior_uri("inf") == layout.posterior_uri(out, "inf")
    assert store.search_table_uri("kfac") == layout.search_table_uri(out, "kfac")
    sub = store.for_model("resnet18")
    assert sub.output == layout.model_dir(out, "resnet18") and sub.options == store.options
    assert sub.reduced_uri() == layout.reduced_uri(layout.model_dir(out, "resnet18"))
    with pytest.raises(ValueError, match="no output"):
        RunStore().config_uri()


def test_endpoint_is_resolved_once_on_the_driver(tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:7")
    store = RunStore.open(tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:8")  # a worker's own environment
    assert store.options.endpoint == "http://127.0.0.1:7"
    assert pickle.loads(pickle.dumps(store)).fsspec_options("s3://b/k")["endpoint_url"] == "http://127.0.0.1:7"
    with pytest.raises(ValueError, match="StorageOptions"):
        RunStore.open(tmp_path, "http://127.0.0.1:7")
