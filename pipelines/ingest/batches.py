"""Partitions -> Ray Data -> (x, y) batches on Ray Train workers::

    ds = build_dataset(parts[i], cfg)       # ray.data.Dataset: image f32[3,H,W], label i64, path, valid
    TorchTrainer(loop, datasets={"train": ds}, dataset_config=exact_split_data_config(), ...)
    # (Ray Train's default split DROPS rows to equalise shards; this one does not)
    # inside a Ray Train worker (loop):
    for b in iter_valid_batches(ray.train.get_dataset_shard("train"), batch_size=32, device=dev):
        ...                                 # b.x, b.y: the valid rows; b.skipped: a SkipReport

``build_dataset`` decodes in Ray Data ``map_batches`` tasks (:func:`pipelines.ingest.decode.read_decode_batch`),
at most ``cfg.decode_batch_size`` images per task batch (:func:`decode_batch`);
``iter_local_batches`` gives the same columns decoded in this process, without Ray.
Invalid images are dropped by :func:`iter_valid_batches` and counted in :class:`SkipReport`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Sequence

import numpy as np

from pipelines.ingest.decode import read_decode_batch
from pipelines.ingest.index import DataConfig, DataError, DatasetIndex, Partition
from pipelines.storage import uris as storage

if TYPE_CHECKING:  # pragma: no cover
    import ray.data
    import torch

__all__ = [
    "MIN_DECODE_TASKS",
    "MAX_SKIP_EXAMPLES",
    "decode_batch",
    "build_dataset",
    "iter_local_batches",
    "SkipReport",
    "Batch",
    "iter_valid_batches",
    "exact_split_data_config",
]


def _decode_kwargs(source: DatasetIndex | Partition, cfg: DataConfig,
                   corruption: tuple[str, int, int] | None = None) -> dict[str, Any]:
    extra = {} if corruption is None else {"corruption": (str(corruption[0]), int(corruption[1]), int(corruption[2]))}
    return {**extra,
        "root": source.root,
        "format": source.format,
        "options": storage.resolve_options(cfg.storage_options) if storage.is_remote(source.root) else None,
        "image_size": cfg.image_size,
        "resize_size": cfg.resize_size,
        "mean": tuple(cfg.mean),
        "std": tuple(cfg.std),
    }


MIN_DECODE_TASKS = 8  # a source is cut into at least this many decode batches when it has the images


def decode_batch(n: int, decode_batch_size: int) -> int:
    """Images per decode batch for a source of ``n`` images: ``decode_batch_size``, or fewer
    so that there are at least ``MIN_DECODE_TASKS`` batches (never below 1).

    >>> decode_batch(100_000, 128), decode_batch(256, 128), decode_batch(20, 128), decode_batch(5, 4)
    (128, 32, 3, 1)
    """
    return max(1, min(int(decode_batch_size), math.ceil(n / MIN_DECODE_TASKS)))


def build_dataset(source: DatasetIndex | Partition, cfg: DataConfig,
                  corruption: tuple[str, int, int] | None = None) -> "ray.data.Dataset":
    """Lazy Ray Dataset over ``source``'s entries: read bytes + decode + eval transform in
    ``map_batches`` tasks (CPU, ``cfg.decode_num_cpus`` each, at most
    ``cfg.decode_batch_size`` images per call, see :func:`decode_batch`). Columns as
    ``read_decode_batch``. Nothing is materialised; pass it to
    ``TorchTrainer(datasets={...})`` and read it with :func:`iter_valid_batches`. The S3 endpoint
    is resolved on the driver and shipped to the tasks; credentials are not (each node
    uses its own AWS credential chain). ``corruption=(name, severity, seed)``: the decode
    tasks corrupt every image (ImageNet-C style, before normalisation; see
    :func:`pipelines.ingest.decode.read_decode_batch`).
    """
    import ray.data

    if corruption is not None:
        from pipelines.ingest.corruptions import check_corruption

        check_corruption(corruption[0], corruption[1])

    if len(source) == 0:
        raise DataError("cannot build a dataset from an empty index/partition")
    items = source.items()
    bs = decode_batch(len(items), cfg.decode_batch_size)
    blocks = max(1, min(1024, math.ceil(len(items) / bs)))
    ds = ray.data.from_items(items, override_num_blocks=blocks)
    return ds.map_batches(
        read_decode_batch,
        batch_size=bs,
        batch_format="numpy",
        fn_kwargs=_decode_kwargs(source, cfg, corruption),
        num_cpus=cfg.decode_num_cpus,
    )


def iter_local_batches(
    source: DatasetIndex | Partition, cfg: DataConfig, batch_size: int | None = None,
    corruption: tuple[str, int, int] | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Same columns as ``build_dataset``, decoded in this process (no Ray), in index order."""
    bs = batch_size or cfg.decode_batch_size
    if bs < 1:
        raise ValueError(f"batch_size must be >= 1, got {bs}")
    kw = _decode_kwargs(source, cfg, corruption)
    items = source.items()
    for s in range(0, len(items), bs):
        chunk = items[s : s + bs]
        batch = {k: np.asarray([it[k] for it in chunk], dtype=object) for k in ("path", "label", "shard", "row")}
        yield read_decode_batch(batch, **kw)


# --------------------------------------------------------------------------- consuming

#: How many example paths a SkipReport keeps.
MAX_SKIP_EXAMPLES = 10


@dataclass(frozen=True)
class SkipReport:
    """Images dropped as undecodable: ``count`` and up to MAX_SKIP_EXAMPLES ``(path, reason)``
    examples, kept sorted by path so ``merge`` is associative and commutative."""

    count: int = 0
    examples: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.count < 0 or len(self.examples) > self.count:
            raise ValueError(f"SkipReport: count={self.count} with {len(self.examples)} examples")

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.examples)

    def merge(self, other: "SkipReport") -> "SkipReport":
        ex = tuple(sorted(set(self.examples) | set(other.examples))[:MAX_SKIP_EXAMPLES])
        return SkipReport(self.count + other.count, ex)

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[str, str]]) -> "SkipReport":
        return cls(len(rows), tuple(sorted(set((str(p), str(e)) for p, e in rows))[:MAX_SKIP_EXAMPLES]))

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "examples": [{"path": p, "reason": r} for p, r in self.examples]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SkipReport":
        return cls(int(d["count"]), tuple((e["path"], e["reason"]) for e in d.get("examples", ())))


class Batch(NamedTuple):
    """x: float32 [B, 3, H, W] (valid rows only, on ``device``); y: int64 [B]; paths: the B
    relative paths; skipped: the rows of this batch dropped as invalid."""

    x: torch.Tensor
    y: torch.Tensor
    paths: tuple[str, ...]
    skipped: SkipReport


def iter_valid_batches(
    source: Any, batch_size: int = 32, device: torch.device | str | None = None, prefetch_batches: int = 1
) -> Iterator[Batch]:
    """Batches with invalid rows removed.

    ``source``: a Ray ``DataIterator`` (``ray.train.get_dataset_shard(name)``), a
    ``ray.data.Dataset``, or an iterable of column dicts (``iter_local_batches``).
    One Batch per underlying batch, also when it has 0 valid rows (so no skip is
    lost); ``x.shape[0]`` may therefore be 0 and is at most ``batch_size``.
    """
    import torch

    if hasattr(source, "iter_batches"):
        it = source.iter_batches(batch_size=batch_size, batch_format="numpy", prefetch_batches=prefetch_batches)
    else:
        it = iter(source)
    dev = torch.device(device) if device is not None else None
    for b in it:
        valid = np.asarray(b["valid"], dtype=bool)
        paths = [str(p) for p in b["path"]]
        errors = [str(e) for e in b["error"]] if "error" in b else ["invalid image"] * len(paths)
        bad = np.flatnonzero(~valid)
        good = np.flatnonzero(valid)
        skipped = SkipReport.from_rows([(paths[i], errors[i]) for i in bad])
        images = np.asarray(b["image"])
        x = torch.from_numpy(np.ascontiguousarray(images[good], dtype=np.float32))
        y = torch.from_numpy(np.asarray(b["label"], dtype=np.int64)[good])
        if dev is not None:
            x = x.to(dev, non_blocking=True)
            y = y.to(dev, non_blocking=True)
        yield Batch(x, y, tuple(paths[i] for i in good), skipped)


# --------------------------------------------------------------------------- Ray Train ingest


def exact_split_data_config(datasets_to_split: str | list[str] = "all") -> Any:
    """A ``ray.train.DataConfig`` that shards datasets across workers WITHOUT dropping rows.

    Ray Train's default ``DataConfig`` calls ``Dataset.streaming_split(n, equal=True)``,
    which silently drops up to ``n - 1`` rows per dataset to give every worker the same
    count; summed statistics must see every image once, so this one splits with
    ``equal=False`` (workers may then get different numbers of rows; every row goes to
    exactly one worker). Pass it as ``TorchTrainer(..., dataset_config=exact_split_data_config())``.
    Workers must not call ``ray.train.report`` per batch (it is a barrier): report once
    after the loop.
    """
    return _exact_split_class()(datasets_to_split=datasets_to_split)


_EXACT_SPLIT_CLS: Any = None


def _exact_split_class() -> type:
    global _EXACT_SPLIT_CLS
    if _EXACT_SPLIT_CLS is not None:
        return _EXACT_SPLIT_CLS
    import ray.train

    class ExactSplitDataConfig(ray.train.DataConfig):
        """ray.train.DataConfig with ``streaming_split(equal=False)`` (no dropped rows)."""

        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            output: list[dict[str, Any]] = [{} for _ in range(world_size)]
            to_split = set(datasets) if self._datasets_to_split == "all" else set(self._datasets_to_split)
            hints = worker_node_ids if getattr(self, "_enable_shard_locality", True) else None
            for name, ds in datasets.items():
                if ds.name is None:
                    ds.set_name(name)
                ds = ds.copy(ds)
                resolve = getattr(self, "_resolve_execution_options", None)
                ds.context.execution_options = resolve(name) if resolve else self.default_ingest_options()
                if name in to_split:
                    for i, split in enumerate(ds.streaming_split(world_size, equal=False, locality_hints=hints)):
                        output[i][name] = split
                else:
                    for i in range(world_size):
                        output[i][name] = ds.iterator()
            return output

    _EXACT_SPLIT_CLS = ExactSplitDataConfig
    return ExactSplitDataConfig

