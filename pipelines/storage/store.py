"""One store per run: where the run writes and how every URI of it is reached.

:class:`RunStore` is built once by the driver (``infoform run`` / ``score`` / ``report``) from
the run's output and its ``storage`` section, with the S3 endpoint resolved there
(:meth:`StorageOptions.resolved`). It is a frozen dataclass of plain data, so the same object
is handed to the stages, pickled into Ray Train workers, Ray Data tasks and actors, and read
the same way everywhere: nothing below the driver looks at the environment or takes an
endpoint again.

It offers the IO the code needs, for artifacts under :attr:`RunStore.output` and for data
elsewhere (training images, weights, posteriors of another run) with the same options, and the
artifact layout of :mod:`pipelines.storage.layout` relative to its output. ``for_model(name)``
is the store of one model's subtree in an audit (``models/<name>/``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import fsspec

from pipelines.storage import layout
from pipelines.storage import uris
from pipelines.storage.uris import StorageOptions

__all__ = ["RunStore"]


@dataclass(frozen=True)
class RunStore:
    """The run's output URI (``None``: a store that only reads) and its resolved storage options."""

    output: str | None = None
    options: StorageOptions = field(default_factory=StorageOptions)

    @classmethod
    def open(cls, output: str | os.PathLike | None = None, options: StorageOptions | None = None) -> "RunStore":
        """The driver's one call: ``options`` resolved here (endpoint from ``AWS_ENDPOINT_URL_S3`` /
        ``AWS_ENDPOINT_URL`` when unset); the result travels unchanged."""
        if options is not None and not isinstance(options, StorageOptions):
            raise ValueError(f"expected StorageOptions, got {type(options).__name__}")
        return cls(None if output is None else os.fspath(output), (options or StorageOptions()).resolved())

    def at(self, output: str) -> "RunStore":
        """The same options with another output (e.g. a run read by ``score``)."""
        return RunStore(os.fspath(output), self.options)

    def for_model(self, model: str) -> "RunStore":
        """The store of one model's own tree (``models/<model>/``) in an audit of several models."""
        return self.at(layout.model_dir(self._out(), model))

    def _out(self) -> str:
        if self.output is None:
            raise ValueError("this store has no output (it only reads)")
        return self.output

    # ------------------------------------------------------------------ IO, any URI, the run's options
    def fs(self, uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
        """Filesystem and its native path for ``uri`` (:func:`pipelines.storage.uris.get_fs`)."""
        return uris.get_fs(uri, self.options)

    def fsspec_options(self, uri: str) -> dict[str, Any]:
        """``storage_options`` for fsspec readers of ``uri`` (``{}`` for local paths)."""
        return uris.fsspec_options(uri, self.options)

    def exists(self, uri: str) -> bool:
        return uris.exists(uri, self.options)

    def isdir(self, uri: str) -> bool:
        return uris.isdir(uri, self.options)

    def read_bytes(self, uri: str) -> bytes:
        return uris.read_bytes(uri, self.options)

    def write_bytes_atomic(self, uri: str, data: bytes) -> None:
        uris.write_bytes_atomic(uri, data, self.options)

    def read_json(self, uri: str) -> Any:
        return uris.read_json(uri, self.options)

    def write_json_atomic(self, uri: str, obj: Any) -> None:
        uris.write_json_atomic(uri, obj, self.options)

    def listdir(self, uri: str) -> list[str]:
        return uris.listdir(uri, self.options)

    def remove(self, uri: str, recursive: bool = False) -> None:
        uris.remove(uri, recursive, self.options)

    # ------------------------------------------------------------------ the layout, under the output
    def uri(self, *parts: str) -> str:
        """A path under the output."""
        return uris.join(self._out(), *parts)

    def config_uri(self) -> str:
        return layout.config_uri(self._out())

    def run_json_uri(self) -> str:
        return layout.run_json_uri(self._out())

    def stage_marker_uri(self, stage: str) -> str:
        return layout.stage_marker_uri(self._out(), stage)

    def pass_uri(self, name: str) -> str:
        return layout.pass_uri(self._out(), name)

    def reduced_uri(self) -> str:
        return layout.reduced_uri(self._out())

    def basis_uri(self) -> str:
        return layout.basis_uri(self._out())

    def subnet_uri(self) -> str:
        return layout.subnet_uri(self._out())

    def subnet_partial_uri(self) -> str:
        return layout.subnet_partial_uri(self._out())

    def curvature_summary_uri(self) -> str:
        return layout.curvature_summary_uri(self._out())

    def worker_report_uri(self) -> str:
        return layout.worker_report_uri(self._out())

    def posterior_uri(self, method: str) -> str:
        return layout.posterior_uri(self._out(), method)

    def eval_dir(self) -> str:
        return layout.eval_dir(self._out())

    def eval_uri(self, method: str) -> str:
        return layout.eval_uri(self._out(), method)

    def search_table_uri(self, method: str | None = None) -> str:
        return layout.search_table_uri(self._out(), method)

    def tune_uri(self) -> str:
        return layout.tune_uri(self._out())

    def figure_uri(self, name: str, model: str | None = None) -> str:
        return layout.figure_uri(self._out(), name, model)

    def report_uris(self) -> dict[str, str]:
        return layout.report_uris(self._out())

    def model_dir(self, model: str) -> str:
        return layout.model_dir(self._out(), model)

    def train_storage_uri(self) -> str:
        return layout.train_storage_uri(self._out())
